import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_the_proto():
    """Regenerating psgd/proto from protos/ changes nothing (run python -m psgd.proto.codegen after edits)."""
    done = subprocess.run(
        [sys.executable, "-m", "psgd.proto.codegen", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_rpc_and_field_is_commented():
    lines = (ROOT / "protos" / "psgd" / "v1" / "ps.proto").read_text().splitlines()
    for i, line in enumerate(lines):
        text = line.strip()
        is_field = (
            text
            and not text.startswith(("//", "}", "message", "service", "oneof", "syntax", "package"))
            and text.endswith(";")
        )
        if text.startswith("rpc ") or is_field:
            assert lines[i - 1].strip().startswith("//"), f"line {i + 1} has no comment: {text}"
