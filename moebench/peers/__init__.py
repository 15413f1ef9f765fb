"""Outside implementations timed beside moebench's own, one home: the library adapters (vllm, sglang, flashinfer,
on _lib: detection, the adapter contract, layout normalisation), the torch.compile peers (compile) and the experts
through torch's grouped GEMMs with torch.compile'd glue (torch_grouped). Every module registers its impls at import,
like moebench.bench (registry.load_all imports both), and builds on the bench families' cases, so a peer gets the
same inputs, check, bytes and routing. They may import registry, families, params, inputs, kernels and bench;
nothing imports them but the registry's discovery. The ratios to the best peer are read back from records in
moebench.report.peers. The kernel library holds no peer.
"""
