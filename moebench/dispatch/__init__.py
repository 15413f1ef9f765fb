"""Expert-parallel dispatch paths behind one interface (base.DispatchPath): agrs, a2a, a2a_fixed, DeepEP.

`make_path(kind, ...)` in bench.py builds one; bench.py also registers them as impls `dispatch.<kind>`.
"""

from moebench.dispatch.base import (CAPACITY_POLICIES, DispatchPath, Dispatched, DispatchStats, EPLayout,
                                    ReceivedRows, capacity_for, scaled_expert, scaled_expert_reference)

__all__ = ["CAPACITY_POLICIES", "DispatchPath", "Dispatched", "DispatchStats", "EPLayout", "ReceivedRows",
           "capacity_for", "scaled_expert", "scaled_expert_reference"]
