"""Stand-ins for libraries that cannot be brought here (vLLM, SGLang's sgl_kernel, FlashInfer): plain-torch
modules with those libraries' exact call signatures and output conventions (in-place outputs, sentinels, bucket
layouts), so moebench's adapters can be tested on the CPU. They are not the libraries: passing against them says
the adapters handle the documented conventions, not that the real kernels agree with moebench."""
