"""What the rest of moebench uses of the kernels' runtime, as a public face: whether Triton runs in its interpreter,
the device check and power-of-two rounding the launchers use, and the launch-configuration registry (`tuning`:
candidate tables, tuned tables, the choice rule; its tables_digest and config_name_problem by name too). The very objects of kernels._details (the module itself for
`tuning`, so setting its TABLES_DIR is seen by the launchers), re-exported: `_details` is imported only inside
moebench.kernels (tests/test_import_graph.py)."""

from moebench.kernels._details import tuning
from moebench.kernels._details.jit import check_triton_device, interpreting, next_pow2
from moebench.kernels._details.tuning import config_name_problem, tables_digest

__all__ = ["interpreting", "check_triton_device", "next_pow2", "tuning", "tables_digest", "config_name_problem"]
