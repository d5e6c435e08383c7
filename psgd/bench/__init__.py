"""Benchmarks that are part of psgd's command line (``psgd bench``), usable as a library.

The convergence lab trains one job under every consistency policy, with and
without injected stragglers, and writes a JSON of every evaluation point, a
Markdown table and plots::

    from psgd.bench import preset, run_lab
    result = run_lab(preset("quick"), "lab-out")
"""

from psgd.bench.config import LabConfig, Policy, Scenario, parse_policy, parse_scenario, preset
from psgd.bench.convergence import LabResult, RunResult, run_lab

__all__ = ["LabConfig", "LabResult", "Policy", "RunResult", "Scenario", "parse_policy", "parse_scenario",
           "preset", "run_lab"]
