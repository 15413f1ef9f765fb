"""Outside implementations timed beside moebench's own, one home: the library adapters (vllm, sglang, flashinfer,
on _lib: detection, the adapter contract, layout normalisation) and the torch.compile peers (compile). Every
module registers its impls at import, like moebench.bench (registry.load_all imports both), and builds on the bench
families' cases, so a peer gets the same inputs, check, bytes and routing. They may import registry, families,
params, inputs, kernels and bench; nothing imports them but the registry's discovery. The ratios to the best peer
are read back from records in moebench.report.peers; torch-composed expert GEMM peers that are kernels in their own
right live in the kernel library (moebench.kernels.fused_experts_fp8_peer).
"""
