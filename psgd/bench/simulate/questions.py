"""The questions users ask before they rent a cluster, answered by the simulation (``psgd bench simulate
--questions DIR``): steps/s and scaling efficiency of sync jobs with 1-64 shards beside ring all-reduce, for 16 to
1,024 workers on 10, 25 and 100 Gbit/s links; the shards that reach 90% of all-reduce and that beat it, beside
BytePS's bound; sync against async with one straggler in 64; as tables (``questions.md``), every figure
(``questions.json``) and a plot (``efficiency.png``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from psgd.bench.simulate.job import Costs
from psgd.bench.simulate.predict import MOST_SHARDS, Model, efficiency, link_rate, shards_for, steps_per_s

WORKERS = (16, 64, 256, 1024)
SHARDS = (1, 4, 16, 64)
NETWORKS = ("10gbit", "25gbit", "100gbit")
#: one worker in 64 computes its gradients this many times slower (the convergence lab's straggler)
STRAGGLER = 4.0
STRAGGLER_SHARDS = 16


def bytepss_bound(workers: int) -> int:
    """The fewest servers with which a non-colocated parameter server's bandwidth-bound step, max(M/B, nM/(kB)),
    is shorter than ring all-reduce's, 2(n-1)M/(nB) (BytePS, OSDI 2020): k > n^2 / (2(n-1))."""
    return math.floor(workers * workers / (2 * (workers - 1))) + 1


def answer(costs: Costs, models: list[Model], say) -> dict:
    """Every figure of the questions, model by model and network by network."""
    rows, stragglers, published = [], [], []
    for model in models:
        for network in NETWORKS:
            rate = link_rate(network)
            for n in WORKERS:
                ring = steps_per_s(costs, model, n, 1, rate, "allreduce")
                known = {k: steps_per_s(costs, model, n, k, rate) for k in SHARDS}
                row = {
                    "model": model.name,
                    "network": network,
                    "workers": n,
                    "allreduce": ring,
                    "sync": {str(k): known[k] for k in SHARDS},
                    "shards_for_90": shards_for(costs, model, n, rate, 0.9 * ring, known),
                    "shards_to_beat": shards_for(costs, model, n, rate, ring, known),
                    "bytepss_bound": bytepss_bound(n),
                }
                rows.append(row)
                say(
                    f"  {model.name}, {network}, {n} workers: all-reduce {efficiency(ring, n, model):.0%}, sync "
                    + ", ".join(f"{k} shards {efficiency(known[k], n, model):.0%}" for k in SHARDS)
                )
        rate = link_rate("25gbit")  # the stragglers' network, and Horovod's published runs'
        for n in WORKERS[1:]:
            slow = {r: STRAGGLER for r in range(0, n, 64)}
            sync, free = (
                steps_per_s(costs, model, n, STRAGGLER_SHARDS, rate, policy, slow) for policy in ("sync", "async")
            )
            stragglers.append({"model": model.name, "workers": n, "sync": sync, "async": free})
        # Horovod's published runs: 512 GPUs over 25 Gbit/s; BytePS's: 256 GPUs over 100 Gbit/s
        horovod = efficiency(steps_per_s(costs, model, 512, 1, rate, "allreduce"), 512, model)
        bytepss = next(
            r for r in rows if r["model"] == model.name and r["network"] == "100gbit" and r["workers"] == 256
        )
        published.append(
            {
                "model": model.name,
                "allreduce_512_25gbit": horovod,
                "best_sync_over_allreduce_256_100gbit": max(bytepss["sync"].values()) / bytepss["allreduce"],
            }
        )
    return {
        "models": [m.__dict__ for m in models],
        "rows": rows,
        "stragglers": stragglers,
        "published": published,
        "workers": list(WORKERS),
        "shards": list(SHARDS),
        "networks": list(NETWORKS),
    }


def _shards(k: int | None) -> str:
    return f"> {MOST_SHARDS}" if k is None else str(k)


def markdown(result: dict) -> str:
    """The tables: efficiency by workers and shards; the shards that reach all-reduce; stragglers."""
    models = {m["name"]: Model(**m) for m in result["models"]}
    out = []
    for name, model in models.items():
        out += [
            f"### {name} ({model.nbytes / 1e6:,.1f} MB, a gradient {model.compute * 1e3:,.1f} ms)",
            "",
            f"Scaling efficiency (steps/s against the workers' gradients alone); {model.source}.",
            "",
            "| network | workers | "
            + " | ".join(f"sync, {k} shards" for k in result["shards"])
            + " | ring all-reduce | shards for 90% of all-reduce | shards to beat it | BytePS's bound |",
            "|---|---|" + "---|" * (len(result["shards"]) + 4),
        ]
        for row in (r for r in result["rows"] if r["model"] == name):
            n = row["workers"]
            cells = [f"{efficiency(row['sync'][str(k)], n, model):.0%}" for k in result["shards"]]
            out.append(
                f"| {row['network']} | {n:,} | "
                + " | ".join(cells)
                + f" | {efficiency(row['allreduce'], n, model):.0%} | {_shards(row['shards_for_90'])} | "
                f"{_shards(row['shards_to_beat'])} | {row['bytepss_bound']} |"
            )
        out.append("")
    out += [
        f"### One straggler in 64 ({STRAGGLER:g}x slower gradients), 25 Gbit/s, {STRAGGLER_SHARDS} shards",
        "",
        "| model | workers | sync steps/s | async steps/s | async / sync |",
        "|---|---|---|---|---|",
    ]
    for row in result["stragglers"]:
        out.append(
            f"| {row['model']} | {row['workers']:,} | {row['sync']:,.1f} | {row['async']:,.1f} | "
            f"{row['async'] / row['sync']:.2f} |"
        )
    out += [
        "",
        "### Beside the published figures",
        "",
        "| model | ring all-reduce, 512 workers, 25 Gbit/s: efficiency | psgd sync's best (1-64 shards) over "
        "all-reduce, 256 workers, 100 Gbit/s |",
        "|---|---|---|",
    ]
    for row in result["published"]:
        out.append(
            f"| {row['model']} | {row['allreduce_512_25gbit']:.0%} | "
            f"{row['best_sync_over_allreduce_256_100gbit']:.2f}x |"
        )
    return "\n".join(out) + "\n"


def plot(result: dict, path: Path) -> None:
    """Scaling efficiency against workers at 25 Gbit/s, one panel a model: sync with each shard count, all-reduce."""
    from psgd.bench.plots import DPI, OKABE_ITO, _pyplot

    plt = _pyplot()
    models = [Model(**m) for m in result["models"]]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), sharey=True, squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in result["rows"] if r["model"] == model.name and r["network"] == "25gbit"]
        n = [r["workers"] for r in rows]
        for colour, k in zip(OKABE_ITO, result["shards"]):
            ax.plot(
                n,
                [efficiency(r["sync"][str(k)], r["workers"], model) for r in rows],
                "o-",
                color=colour,
                label=f"sync, {k} shard{'s' if k > 1 else ''}",
            )
        ax.plot(
            n,
            [efficiency(r["allreduce"], r["workers"], model) for r in rows],
            "s--",
            color="#000000",
            label="ring all-reduce",
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [f"{w:,}" for w in n])
        ax.set_title(f"{model.name}, 25 Gbit/s")
        ax.set_xlabel("workers")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("scaling efficiency")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def write(result: dict, out: Path) -> dict[str, str]:
    """questions.md, questions.json and efficiency.png in ``out``; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"table": out / "questions.md", "json": out / "questions.json", "plot": out / "efficiency.png"}
    files["table"].write_text(markdown(result))
    files["json"].write_text(json.dumps(result, indent=1))
    plot(result, files["plot"])
    return {k: str(v) for k, v in files.items()}
