#!/usr/bin/env bash
# One device call = one batch of GPU checks and benchmarks. Each step's full log goes to $OUT/logs.tgz (with any
# run directories under results/ and plots/ it made); the tail of each log is printed.
#   bash scripts/gpu_batch.sh "name::command" "name::command" ...
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/moebench-out}
LOGS=$PWD/.out/logs
mkdir -p "$OUT" "$LOGS"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # keep what the caller put there
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .deb/*.deb >/dev/null 2>&1; then  # libdw/libelf for `nsys stats` (docs/hardware.md#nsys)
  mkdir -p /tmp/debroot && for f in .deb/*.deb; do dpkg -x "$f" /tmp/debroot; done
  export MOEBENCH_NSYS_LIBDIR=/tmp/debroot/usr/lib/x86_64-linux-gnu
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"; } 2>&1 | tee "$LOGS/env.log"
for spec in "$@"; do
  name=${spec%%::*}; cmd=${spec#*::}
  t0=$(date +%s)
  bash -c "$cmd" > "$LOGS/$name.log" 2>&1
  rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s: $cmd"
  tail -n "${TAILN:-30}" "$LOGS/$name.log" | cut -c1-220
  # after every step, so a call cut short by its time limit still returns what was done
  tar czf "$OUT/logs.tgz" -C "$PWD/.out" logs 2>/dev/null
  [ -d results ] && tar czf "$OUT/results.tgz" results $( [ -d plots ] && echo plots ) 2>/dev/null
done
exit 0
