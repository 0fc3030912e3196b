"""meganeura.kernels: WGSL generators, one module per archetype (pointwise, reduce, matmul, attention), the
shared rendering helpers (``wgsl``) and the matmul tuner; torch-free."""
