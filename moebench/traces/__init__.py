"""Serving traces, without torch: the per-step token counts a server sees (one count per DP rank and step), from a
seeded distribution (`distributions`) or a user's CSV file (`csv_trace`, with the example files in `data/`), the
distinct steps of a trace (`distinct`), the named CUDA-graph capture lists an engine may be configured with
(`capture_lists`), a point's per-step figures in a file beside its record (`step_file`), and the sweep keys of the
trace of batch sizes (`knobs`: TraceKnobs; the serving engine's are moebench.bench.serving_trace.knobs).

Imports nothing of moebench but moebench.params (numpy and the standard library otherwise), so the sweep loader can
validate a trace file or a capture list name before anything is built, and nothing here pulls in torch or triton.
"""
