"""Regenerate the gRPC code in this folder from ``protos/psgd/v1/ps.proto``.

Run ``python -m psgd.proto.codegen`` from the repository root after editing the
proto.  The generated files are committed; a test checks that running this
changes nothing (``--check``).
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PROTO = "psgd/v1/ps.proto"
OUTPUTS = ("ps_pb2.py", "ps_pb2.pyi", "ps_pb2_grpc.py")


def generate() -> dict[str, str]:
    """Run protoc (from grpcio-tools) and return {file name: text}, imports made package-relative."""
    from grpc_tools import protoc

    include = str(Path(protoc.__file__).resolve().parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{ROOT / 'protos'}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(ROOT / "protos" / PROTO),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out = {}
        for name in OUTPUTS:
            text = (Path(tmp) / "psgd" / "v1" / name).read_text()
            out[name] = text.replace("from psgd.v1 import ps_pb2", "from psgd.proto import ps_pb2")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed files differ")
    args = parser.parse_args(argv)
    stale = []
    for name, text in generate().items():
        path = HERE / name
        current = path.read_text() if path.exists() else ""
        if current != text:
            stale.append(name)
            if args.check:
                sys.stdout.writelines(
                    difflib.unified_diff(
                        current.splitlines(True), text.splitlines(True), f"committed/{name}", f"generated/{name}", n=1
                    )
                )
            else:
                path.write_text(text)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python -m psgd.proto.codegen", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
