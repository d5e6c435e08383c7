"""The lab's outputs: lab.json, a Markdown table, the figures (:mod:`psgd.bench.plots`) and the answer in
words (:mod:`psgd.bench.answer`, summary.md); what it prints, made to fit the terminal (:func:`terminal_text`)."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

from psgd.bench import answer, plots
from psgd.bench.labresult import LabResult, groups, median_summary
from psgd.ops import view

#: The table's columns: (header, function of a run's summary giving a number or text).
COLUMNS = (
    ("time to target s", lambda s: _num(s["time_to_target"], 2, "not reached", _spread(s, "time_to_target", 2))),
    ("updates to target", lambda s: _num(s["updates_to_target"], 0, "not reached")),
    ("gradients to target", lambda s: _num(s["steps_to_target"], 0, "not reached")),
    ("final accuracy", lambda s: _num(s["final_accuracy"], 3, spread=_spread(s, "final_accuracy", 3))),
    ("train s", lambda s: _num(s["train_seconds"], 2)),
    ("steps/s", lambda s: _num(s["steps_per_s"], 1, spread=_spread(s, "steps_per_s", 1))),
    ("updates/s", lambda s: _num(s["updates_per_s"], 1)),
    ("staleness p50", lambda s: _num(s["staleness_p50"], 0)),
    ("staleness p99", lambda s: _num(s["staleness_p99"], 0)),
    ("MB moved", lambda s: _num(None if s["bytes"] is None else s["bytes"] / 1e6, 1)),
    ("s per step", lambda s: _num(s.get("step_seconds"), 3)),
    ("link-bound s per step", lambda s: _num(s.get("link_step_seconds"), 3, "")),
)


def _spread(summary: dict, key: str, digits: int) -> str:
    """`` (least-most)`` over the repeats, where two or more differ at ``digits``; '' otherwise."""
    low, high = (f"{v:.{digits}f}" for v in summary.get("spread", {}).get(key, (0, 0)))
    return "" if low == high else f" ({low}-{high})"


def _num(value, digits: int, missing: str = "n/a", spread: str = "") -> str:
    """``value`` to ``digits`` places (``missing`` where there is none), then its ``spread`` over the repeats."""
    if value is None:
        return missing
    return f"{value:.{digits}f}{spread}"


def _cells(result: LabResult) -> tuple[list[str], list[list[str]]]:
    """The table's head and one row per (scenario, policy): medians over the repeats; a failed group says why."""
    columns = COLUMNS if result.links else COLUMNS[:-1]  # the link-bound step only on emulated links
    head = ["scenario", "policy", "reached", *(c[0] for c in columns)]
    rows = []
    for runs in groups(result):
        first = runs[0]
        if all(r.error and len(r.points) < 2 for r in runs):
            cells = [f"0/{len(runs)}", f"failed: {first.error.splitlines()[0][:80]}"] + [""] * (len(columns) - 1)
        else:
            summary = median_summary(runs)
            cells = [f"{summary['reached']}/{summary['runs']}", *(fn(summary) for _, fn in columns)]
        rows.append([first.scenario, first.label, *cells])
    return head, rows


def markdown_table(result: LabResult) -> str:
    """table.md's table: one row per (scenario, policy), every column side by side."""
    head, rows = _cells(result)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def terminal_text(result: LabResult, width: int | None = None) -> str:
    """What the lab prints: its table in blocks of columns that fit ``width`` (the terminal's; 80 where there is
    none), each led by the scenario and policy, then the table's notes and the answer, wrapped to it too."""
    width = width or shutil.get_terminal_size((80, 24)).columns
    head, rows = _cells(result)
    table = view.table(["scenario, policy", *head[2:]], [[f"{r[0]}, {r[1]}", *r[2:]] for r in rows], width)
    prose = table_notes(result) + "\n" + Path(result.files["summary"]).read_text()  # (written by write_all)
    wrapped = "\n".join(textwrap.fill(p, width) if p.strip() else "" for p in prose.splitlines())
    return table + "\n\n" + wrapped


def table_notes(result: LabResult) -> str:
    c = result.config
    compute = (
        f" One minibatch gradient alone takes {result.gradient_seconds * 1e3:.2f} ms here (model: "
        f"{result.parameters:,} parameters, {result.model_bytes / 1e6:.2f} MB)."
        if result.gradient_seconds
        else ""
    )
    repeats = (
        f"Each row: the median of {c.repeats} runs (to target: the run with the median time to target; "
        f"reached: runs that reached it), with the least and most of them in brackets where they differ. "
        if c.repeats > 1
        else ""
    )
    return (
        repeats + f"Target test accuracy {c.target_accuracy:g}. Time is wall time since the first worker "
        f"entered its training loop; *gradients* are minibatch gradients computed by all workers, *updates* are "
        f"optimizer updates applied (a sync round or an all-reduce step averages N gradients into one "
        f"update; async and ssp apply every gradient). steps/s = gradients/s. MB moved: parameter-server "
        f"runs measured at the shards (weights out + gradients in as sent, 16-bit when compressed; the "
        f"observer's pulls left out); "
        f"all-reduce runs computed as the ring algorithm's volume, 2(N-1) x model bytes per step."
        + compute
        + links_note(result)
        + "\n"
    )


def links_note(result: LabResult) -> str:
    """What each emulated network's links carried when measured before its runs ('' on loopback)."""
    if not result.links:
        return ""
    parts = [
        f"{name} ({link['described']}): "
        + ", ".join(f"{way} {gbit:.3f} Gbit/s" for way, gbit in link["measured_gbit_per_s"].items())
        for name, link in result.links.items()
    ]
    return (
        " Emulated links: every shard and worker ran on a host of its own (a network namespace), its link "
        "shaped to the rate by a token bucket each way; one TCP stream measured before the runs: "
        + "; ".join(parts)
        + ". *s per step*: a worker's step (workers / steps/s); *link-bound s per step*: "
        "what the bytes alone take at the measured link throughput, the pull and the push one after the "
        "other (a worker pulls the model and pushes its gradient over its link; each shard's link carries its "
        "share of that for every worker, shared by workers/shards of them)."
    )


def write_all(result: LabResult, out: Path) -> dict[str, str]:
    """Write lab.json, table.md and the plots into ``out``; returns {what: path}."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": str(out / "lab.json"), "table": str(out / "table.md")}
    Path(files["table"]).write_text(markdown_table(result) + "\n" + table_notes(result))
    for scenario in dict.fromkeys(r.scenario for r in result.runs):
        group_runs = [[r for r in g if len(r.points) > 1] for g in groups(result) if g[0].scenario == scenario]
        group_runs = [g for g in group_runs if g]
        first = next(r for r in result.runs if r.scenario == scenario)
        for metric in ("accuracy", "loss"):
            path = out / f"{metric}-{scenario}.png"
            plots.curves(
                group_runs,
                metric,
                path,
                f"{result.config.name}: {metric}, {answer.situation(first.network, first.delay)}",
                result.config.target_accuracy,
                result.config.policies,
            )
            files[f"{metric}-{scenario}"] = str(path)
    files["summary-plot"] = str(out / "summary.png")
    plots.summary(result, answer.rows(result), Path(files["summary-plot"]))
    files["summary"] = str(out / "summary.md")
    Path(files["summary"]).write_text(answer.recommend(result))
    result.files = files
    names = {k: Path(v).name for k, v in files.items()}  # beside lab.json
    Path(files["json"]).write_text(_json_text({**result.to_dict(), "files": names}))
    return files


def _json_text(data: dict) -> str:
    """Indented JSON, except that each run (with its evaluation points) takes one line."""
    runs = data.pop("runs")
    head = json.dumps(data, indent=1)[:-2]  # without the closing newline and brace
    body = ",\n  ".join(json.dumps(r) for r in runs)
    return f'{head},\n "runs": [\n  {body}\n ]\n}}\n'
