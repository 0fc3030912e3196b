"""Helpers shared by the test modules; import them from their modules, e.g. ``from helpers.compare import
check_against_eager``. pytest's default (prepend) import mode puts tests/, the folder of the rootdir conftest, on
``sys.path``, since tests/ has no ``__init__.py``.

- ``compare``: outputs and gradients of the backend judged against eager PyTorch and float64;
- ``recording_device``: a device with no GPU behind it that records what a ``Program`` asks of it;
- ``bad_bundles``: damage both kinds of bundle must refuse with the same message;
- ``compiled_plans``: the plans (or their kernels) the backend compiles while a test runs.

tests/conftest.py keeps fixtures and hooks only.
"""
