"""meganeura.kernels: WGSL generators, one module per archetype (pointwise, reduce, matmul, attention), the
shared rendering helpers (``wgsl``) and the matmul tuner's candidates (``matmul_tuning``); torch-free, and free of
``meganeura.runtime``: what depends on a device (limits, timing) comes in as values."""
