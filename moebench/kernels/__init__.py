"""moebench kernels: each module holds a Triton kernel, its launcher and the plain-torch reference
`<name>_torch` that follows SPEC.md literally, plus its registration for sweeps."""
