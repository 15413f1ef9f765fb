"""moebench.bench: the benchmark cases, one module per stage family (routers, staging, expert_ids, align, experts,
moe_sum, layer, ep_sim, dispatch, jit_trace). `moebench.registry.load_all` imports every module here whose name
does not start with an underscore (discovery, no hand-kept list); each registers its impls at import with
`registry.register_impl`.

A new kernel is one library file plus one registration:
  1. `moebench/kernels/<op>.py`: the Triton kernel and its launcher `<op>(...)`, the plain-torch reference
     `<op>_torch(...)`, and the mask-oblivious twin `<op>_oblivious(...)` where the pre-fix behaviour is a
     function of its own. It imports nothing of the harness (registry, inputs, bench, ...), so a serving engineer
     can use it alone.
  2. In the bench module of its family (or a new `moebench/bench/<family>.py`, found by discovery):

         @register_impl("<op>.triton", targets=("kernel",), description="...")
         def build(p: Params, ctx: RunContext) -> Case: ...

     `build` makes the inputs (moebench.inputs), preallocates the outputs, and returns a Case whose `run` is the
     timed call and whose `check` compares against the reference; it declares bytes_moved (and flops) and its
     NVTX stage. Register the reference with `baseline=True` and an oblivious twin with `twin_of="<op>.triton"`
     (the mask-aware impl it is paired with). The usual triton / torch / oblivious set is one call,
     `register_variants("<op>", {variant: description}, make_build)`, which does exactly that.
tests/bench/test_bench_contract.py then builds, checks and times every registered impl at a small shape on the CPU, so a
new impl gets those tests for free.
"""
