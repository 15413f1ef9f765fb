"""Reading runs back: the table printed while a sweep runs (table), ratios to the best peer (peers), a sweep's
declared headline numbers (headline), `moebench compare` (compare) and the self-contained report page (page).

Modules here read runs through moebench.records and may import moebench.params and moebench.plots, and a family's
typed record (moebench.bench.serving_trace.record); they never import moebench.run (tests/test_import_graph.py), and
the library packages never import them.
"""
