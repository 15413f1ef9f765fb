"""Expert-parallel dispatch paths behind one interface (base.DispatchPath): agrs, a2a, a2a_fixed, DeepEP.

One module per path (a2a, a2a_fixed, agrs, deepep, deepep_v2), each registering its classes with
`base.dispatch_path`; the shared helpers are base (interface, hooks, registry), comm (collectives, side stream,
growing buffers), permute (send plan, wire rows), pack (fixed-capacity pack/combine kernels, capacity policies) and
reference (the benchmark's expert and the single-process references). moebench.bench.dispatch registers one timed
impl `dispatch.<name>` per path `base.package_paths()` finds.
"""

from moebench.dispatch.base import (
                                    Dispatched,
                                    DispatchPath,
                                    DispatchStats,
                                    EPLayout,
                                    ReceivedRows,
                                    dispatch_path,
                                    package_paths,
                                    path_class,
)

__all__ = ["DispatchPath", "Dispatched", "DispatchStats", "EPLayout", "ReceivedRows", "dispatch_path",
           "package_paths", "path_class"]
