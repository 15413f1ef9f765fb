"""`moebench profile`: one sweep point under nsys or torch.profiler (`driver`), the per-range summaries of the
result (`summary`: torch.profiler traces, the stage breakdown, CSV and table; `nsys_reports`: nsys stats CSVs).
The NVTX ranges and the profiled iterations themselves live in moebench.measure.nvtx."""

from moebench.profile.driver import (  # noqa: F401
    LIBS_ENV,
    NSYS_GLOBS,
    find_nsys,
    nsys_lib_dirs,
    nsys_profile_command,
    nsys_stats_command,
    profile_inner,
    profile_point,
    summary_header,
)
from moebench.profile.nsys_reports import join_traces, summarize_nsys_csv, summarize_nsys_traces  # noqa: F401
from moebench.profile.summary import (  # noqa: F401
    CSV_COLUMNS,
    add_breakdown,
    format_summary,
    summarize_trace,
    write_summary_csv,
)
