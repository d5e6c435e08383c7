"""local(τ): workers take τ steps on their own copy, then push their progress; the shards hold the centre.

Local SGD (periodic model averaging: Zinkevich et al. 2010; Stich, "Local SGD converges fast and
communicates little", ICLR 2019; Lin et al., "Don't use large mini-batches, use local SGD", ICLR
2020), asynchronous: each push is applied on arrival, as under :class:`AsyncPolicy`.
"""

from __future__ import annotations

from typing import ClassVar

from psgd.policy.asynchronous import AsyncPolicy
from psgd.policy.base import PolicyError, PolicyOption, _is_int, _show


class LocalPolicy(AsyncPolicy):
    """Pushes are handled exactly as by :class:`AsyncPolicy` (gaps between clocks are the local steps).

    What a push carries is not a gradient.  A worker pulls the centre x̃ every ``local_steps`` steps,
    trains its own copy x with the job's optimizer (its state kept by the worker), and pushes
    x̃_pulled − x.  The shard moves the centre by that progress over N (``async_lr = "divided"``, the
    default): without staleness N pushes take it to the workers' average, as one round of synchronous
    local SGD does; with ``"full"`` each push moves it by the whole progress.  ``local_steps = 1``
    with SGD is async SGD.
    """

    name: ClassVar[str] = "local"
    summary: ClassVar[str] = (
        "local SGD: each worker takes local-steps steps on its own copy, then pushes its "
        "progress, applied on arrival to the centre the shards hold"
    )
    options: ClassVar[tuple[PolicyOption, ...]] = (
        PolicyOption(
            "local_steps",
            int,
            4,
            "steps a worker takes on its own copy between pull and push",
            required=False,
            cluster_key="local_steps",
            shorthand="local:T",
            label="local SGD \u03c4={}",
        ),
    )
    accumulates: ClassVar[bool] = False
    local: ClassVar[bool] = True

    def __init__(self, num_workers: int, local_steps: int = 4):
        super().__init__(num_workers)
        if not _is_int(local_steps) or local_steps < 1:
            raise PolicyError(f"policy 'local': local_steps must be an integer >= 1, got {_show(local_steps)}")
        self.local_steps = self.gap = int(local_steps)
