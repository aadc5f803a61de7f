"""The Echo planner: whole-graph recompute planning under a memory budget.

Where this sits in the flow: a captured training step (an AOTAutograd joint
graph or a :class:`membudget.trace.Trace`) becomes a planning graph
(:mod:`.graph`); :mod:`.analysis` gives memory over time for any recompute
set; :mod:`.selection` picks the set that meets a budget at the least modelled
overhead; the result is used as torch.compile's partitioner
(:mod:`.partitioner`), as a static plan for the runtime and as a report
(:mod:`.plan`). See docs/planner.md.
"""
from .analysis import MemoryModel, Profile
from .graph import PlanGraph, from_joint_graph, from_trace
from .partitioner import compile_backend
from .plan import Plan, plan
from .selection import Selection, select

__all__ = ["plan", "Plan", "compile_backend", "PlanGraph", "MemoryModel", "Profile", "Selection", "select",
           "from_joint_graph", "from_trace"]
