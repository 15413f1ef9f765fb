"""`moebench profile`: one sweep point under nsys or torch.profiler (`driver`), and the per-range summaries of
the result (`summary`). The NVTX ranges themselves live in moebench.measure.nvtx."""

from moebench.profile.driver import (  # noqa: F401
    NSYS_GLOBS,
    find_nsys,
    nsys_profile_command,
    nsys_stats_command,
    profile_inner,
    profile_point,
)
from moebench.profile.summary import (  # noqa: F401
    format_summary,
    summarize_nsys_csv,
    summarize_trace,
    write_summary_csv,
)
