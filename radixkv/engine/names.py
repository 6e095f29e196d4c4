"""The engine's choice lists (torch-free): scheduling policies, cascade modes, prefill budgets.

:class:`~radixkv.engine.config.EngineConfig` checks its fields against these and its command-line
flags list them; the modules that act on a choice read the same names, so each list is stated
here once and ``radixkv serve --help`` imports no torch to show them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixkv.name_table import NameTable

if TYPE_CHECKING:
    from radixkv.engine.schedule_policy import AdmissionOrder

# EngineConfig.schedule_policy: admission order of waiting sequences (engine/schedule_policy.py;
# a new policy is one function there plus its row here)
SCHEDULE_POLICIES: NameTable[AdmissionOrder] = NameTable(
    "schedule policy",
    {
        "lpm": "radixkv.engine.schedule_policy:lpm",
        "fcfs": "radixkv.engine.schedule_policy:fcfs",
        "priority": "radixkv.engine.schedule_policy:priority",
    },
)
# EngineConfig.cascade: shared-prefix decode attention when it pays, always, never
# (engine/cascade_planner.py)
CASCADE_MODES = ("auto", "on", "off")
# EngineConfig.overlap: schedule step N+1 while step N's forward runs (engine/overlap.py)
OVERLAP_MODES = ("auto", "on", "off")
# EngineConfig.prefill_budget: what a step's prefill budget counts (engine/prefill_cost.py)
PREFILL_BUDGETS = ("tokens", "attention")
