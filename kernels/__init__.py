"""meganeura.kernels: WGSL generators, one module per archetype (pointwise, reduce, matmul, attention), the
shared rendering helpers (``wgsl``) and the matmul tuner's candidates (``matmul_tuning``); torch-free, and free of
``meganeura.runtime``: what depends on a device (limits, timing) comes in as values.

Modules: ``pointwise`` and ``reduce`` (their archetypes' kernels), ``matmul`` (the tiled and split-K matmul kernels)
with ``matmul_plans`` (which variant a GEMM takes, and the tiled kernel's plan), ``matmul_gemv`` (the matrix-vector
kernel), ``matmul_split_sum`` (the pass that sums K
slices), ``matmul_common`` (what they share), ``matmul_staging`` (a tile's loads into shared memory and its range
checks) and ``matmul_tuning`` (per-shape candidate variants), ``attention`` (a package: fused attention forward and
backward), ``prelude`` (the WGSL through which a matmul or attention kernel reads a fused node's operands and writes its
outputs), ``wgsl`` (storage types, bindings, the op table, expression emission) with ``wgsl_functions`` (the op table's
helper functions), ``sizes`` (symbolic sizes as values: ``Size``, ``Guards``).
"""
if __name__ == "kernels":  # pragma: no cover - only where Python runs with the checkout's root on sys.path
    # This folder is the package meganeura.kernels (pyproject.toml's package-dir); a Python started in the
    # checkout's root (python -c, python -m, a REPL) also finds it as the top-level ``kernels``, the name of Hugging
    # Face's package, which transformers >= 5.25 imports. Hand that import to the installed ``kernels``, found on
    # sys.path without the checkout's root: import machinery returns what sys.modules holds once this file has run.
    # Where there is none (transformers before 5.25 only asks whether it is installed, by its distribution's
    # metadata, which this folder has not), this folder stays what it was: meganeura's kernels under that name.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
