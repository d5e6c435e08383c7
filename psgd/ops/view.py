"""A view of a running cluster, from one poll of every shard (:func:`collect`): its rows of shards and workers,
rates against the poll before, the problems it shows, as JSON and as text (what ``psgd status`` prints)."""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Sequence
from typing import Any

from psgd.ops.reach import Connect, ShardProbe, probe_all


# -- the cluster view ----------------------------------------------------------------------------
def staleness_quantile(histogram: Sequence[int], q: float) -> str:
    """The ``q`` quantile of a staleness histogram (0..14, the last bucket 15+), as text; '-' when empty."""
    total = sum(histogram)
    if not total:
        return "-"
    need, acc = q * total, 0
    for i, n in enumerate(histogram):
        acc += n
        if acc >= need:
            return f"{i}+" if i == len(histogram) - 1 else str(i)
    return f"{len(histogram) - 1}+"


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@dataclasses.dataclass
class ClusterView:
    """One poll of every address, with rates against the previous poll (if any)."""

    probes: list[ShardProbe]
    when: float = dataclasses.field(default_factory=time.time)
    previous: ClusterView | None = None

    def _earlier(self, p: ShardProbe) -> ShardProbe | None:
        if self.previous is None:
            return None
        for q in self.previous.probes:
            if (
                q.address == p.address
                and q.status
                and p.status
                and q.status["incarnation"] == p.status["incarnation"]
                and p.taken > q.taken
            ):
                return q
        return None

    def shard_rows(self) -> list[dict]:
        rows = []
        for p in self.probes:
            row: dict[str, Any] = {"address": p.address, "health": p.health, "error": p.error}
            if p.status:
                s = p.status
                c = s["counters"]
                row.update(
                    {
                        k: s[k]
                        for k in (
                            "shard",
                            "num_shards",
                            "policy",
                            "version",
                            "plan_hash",
                            "bytes_held",
                            "incarnation",
                            "staleness_histogram",
                            "counters",
                            "role",
                            "replica_lag",
                            "follower",
                        )
                    }
                )
                written = c.get("checkpoint") or {}
                if written.get("written_at"):
                    row["checkpoint_version"] = written.get("version")
                    row["checkpoint_age_seconds"] = max(0.0, self.when - written["written_at"])
                row["staleness_p50"] = staleness_quantile(s["staleness_histogram"], 0.5)
                row["staleness_p99"] = staleness_quantile(s["staleness_histogram"], 0.99)
                q = self._earlier(p)
                if q:
                    dt = p.taken - q.taken
                    row["pushes_per_second"] = (c.get("pushes", 0) - q.status["counters"].get("pushes", 0)) / dt
                    row["versions_per_second"] = (s["version"] - q.status["version"]) / dt
            rows.append(row)
        return rows

    def worker_rows(self) -> list[dict]:
        merged: dict[int, dict] = {}
        for p in self.probes:
            if not p.status or p.status["role"] in ("replica", "starting"):  # a replica's workers are its primary's
                continue
            for w in p.status["workers"]:
                m = merged.setdefault(
                    w["worker_id"],
                    {
                        "worker_id": w["worker_id"],
                        "states": {},
                        "clocks": {},
                        "lease_left_seconds": None,
                        "hostname": "",
                        "pid": 0,
                    },
                )
                m["states"][p.status["shard"]] = w["state"]
                m["clocks"][p.status["shard"]] = w["clock"]
                if w["state"] == "live":
                    left = w["lease_left_seconds"]
                    m["lease_left_seconds"] = (
                        left if m["lease_left_seconds"] is None else min(left, m["lease_left_seconds"])
                    )
                if w["hostname"] or w["pid"]:
                    m["hostname"], m["pid"] = w["hostname"], w["pid"]
        before = {r["worker_id"]: r for r in self.previous.worker_rows()} if self.previous else {}
        dt = (self.when - self.previous.when) if self.previous else 0.0
        rows = []
        for wid in sorted(merged):
            m = merged[wid]
            states = set(m["states"].values())
            m["state"] = (
                states.pop() if len(states) == 1 else "/".join(f"{st}@{k}" for k, st in sorted(m["states"].items()))
            )
            m["clock"] = max(m["clocks"].values())
            m["min_clock"] = min(m["clocks"].values())
            if wid in before and dt > 0:
                m["steps_per_second"] = (m["clock"] - before[wid]["clock"]) / dt
            rows.append(m)
        return rows

    def problems(self) -> list[str]:
        out = [f"shard at {p.address}: {p.error}" for p in self.probes if p.error]
        answered = [p.status for p in self.probes if p.status]
        if not answered:
            return out
        for key, what in (("plan_hash", "partition plans"), ("policy", "policies"), ("num_shards", "shard counts")):
            values = {s[key] for s in answered}
            if len(values) > 1:
                out.append(
                    f"the shards disagree on their {what} ({', '.join(map(str, sorted(values)))}): they were "
                    "not all started from the same job file"
                )
        seen: dict[int, list[str]] = {}
        for p in self.probes:
            # a shard kept twice answers at two addresses, one of them leading
            if p.status and p.status["role"] not in ("replica", "starting"):
                seen.setdefault(p.status["shard"], []).append(p.address)
        for k, where in sorted(seen.items()):
            if len(where) > 1:
                out.append(f"shard {k} answers at more than one address: {', '.join(where)}")
        total = max(s["num_shards"] for s in answered)
        missing = [k for k in range(total) if k not in seen]
        if len(missing) > len(self.probes) - len(answered):  # more than the addresses that failed (said above)
            out.append(f"shard(s) {', '.join(map(str, missing))} of {total} not among the addresses given")
        for w in self.worker_rows():
            if "expired" in w["state"]:
                out.append(
                    f"worker {w['worker_id']} was dropped (lease or join deadline missed)"
                    + (f"; last seen on {w['hostname']} pid {w['pid']}" if w["hostname"] else "")
                )
        if self.previous:
            for p in self.probes:
                for q in self.previous.probes:
                    if (
                        q.address == p.address
                        and p.status
                        and q.status
                        and p.status["incarnation"] != q.status["incarnation"]
                    ):
                        out.append(
                            f"shard at {p.address} restarted since the last poll "
                            f"(incarnation {q.status['incarnation']} -> {p.status['incarnation']})"
                        )
        return out

    def healthy(self) -> bool:
        return all(p.ok for p in self.probes)

    def workers_range(self) -> list[int] | None:
        """The job's fewest and most workers as a shard says them (a job with a range: "MIN:MAX"), or None."""
        for p in self.probes:
            said = (p.status or {}).get("counters", {}).get("workers_range")
            if said:
                return list(said)
        return None

    def to_json(self) -> dict:
        return {
            "time": round(self.when, 3),
            "shards": self.shard_rows(),
            "workers": self.worker_rows(),
            "workers_range": self.workers_range(),
            "problems": self.problems(),
            "healthy": self.healthy(),
        }

    def render(self) -> str:
        shards, workers = self.shard_rows(), self.worker_rows()
        answered = [r for r in shards if "version" in r]
        policies = sorted({r["policy"] for r in answered})
        states: dict[str, int] = {}
        for w in workers:
            states[w["state"]] = states.get(w["state"], 0) + 1
        head = (
            f"psgd status at {time.strftime('%H:%M:%S', time.localtime(self.when))}: "
            f"{len(answered)} of {len(shards)} shard(s) answering"
            + (f", policy {'/'.join(policies)}" if policies else "")
        )
        span = self.workers_range()
        if span and span[0] < span[1]:  # a job with a range: how many train now, of how many it may
            workers = [w for w in workers if w["state"] != "free"]
            states.pop("free", None)
            head += f"; {states.get('live', 0)} worker(s) training, range {span[0]}:{span[1]}"
        if workers:
            said = f"{len(workers)} worker(s): " + ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
            fits = len(head) + 2 + len(said) <= shutil.get_terminal_size((80, 24)).columns
            head += ("; " if fits else "\n") + said
        rate = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        rows = []
        paired = any(r.get("role") for r in shards)
        for r in shards:
            if "version" not in r:
                rows.append(["?", r["address"], *(["-"] if paired else []), r["health"], *["-"] * 10])
                continue
            c = r["counters"]
            dropped = sum(c.get(k, 0) for k in ("late", "duplicates", "rejected"))
            saved = (
                "-"
                if "checkpoint_age_seconds" not in r
                else f"v{r['checkpoint_version']}, {r['checkpoint_age_seconds']:.0f}s ago"
            )
            if c.get("rollbacks"):  # went back to a cut: the rounds since were computed again
                saved += f"; back {c['rollbacks']}x, {c.get('rounds_undone', 0)} rounds"
            tables = (c.get("tables") or {}).values()
            held = r["bytes_held"] + sum(t.get("bytes", 0) for t in tables)
            table_rows = f"{sum(t.get('rows', 0) for t in tables):,}" if tables else "-"
            role = (
                []
                if not paired
                else [
                    _role(
                        r["role"],
                        r["replica_lag"],
                        c.get("failovers", 0),
                        c.get("unreplicated", 0),
                        r.get("follower", ""),
                    )
                ]
            )
            rows.append(
                [
                    f"{r['shard']}/{r['num_shards']}",
                    r["address"],
                    *role,
                    r["health"],
                    str(r["version"]),
                    human_bytes(held),
                    table_rows,
                    str(c.get("pushes", 0)),
                    str(c.get("pulls", 0)),
                    rate(r.get("pushes_per_second")),
                    str(dropped),
                    f"{r['staleness_p50']}/{r['staleness_p99']}",
                    saved,
                    r["incarnation"],
                ]
            )
        lines = [
            head,
            "",
            table(
                [
                    "SHARD",
                    "ADDRESS",
                    *(["ROLE"] if paired else []),
                    "HEALTH",
                    "VERSION",
                    "HELD",
                    "ROWS",
                    "PUSHES",
                    "PULLS",
                    "PUSHES/S",
                    "LATE/DUP/REJ",
                    "STALENESS p50/p99",
                    "CHECKPOINT",
                    "INCARNATION",
                ],
                rows,
            ),
        ]
        if workers:
            wrows = []
            for w in workers:
                clock = str(w["clock"]) if w["clock"] == w["min_clock"] else f"{w['min_clock']}..{w['clock']}"
                lease = "-" if w["lease_left_seconds"] is None else f"{max(0.0, w['lease_left_seconds']):.1f}s"
                wrows.append(
                    [
                        str(w["worker_id"]),
                        w["state"],
                        clock,
                        rate(w.get("steps_per_second")),
                        lease,
                        w["hostname"] or "-",
                        str(w["pid"] or "-"),
                    ]
                )
            lines += ["", table(["WORKER", "STATE", "CLOCK", "STEPS/S", "LEASE LEFT", "HOST", "PID"], wrows)]
        problems = self.problems()
        if problems:
            lines += ["", "problems:"] + [f"  - {p}" for p in problems]
        return "\n".join(lines)


def _role(role: str, lag: int, failovers: int, unreplicated: int = 0, follower: str = "") -> str:
    """A shard process's part in its pair (replicas = 1): its role, how far its replica is behind and who it is,
    from where (a primary), whether it follows (a replica), how often it took over, and how many pushes its pair
    acknowledged without a copy (its replica gone or unable to apply one: lost, had the primary died then)."""
    by = f", followed by {follower}" if follower else ""
    said = {"primary": "alone" if lag < 0 else f"lag {lag}{by}", "replica": "following" if lag == 0 else "no primary"}
    took = f", took over {failovers}x" if failovers else ""
    single = f", {unreplicated} acknowledged without a copy" if unreplicated else ""
    return f"{role} ({said.get(role, '?')}{took}{single})" if role else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int | None = None) -> str:
    """Columns padded to their widest cell.  Where the whole is wider than ``width`` (the terminal's; 80 where there
    is none), the columns after the first go into blocks that fit, one under the other, each led by the first
    column again."""
    width = width or shutil.get_terminal_size((80, 24)).columns
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    blocks: list[list[int]] = [[]]
    used = widths[0]
    for i in range(1, len(headers)):
        if blocks[-1] and used + 2 + widths[i] > width:
            blocks.append([])
            used = widths[0]
        blocks[-1].append(i)
        used += 2 + widths[i]
    out = []
    for block in blocks:
        fmt = lambda cells: "  ".join(cells[i].ljust(widths[i]) for i in [0, *block]).rstrip()  # noqa: E731
        out.append("\n".join([fmt(headers), *(fmt(r) for r in rows)]))
    return "\n\n".join(out)


def collect(addresses: Sequence[str], connect: Connect, previous: ClusterView | None = None) -> ClusterView:
    return ClusterView(probe_all(addresses, connect), previous=previous)
