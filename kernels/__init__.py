"""meganeura.kernels: WGSL generators, one module per archetype (pointwise, reduce, matmul, attention), the
shared rendering helpers (``wgsl``) and the matmul tuner's candidates (``matmul_tuning``); torch-free, and free of
``meganeura.runtime``: what depends on a device (limits, timing) comes in as values.

Modules: ``pointwise`` and ``reduce`` (their archetypes' kernels), ``matmul`` (the tiled, split-K and GEMV matmul
kernels) with ``matmul_staging`` (a tile's loads into shared memory and its range checks) and ``matmul_tuning``
(per-shape candidate variants), ``attention`` (a package: fused attention forward and backward), ``prelude`` (the
WGSL through which a matmul or attention kernel reads a fused node's operands and writes its outputs), ``wgsl``
(storage types, bindings, the op table, expression emission) with ``wgsl_functions`` (the op table's helper
functions), ``sizes`` (symbolic sizes as values: ``Size``, ``Guards``).
"""
