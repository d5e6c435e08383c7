"""Benchmarks that are part of psgd's command line (``psgd bench``), usable as a library.

The convergence lab trains one job under every consistency policy, with and
without injected stragglers, and writes a JSON of every evaluation point, a
Markdown table and plots::

    from psgd.bench import preset, run_lab
    result = run_lab(preset("quick"), "lab-out")
"""

from psgd.bench.convergence import run_lab
from psgd.bench.lab import Contender, LabConfig, Scenario, parse_contender, parse_scenario, preset
from psgd.bench.labresult import LabResult, RunResult

__all__ = [
    "Contender",
    "LabConfig",
    "LabResult",
    "RunResult",
    "Scenario",
    "parse_contender",
    "parse_scenario",
    "preset",
    "run_lab",
]
