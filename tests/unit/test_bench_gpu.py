"""``psgd bench gpu``: its command line, its pure helpers, the mlp part on the CPU, and every part on a GPU."""

from __future__ import annotations

import argparse
import math

import pytest

from psgd.bench import gpu
from psgd.cli import main as psgd_main
from psgd.compute import backend


def bench_gpu(*argv: str) -> argparse.Namespace:
    return psgd_main.build_parser().parse_args(["bench", "gpu", *argv])


def figures(row: dict) -> dict:
    """The row's numbers (flags and names aside)."""
    return {k: v for k, v in row.items() if not isinstance(v, (str, bool))}


def assert_positive_and_finite(rows: list[dict]) -> None:
    assert rows
    for row in rows:
        for key, value in figures(row).items():
            assert value is not None and math.isfinite(value) and value > 0, (key, value, row)


@pytest.mark.skipif(backend.cuda_available(), reason="a usable GPU is here: the command would run the benchmark")
def test_without_a_gpu_the_command_says_why_in_one_line_and_exits_2(capsys):
    with pytest.raises(backend.DeviceError) as reason:
        backend.check_cuda_available(0)
    assert psgd_main.main(["bench", "gpu"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().splitlines() == [f"psgd bench gpu: no usable GPU: {reason.value}"]


def test_the_cpu_is_refused_as_the_device_to_measure(capsys):
    assert psgd_main.main(["bench", "gpu", "--device", "cpu"]) == 2
    assert "measures a CUDA device, not cpu" in capsys.readouterr().err


def test_help_names_the_three_parts(capsys):
    with pytest.raises(SystemExit) as done:
        bench_gpu("--help")
    assert done.value.code == 0
    out = capsys.readouterr().out
    for part in ("mlp", "transfer", "nccl", "--parts", "--widths", "--transfer-mb", "--nccl-mb", "--json"):
        assert part in out
    with pytest.raises(SystemExit):
        psgd_main.build_parser().parse_args(["bench", "--help"])
    assert "gpu" in capsys.readouterr().out


def test_defaults_are_the_documented_ones():
    args = bench_gpu()
    assert args.parts == ("mlp", "transfer", "shm", "nccl") and args.device == "cuda:0"
    assert args.widths == (1024, 2048, 4096, 8192) and args.batch == 256
    assert args.transfer_mb == (40_000_000, 400_000_000)
    assert args.nccl_mb == (1_000_000, 16_000_000, 64_000_000, 256_000_000)


def test_flops_count_forward_two_and_backward_four_per_weight_and_example():
    assert gpu.mlp_step_flops(2, (3, 4, 5)) == 6 * 2 * (3 * 4 + 4 * 5) == 384
    w = 1024
    assert gpu.mlp_step_flops(256, (1024, w, w, 10)) == 6 * 256 * (1024 * w + w * w + w * 10)


def test_values_are_parsed_into_numbers_and_parts():
    assert gpu.positive_ints("1024, 2048,1024") == (1024, 2048)
    assert gpu.positive_int("7") == 7
    assert gpu.sizes_mb("1,0.5,400") == (1_000_000, 500_000, 400_000_000)
    assert gpu.sizes_mb("0.000005") == (4,)  # whole float32s
    assert gpu.parse_parts("nccl, mlp") == ("mlp", "nccl")
    args = bench_gpu("--parts", "transfer", "--widths", "64,128", "--transfer-mb", "1", "--nccl-mb", "2,4")
    assert args.parts == ("transfer",) and args.widths == (64, 128)
    assert args.transfer_mb == (1_000_000,) and args.nccl_mb == (2_000_000, 4_000_000)


@pytest.mark.parametrize(
    "parse, text, message",
    [
        (gpu.positive_ints, "0,1024", "at least 1"),
        (gpu.positive_ints, "-3", "at least 1"),
        (gpu.positive_ints, "1024,abc", "whole numbers"),
        (gpu.positive_ints, " , ", "give at least one"),
        (gpu.positive_int, "1,2", "one whole number"),
        (gpu.sizes_mb, "ten", "sizes in MB"),
        (gpu.sizes_mb, "0", "at least 4 bytes"),
        (gpu.sizes_mb, "-1", "at least 4 bytes"),
        (gpu.sizes_mb, "nan", "finite"),
        (gpu.sizes_mb, "inf", "finite"),
        (gpu.parse_parts, "mlp,gpu", "unknown gpu; choose from mlp, transfer, shm, nccl"),
        (gpu.parse_parts, "", "give at least one of mlp, transfer, shm, nccl"),
    ],
)
def test_bad_values_are_refused_with_what_was_wrong(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(text)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--widths", "0"),
        ("--widths", "1k"),
        ("--batch", "0"),
        ("--transfer-mb", "x"),
        ("--nccl-mb", "0"),
        ("--parts", "mlp,foo"),
        ("--repeats", "0"),
    ],
)
def test_the_command_line_refuses_bad_values_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as done:
        bench_gpu(flag, value)
    assert done.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_seconds_per_call_is_the_median_per_call():
    calls = []
    seconds = gpu.seconds_per_call(lambda: calls.append(1), backend.CPU, repeats=3, warmup=2, calls=4)
    assert len(calls) == 2 + 3 * 4 and 0 <= seconds < 0.01


def test_the_mlp_part_runs_psgds_loop_and_the_bare_matmuls_on_the_cpu(capsys):
    options = gpu.Options(widths=(16, 32), batch=8, steps=2, repeats=2, warmup=1, matmul_n=32)
    rows = gpu.mlp_part(backend.CPU, options)
    assert [r["width"] for r in rows] == [16, 32]
    assert_positive_and_finite(rows)
    assert rows[0]["flops"] == gpu.mlp_step_flops(8, (1024, 16, 16, 10))
    gpu.print_table("mlp", rows)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mlp: input 1024") and "psgd/bare" in out[1] and len(out) == 4


def test_a_figure_psgd_could_not_take_prints_as_a_dash_with_the_reason(capsys):
    row = {
        "part": "nccl",
        "size_bytes": 1_000_000,
        "size_mb": 1.0,
        "bare_ms": 0.5,
        "bare_algbw_gbps": 2.0,
        "psgd_ms": None,
        "psgd_algbw_gbps": None,
        "psgd_over_bare": None,
        "psgd_error": "CollectiveError: no",
    }
    gpu.print_table("nccl", [row])
    out = capsys.readouterr().out.splitlines()
    assert out[2].split() == ["1", "-", "0.500", "-", "-", "2.00"]
    assert out[3] == "nccl: psgd's side could not be measured: CollectiveError: no"


@pytest.mark.gpu
def test_every_part_measures_positive_finite_figures_on_a_gpu(capsys):
    device = backend.get_device("cuda:0")
    options = gpu.Options(
        widths=(64,), steps=2, repeats=2, warmup=1, matmul_n=256, transfer_sizes=(1_000_000,), nccl_sizes=(1_000_000,)
    )
    results = {}
    for part, measure in gpu.PART_FUNCTIONS.items():
        results[part] = rows = measure(device, options)
        assert all(not r.get("psgd_error") for r in rows), rows
        assert_positive_and_finite(rows)
        gpu.print_table(part, rows)
    paths = ("device.asarray(host)", "dev.set(host)", "to_host(dev, out=host)")
    assert {(r["host"], r["path"]) for r in results["transfer"]} == {
        ("pinned", "raw cudaMemcpy"),
        *((host, path) for host in ("pageable", "pinned") for path in paths),
    }
