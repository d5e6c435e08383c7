"""The lab's figures (matplotlib, Agg backend): curves of every policy, and one summary of the whole lab.

- :func:`curves`: test accuracy (or training loss) against wall time,
  updates applied and gradients computed; each policy is its median run as
  a line, with the spread of its repeats (lowest to highest) as a band.
- :func:`summary`: time to the target accuracy of every policy, grouped by
  network and scenario, as bars (a policy that never reached it: an empty
  slot marked "not reached").

Every policy keeps one colour in every figure of every lab, from the
Okabe-Ito palette (distinguishable with the common colour-vision
deficiencies); compressed-gradient variants share their policy's colour,
dashed or hatched.  Figures are written at 150 dpi.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from psgd.bench.lab import contender_families, family
from psgd.bench.labresult import LabResult, RunResult

DPI = 150
#: Okabe & Ito's colour-blind-safe palette, in the order policies take it.
OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
#: Each family of contenders (:func:`psgd.bench.lab.contender_families`) takes the colour at its place there.
FAMILY_COLORS = dict(zip(contender_families(), OKABE_ITO))
_AXES = (("wall", "wall time (s)"), ("updates", "updates applied"), ("steps", "gradients computed"))


def require_matplotlib(who: str = "the convergence lab") -> None:
    """Fail at once, before any run, when the plots cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        from psgd.config import ConfigError
        from psgd.errors import install_extra

        raise ConfigError(f"{who}'s plots need matplotlib: in psgd's folder, {install_extra('bench')}") from None


def _pyplot():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def style(spec: str, order: Sequence[str] = ()) -> dict:
    """Colour and line style of a contender among ``order`` (the lab's contenders): compression on the wire
    keeps its contender's colour, dashed (``async+bf16``). The first of a family (``ssp:1`` before ``ssp:4``,
    ``async`` before ``async+dc``) takes the family's colour; the others take, in order, the colours no family
    of ``order`` holds."""

    def key(text: str) -> str:
        return "+".join(part for part in text.split("+") if part not in ("bf16", "fp16"))

    base = key(spec)
    keys = sorted(dict.fromkeys(key(s) for s in [*order, spec]), key=lambda k: "+" in k)
    first: dict[str, str] = {}
    for k in keys:
        first.setdefault(family(k), k)
    if first[family(base)] == base and family(base) in FAMILY_COLORS:
        color = FAMILY_COLORS[family(base)]
    else:
        taken = {FAMILY_COLORS.get(family(k)) for k in first.values()}
        free = [c for c in OKABE_ITO if c not in taken] or list(OKABE_ITO)
        others = [k for k in keys if first[family(k)] != k or family(k) not in FAMILY_COLORS]
        color = free[others.index(base) % len(free)]
    return {"color": color, "linestyle": "--" if base != spec else "-"}


def _band(runs: Sequence[RunResult], x: str, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A common x grid and, on it, the median, lowest and highest of ``key`` over the runs (each run's points
    joined linearly), where every run has points."""
    series = []
    for run in runs:
        xy = sorted((p[x], p[key]) for p in run.points if p[key] is not None and (x == "wall" or p[x] > 0))
        if len(xy) >= 2:
            series.append((np.array([a for a, _ in xy], float), np.array([b for _, b in xy], float)))
    if not series:
        return (np.array([]),) * 4
    lo, hi = max(s[0][0] for s in series), min(s[0][-1] for s in series)
    if len(series) == 1 or hi <= lo:  # one run, or runs that do not overlap: the median run alone
        xs, ys = series[len(series) // 2]
        return xs, ys, ys, ys
    grid = np.union1d(np.concatenate([s[0] for s in series]), [])
    grid = grid[(grid >= lo) & (grid <= hi)]
    values = np.array([np.interp(grid, xs, ys) for xs, ys in series])
    return grid, np.median(values, axis=0), values.min(axis=0), values.max(axis=0)


def curves(
    group_runs: Sequence[Sequence[RunResult]],
    metric: str,
    path: Path,
    title: str,
    target: float | None = None,
    order: Sequence[str] = (),
) -> None:
    """One figure: ``metric`` (accuracy or loss) against wall time, updates and gradients; per policy its
    median as a line and the spread of its repeats as a band."""
    plt = _pyplot()
    from matplotlib import ticker

    key, ylabel = (
        ("test_accuracy", "test accuracy")
        if metric == "accuracy"
        else ("loss", "training loss, minibatch mean (log scale)")
    )
    fig, axes = plt.subplots(1, len(_AXES), figsize=(15, 4.8), sharey=True)
    for ax, (x, xlabel) in zip(axes, _AXES):
        for runs in group_runs:
            grid, mid, low, high = _band(runs, x, key)
            if not len(grid):
                continue
            look = style(runs[0].policy, order)
            ax.plot(grid, mid, label=runs[0].label, linewidth=1.8, **look)
            if len(runs) > 1:
                ax.fill_between(grid, low, high, color=look["color"], alpha=0.18, linewidth=0)
        ax.set_xlabel(xlabel + ("" if x == "wall" else " (log scale)"))
        ax.grid(True, which="both", alpha=0.3)
        if x != "wall":
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        if metric == "accuracy" and target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1.2)
        if metric == "loss":
            ax.set_yscale("log")
    axes[0].set_ylabel(ylabel)
    if metric == "accuracy":
        axes[0].set_ylim(0.0, 1.0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=max(1, len(labels)), fontsize=10, frameon=False)
    repeats = max((len(r) for r in group_runs), default=1)
    spread = f"; bands: the spread of {repeats} repeats, lines their median" if repeats > 1 else ""
    fig.suptitle(
        title
        + (
            f" (dotted: target {target:g}{spread})"
            if metric == "accuracy" and target
            else f" ({spread[2:]})"
            if spread
            else ""
        )
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def summary(result: LabResult, rows: Sequence[Any], path: Path) -> None:
    """Time to target per policy (bars: the median run; whiskers: the least and most of the repeats) for each
    network and scenario (groups); ``rows`` are :class:`psgd.bench.answer.Row`."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    groups = list(dict.fromkeys(r.situation for r in rows))
    specs = list(dict.fromkeys(r.policy for r in rows))
    labels = {r.policy: r.label for r in rows}
    seconds = {(r.situation, r.policy): r.seconds for r in rows}
    spread = {(r.situation, r.policy): r.spread for r in rows if r.seconds is not None and r.spread}
    width = 0.8 / max(1, len(specs))
    handles = []  # drawn by hand: a policy that never reached the target has no bar to take its colour from
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(groups) * max(1, len(specs)) / 3), 4.8))
    top = max([s for s in seconds.values() if s is not None] + [hi for _, hi in spread.values()], default=1.0)
    for i, spec in enumerate(specs):
        look = style(spec, result.config.policies)
        xs = [g + (i - (len(specs) - 1) / 2) * width for g in range(len(groups))]
        heights = [seconds.get((group, spec)) for group in groups]
        hatch = "//" if look["linestyle"] == "--" else None
        ax.bar(
            [x for x, h in zip(xs, heights) if h is not None],
            [h for h in heights if h is not None],
            width,
            color=look["color"],
            hatch=hatch,
            edgecolor="white",
        )
        whiskers = [(x, h, spread[group, spec]) for group, x, h in zip(groups, xs, heights) if (group, spec) in spread]
        if whiskers:  # the least and most times of the repeats, around the median's bar
            ax.errorbar(
                [x for x, _, _ in whiskers],
                [h for _, h, _ in whiskers],
                yerr=[
                    [max(0.0, h - lo) for _, h, (lo, _) in whiskers],
                    [max(0.0, hi - h) for _, h, (_, hi) in whiskers],
                ],
                fmt="none",
                ecolor="black",
                elinewidth=1.0,
                capsize=3,
            )
        handles.append(Patch(facecolor=look["color"], hatch=hatch, edgecolor="white", label=labels[spec]))
        for group, x, h in zip(groups, xs, heights):
            if h is None and (group, spec) in seconds:
                ax.text(x, top * 0.02, "not reached", rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=9)
    ax.set_ylabel(
        f"seconds to test accuracy {result.config.target_accuracy:g}"
        + (" (median run; whiskers: least to most)" if spread else " (median run)")
    )
    ax.grid(True, axis="y", alpha=0.3)
    fig.legend(handles=handles, loc="lower center", ncol=min(5, len(specs)), fontsize=9, frameon=False)
    ax.set_title(f"{result.config.name}: time to target accuracy, by policy (lower is better)")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
