"""The report: medians over the repeats (:func:`tabulate`), ``table.md`` with its notes, ``scaling.json``
(one line per run) and ``scaling.png`` (steps/s and efficiency against width)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from psgd.bench.scaling.grid import (
    ALLCORES_LABEL,
    PEER_ENV,
    PEER_LABEL,
    PEER_TARGET,
    RATIO_LABEL,
    Settings,
    kind_name,
    row_label,
)
from psgd.bench.scaling.measure import SOURCES, efficiency, median


def tabulate(records: list[dict], settings: Settings, skipped: dict[str, str]) -> dict:
    """Medians over the repeats, per (row, column): aggregate and per-worker steps/s, efficiency, the peer
    ratio, the BLAS threads reported; a cell with no good run holds "failed" or "skipped"."""
    columns = settings.columns()
    table: dict[str, dict] = {
        "columns": columns,
        "rows": settings.rows,
        "steps_per_s": {},
        "per_worker_steps_per_s": {},
        "efficiency": {},
        "peer_ratio": {},
        "blas_threads": {},
        "failures": {},
    }
    for row in settings.rows:
        mine = [r for r in records if r["row"] == row]
        agg, per, eff, threads, failures = {}, {}, {}, {}, {}
        for col in columns:
            runs = [r for r in mine if r["column"] == col]
            good = [r for r in runs if not r.get("error")]
            kind = next((r.kind for r in settings.plan() if r.column == col), "")
            if kind in skipped:
                agg[col] = per[col] = "skipped"
            elif not good:
                agg[col] = per[col] = "failed" if runs else None
                if runs:
                    failures[col] = runs[0]["error"]
            else:
                agg[col] = median(r["steps_per_s"] for r in good)
                per[col] = median(r["per_worker_steps_per_s"] for r in good)
            counts = sorted({r["blas_threads"] for r in runs if r.get("blas_threads")})
            threads[col] = counts
        single = agg.get("1 process")
        single = single if isinstance(single, float) else None
        for col in columns:
            if col in ("1 process",) or not isinstance(agg[col], float):
                continue
            n = int(re.search(r"(\d+)w", col).group(1))
            eff[col] = efficiency(agg[col], n, single)
        shipped, peer = agg.get("sync 2w"), agg.get(PEER_LABEL)
        ratio = shipped / peer if isinstance(shipped, float) and isinstance(peer, float) and peer > 0 else None
        table["steps_per_s"][row] = agg
        table["per_worker_steps_per_s"][row] = per
        table["efficiency"][row] = eff
        table["peer_ratio"][row] = ratio
        table["blas_threads"][row] = threads
        if failures:
            table["failures"][row] = failures
    return table


def _rate(value) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" + (f" (< {PEER_TARGET:g})" if value < PEER_TARGET else "")


def markdown(result: dict) -> str:
    """table.md: the four tables and the notes that say where each figure came from."""
    t, s = result["table"], result["settings"]
    columns, rows = t["columns"], t["rows"]
    peer = PEER_LABEL in columns
    scaled = [c for c in columns if c != "1 process"]

    def grid(title: str, cols: list[str], cell, extra: tuple[str, callable] | None = None) -> list[str]:
        head = ["model", *cols] + ([extra[0]] if extra else [])
        lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in rows:
            cells = [cell(row, c) for c in cols] + ([extra[1](row)] if extra else [])
            lines.append("| " + " | ".join([row_label(row), *cells]) + " |")
        return lines + [""]

    reps = f"median of {s['repeats']} runs" if s["repeats"] > 1 else "one run each"
    lines = grid(
        f"Aggregate steps/s (minibatch gradients per second, all workers together; {reps})",
        columns,
        lambda row, c: _rate(t["steps_per_s"][row].get(c)),
        (RATIO_LABEL, lambda row: _ratio(t["peer_ratio"][row])) if peer else None,
    )
    lines += grid(
        "Steps/s per worker (aggregate / N)", scaled, lambda row, c: _rate(t["per_worker_steps_per_s"][row].get(c))
    )
    if "1 process" in columns:
        lines += grid(
            "Scaling efficiency: aggregate steps/s / (N x one process's steps/s)",
            scaled,
            lambda row, c: _eff(t, row, c),
        )
    reported = any(v for row in rows for v in t["blas_threads"][row].values())
    if reported:
        lines += grid(
            "BLAS/OpenMP threads per process, as the launcher's log said",
            columns,
            lambda row, c: "-".join(str(x) for x in t["blas_threads"][row].get(c) or []) or "",
        )
    return "\n".join(lines) + "\n" + notes(result, reported)


def _eff(t: dict, row: str, col: str) -> str:
    value = t["efficiency"][row].get(col)
    if value is None:
        cell = t["steps_per_s"][row].get(col)
        return cell if isinstance(cell, str) else "n/a" if cell is not None else ""
    return f"{value:.2f}"


def notes(result: dict, reported: bool) -> str:
    s, t = result["settings"], result["table"]
    kinds = {"1 process": "single", PEER_LABEL: "ps", ALLCORES_LABEL: "ps"}
    used = []
    for col in t["columns"]:
        kind = kinds.get(col) or ("allreduce" if col.startswith("all-reduce") else "ps")
        if kind not in used:
            used.append(kind)
    where = {"single": "1 process", "ps": "sync / async / peer / no budget", "allreduce": "all-reduce"}
    lines = [f"Sources: {'; '.join(f'*{where[k]}*: {SOURCES[k]}' for k in used)}.", ""]
    lines.append(
        f"Each run: `psgd train` or `psgd launch` (one shard for sync/async), SGD lr 0.1, batch 32 per "
        f"worker, {s['epochs']} epoch(s) of the bundled digits (~{45 * s['epochs']} minibatch "
        f"gradients in all, whatever N), started as a user would in this environment, unchanged. "
        f"The peer column alone runs with {', '.join(f'{k}={v}' for k, v in PEER_ENV.items())} in its "
        f"environment; {RATIO_LABEL} = sync 2w / peer, the goal >= {PEER_TARGET:g} at every width. "
        f"The no-budget column passes --threads <cores> to every process: each uses a thread per core, "
        f"as every psgd process did before the thread budget."
    )
    if result["thread_env"]:
        lines.append(
            f"Caution: this environment already sets "
            f"{', '.join(f'{k}={v}' for k, v in result['thread_env'].items())}, so the as-shipped "
            f"runs inherited it and are not what psgd does on its own."
        )
    if not reported:
        lines.append("No launcher printed a BLAS/OpenMP thread budget line.")
    for kind, why in result["skipped"].items():
        lines.append(f"{kind_name(kind)}: skipped: {why}.")
    for row, failures in t["failures"].items():
        for col, error in failures.items():
            lines.append(f"{row_label(row)} | {col}: failed: {error}")
    if result.get("network"):
        net = result["network"]
        lines.append(
            f"Every launch ran on emulated links of {net['described']}: each shard, worker and all-reduce "
            f"rank on a host of its own (a network namespace), its link shaped to the rate and measured "
            f"at {net['measured_gbit_per_s']} Gbit/s before the runs; one-process runs ran on this "
            f"machine."
        )
    load = result["load_average"]
    lines.append(
        f"Machine: {result['machine']}; load average (1/5/15 min) {load['before']} before, "
        f"{load['after']} after; {len(result['runs'])} runs in {result['seconds']:.0f}s."
    )
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out: Path) -> dict[str, str]:
    files = {"table": str(out / "table.md"), "json": str(out / "scaling.json"), "plot": str(out / "scaling.png")}
    Path(files["table"]).write_text(markdown(result))
    plot(result, Path(files["plot"]))
    Path(files["json"]).write_text(json_text({**result, "files": {k: Path(v).name for k, v in files.items()}}))
    return files


def json_text(data: dict) -> str:
    """Indented JSON, except that each run takes one line."""
    data = dict(data)
    runs = data.pop("runs")
    head = json.dumps(data, indent=1)[:-2]
    body = ",\n  ".join(json.dumps(r) for r in runs)
    return f'{head},\n "runs": [\n  {body}\n ]\n}}\n'


def plot(result: dict, path: Path) -> None:
    """steps/s against hidden width (log-log), one line per configuration; efficiency beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    t = result["table"]
    widths = [row for row in t["rows"] if row != "cnn"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.2))
    colors = plt.get_cmap("tab10")
    special = {
        PEER_LABEL: {"color": "black", "linestyle": "--"},  # the two references stand apart
        ALLCORES_LABEL: {"color": "black", "linestyle": ":", "marker": "x"},
    }
    plain = [c for c in t["columns"] if c not in special]
    for col in t["columns"]:
        style = {
            "marker": "o",
            "markersize": 4,
            "label": col,
            "linestyle": "-",
            "color": colors(plain.index(col) % 10) if col in plain else None,
            **special.get(col, {}),
        }
        xy = [(int(w), t["steps_per_s"][w].get(col)) for w in widths]
        xy = [(x, y) for x, y in xy if isinstance(y, float) and y > 0]
        if xy:
            left.plot(*zip(*xy), **style)
        xy = [(int(w), t["efficiency"][w].get(col)) for w in widths]
        xy = [(x, y) for x, y in xy if y is not None]
        if xy:
            right.plot(*zip(*xy), **style)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        if widths:
            ax.set_xticks([int(w) for w in widths], labels=widths)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("MLP hidden width (log scale)")
        ax.grid(True, which="both", alpha=0.3)
    left.set_yscale("log")
    left.set_ylabel("aggregate steps/s (log scale)")
    right.set_ylabel("scaling efficiency: aggregate / (N x one process)")
    right.axhline(1.0, color="grey", linewidth=1)
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, max(1, len(labels))), fontsize=9, frameon=False)
    cnn = " (the CNN is in the table)" if "cnn" in t["rows"] else ""
    fig.suptitle(
        f"psgd bench scaling: MLP on digits, {result['settings']['epochs']} epoch(s) per run{cnn}; {result['machine']}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
