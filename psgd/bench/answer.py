"""The lab's answer in words: for each network and scenario, which policy reached the target first, by how
much, and at what final accuracy, derived from the lab's own table (medians over the repeats)."""

from __future__ import annotations

from typing import NamedTuple

from psgd.bench import netns
from psgd.bench.lab import LOOPBACK
from psgd.bench.labresult import LabResult, groups, median_summary
from psgd.training.delay import parse_delay


def situation(network: str, delay: str) -> str:
    """A group of runs in words: ``1 Gbit/s links, worker 0 four times slower``."""
    words = parse_delay(delay or None).describe()
    if network and network != LOOPBACK:
        return f"{netns.describe_rate(netns.parse_rate(network))} links, {words}"
    return f"loopback, {words}"


class Row(NamedTuple):
    """One (network, scenario, contender) of the lab, as its answer reads it."""

    situation: str  # the network and scenario, in words
    policy: str  # the contender's spec, e.g. "sync"
    label: str  # the contender, in words
    seconds: float | None  # the median time to target; None: not reached (or failed)
    accuracy: float | None  # the median final accuracy
    error: str | None  # why every run failed, where they did
    spread: tuple[float, float] | None  # the least and most times to target over the repeats


def rows(result: LabResult) -> list[Row]:
    """A :class:`Row` for every (network, scenario, contender), in the order they ran."""
    out = []
    for runs in groups(result):
        first = runs[0]
        m = median_summary(runs)
        failed = all(r.error for r in runs)
        out.append(
            Row(
                situation(first.network, first.delay),
                first.policy,
                first.label,
                None if failed else m["time_to_target"],
                None if failed else m["final_accuracy"],
                first.error if failed else None,
                m["spread"].get("time_to_target"),
            )
        )
    return out


def recommend(result: LabResult) -> str:
    """A few lines per situation: the fastest policy to the target, how much faster than the next and than
    sync, and the final accuracies; then which policies never reached it."""
    target = result.config.target_accuracy
    lines = [
        f"# {result.config.name}: which policy to use",
        "",
        f"Time to test accuracy {target:g} (median of {result.config.repeats} run(s)), from this lab's table.",
        "",
    ]
    table = rows(result)
    for where in dict.fromkeys(r.situation for r in table):
        mine = [r for r in table if r.situation == where]
        reached = sorted((r for r in mine if r.seconds is not None), key=lambda r: r.seconds)
        lines.append(f"**{where}**: " + _verdict(reached, mine, target, result.config.eval_interval))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def as_long(seconds: float, best: float, interval: float) -> str:
    """``seconds`` against the ``best`` time in words, no finer than times measured ``interval`` s apart can tell: a
    tie within one interval; the difference where the interval is a tenth of the best time or more (a ratio would
    be noise); else the ratio, to the digit its error (about ``interval / best``) leaves standing."""
    if seconds - best <= interval:
        return f"as long, to within the {interval:g} s between evaluations"
    if interval / best >= 0.1:
        return f"{seconds - best:.2f} s later"
    return f"{seconds / best:.{2 if interval / best < 0.005 else 1}f}x as long"


def _over(row: Row) -> str:
    """`` (least-most s over the repeats)`` of a row's time to target, where they differ."""
    low, high = (f"{v:.2f}" for v in row.spread or (0, 0))
    return "" if low == high else f" ({low}-{high} s over the repeats)"


def _verdict(reached: list[Row], mine: list[Row], target: float, interval: float) -> str:
    if not reached:
        failed = [f"{r.label} ({r.error.splitlines()[0][:80]})" for r in mine if r.error]
        return f"no policy reached {target:g}." + (f" Failed: {'; '.join(failed)}." if failed else "")
    best = reached[0]
    text = f"{best.label} reached it first, in {best.seconds:.2f} s{_over(best)} (final accuracy {best.accuracy:.3f})"
    if len(reached) > 1:
        second = reached[1]
        text += (
            f"; {second.label} next, {as_long(second.seconds, best.seconds, interval)} "
            f"({second.seconds:.2f} s{_over(second)}, final {second.accuracy:.3f})"
        )
    sync = next((r for r in reached if r.policy == "sync"), None)
    if sync is not None and sync not in reached[:2]:
        text += f"; sync: {as_long(sync.seconds, best.seconds, interval)}"
    text += "."
    missing = [r for r in mine if r.seconds is None]
    if missing:
        parts = [
            f"{r.label} (failed: {r.error.splitlines()[0][:80]})"
            if r.error
            else f"{r.label} (final {r.accuracy:.3f})"
            if r.accuracy is not None
            else r.label
            for r in missing
        ]
        text += " Never reached it: " + ", ".join(parts) + "."
    return text
