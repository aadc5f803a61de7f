"""membudget: run PyTorch training under a device-memory budget.

    import membudget
    membudget.install()          # budget etc. from MEMBUDGET_* variables
    ...                          # the training loop, unchanged
    membudget.memory_stats()     # flat dict of counters

or, with no change to the script: ``MEMBUDGET_BUDGET=2GiB membudget run train.py``.
Before buying a GPU: ``membudget.trace(step)`` records a step, ``membudget.simulate``
replays it under budgets on a modelled device, ``membudget.optimal`` is the floor.
See DESIGN.md for the architecture and docs/configuration.md for every variable.
"""
from ._runtime import install, is_installed, uninstall
from ._compiled_under_budget import compiled_plans
from .config import Config, ConfigError
from .stats import MemoryStats, memory_snapshot, memory_stats, reset_counters, reset_peak_stats, stats
from .planner import Plan, compile_backend, plan
from .trace import Trace, TraceOp, TraceTensor
from .simulate import SimRow, simulate
from .optimal import OptimalSolution, optimal

# Note [membudget.trace]: the function shadows the submodule of the same name
# as an attribute of the package (imported last, on purpose); the data model
# stays importable as `from membudget.trace import Trace`.
from .tracer import trace

__version__ = "0.1.0"

__all__ = [
    "install",
    "uninstall",
    "is_installed",
    "memory_stats",
    "memory_snapshot",
    "stats",
    "reset_peak_stats",
    "reset_counters",
    "MemoryStats",
    "Config",
    "ConfigError",
    "plan",
    "Plan",
    "compile_backend",
    "compiled_plans",
    "trace",
    "Trace",
    "TraceOp",
    "TraceTensor",
    "simulate",
    "SimRow",
    "optimal",
    "OptimalSolution",
    "__version__",
]
