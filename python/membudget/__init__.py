"""membudget: run PyTorch training under a device-memory budget.

    import membudget
    membudget.install()          # budget etc. from MEMBUDGET_* variables
    ...                          # the training loop, unchanged
    membudget.memory_stats()     # flat dict of counters

or, with no change to the script: ``MEMBUDGET_BUDGET=2GiB membudget run train.py``.
See DESIGN.md for the architecture and docs/configuration.md for every variable.
"""
from ._runtime import install, is_installed, uninstall
from .config import Config, ConfigError
from .stats import MemoryStats, memory_stats, reset_counters, reset_peak_stats, stats
from .planner import Plan, compile_backend, plan

__version__ = "0.1.0"

__all__ = [
    "install",
    "uninstall",
    "is_installed",
    "memory_stats",
    "stats",
    "reset_peak_stats",
    "reset_counters",
    "MemoryStats",
    "Config",
    "ConfigError",
    "plan",
    "Plan",
    "compile_backend",
    "__version__",
]
