#!/usr/bin/env bash
# The GPU acceptance runs, in groups that each fit one device call (10 minutes), through scripts/gpu_batch.sh (logs
# and run directories come back under $OUT). Each step is bounded by `timeout` so a slow one leaves time to the rest.
#   bash scripts/gpu_acceptance.sh suite      the GPU tests (-n 4), then the capture-search scenario
#   bash scripts/gpu_acceptance.sh ep         ep_step_scaling (EP 8-64; goal 120 s), sp_padding_prefill (goal 60 s),
#                                             padding_tax
#   bash scripts/gpu_acceptance.sh trace      a 1,000,000-step two-column trace at EP 64 at its GPU size (goal 5 min)
#   bash scripts/gpu_acceptance.sh compare BEFORE_TREE
#                                             layer and kernels_experts on this tree and on BEFORE_TREE (a `git
#                                             archive` of the commit to compare against), then `moebench compare`
#   bash scripts/gpu_acceptance.sh profile    where a shape's and a rank workload's timing seconds go (cProfile)
# Results land in results/gpu/ on the device (copied back in results.tgz); commit the slimmed runs
# (scripts/slim_run.py) under results/<card>/ and link them from the docs.
set -u
here=$(cd "$(dirname "$0")" && pwd)
batch() { bash "$here/gpu_batch.sh" "$@"; }
out=results/gpu
case "${1:-}" in
  suite)
    batch "gpu_tests::timeout 300 python3 -m pytest -q -n 4 --dist load -m 'gpu or gpu2' tests" \
          "capture_search::timeout 270 python3 -m moebench run sweeps/scenarios/capture_search.yaml --out $out" ;;
  ep)
    batch "ep_step_scaling::timeout 300 python3 -m moebench run sweeps/ep_step_scaling.yaml --out $out" \
          "sp_padding_prefill::timeout 150 python3 -m moebench run sweeps/scenarios/sp_padding_prefill.yaml --out $out" \
          "padding_tax::timeout 130 python3 -m moebench run sweeps/scenarios/padding_tax.yaml --out $out" ;;
  trace)
    batch "trace_1m::timeout 570 python3 scripts/bench_ep_step_trace.py --size '' --ep-size 64 --keep /tmp/trace1m; \
mkdir -p $out && cp -r /tmp/trace1m/runs/. $out/" ;;
  compare)
    before=${2:?the tree to compare against (a git archive of that commit)}
    # `python3 -m` puts the working directory first on sys.path: in BEFORE_TREE the old moebench is imported
    batch "after::timeout 200 python3 -m moebench run sweeps/layer.yaml --out $out/after && \
timeout 80 python3 -m moebench run sweeps/kernels_experts.yaml --out $out/after" \
          "before::cd $before && timeout 200 python3 -m moebench run sweeps/layer.yaml --out $PWD/$out/before && \
timeout 80 python3 -m moebench run sweeps/kernels_experts.yaml --out $PWD/$out/before" \
          "compare::for s in layer kernels_experts; do python3 -m moebench compare $out/before/\$s-* $out/after/\$s-*; done" ;;
  profile)
    batch "profile_shapes::timeout 120 python3 scripts/profile_trace_timings.py shapes" \
          "profile_ranks::timeout 120 python3 scripts/profile_trace_timings.py ranks" ;;
  *)
    sed -n '2,13p' "$0"; exit 2 ;;
esac
