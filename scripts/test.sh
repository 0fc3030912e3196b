#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint (ruff), then run the test suite on the Vulkan adapter wgpu finds (lavapipe on CPU
# machines).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# PYTHONSAFEPATH: no Python started here puts the checkout's root on sys.path, where its kernels/ folder (installed
# as meganeura.kernels) would shadow Hugging Face's ``kernels`` package, which transformers >= 5.2x imports.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}" PYTHONSAFEPATH=1
.venv/bin/ruff check .  # the lint rules of pyproject.toml's [tool.ruff]: a second, before the tests' minutes
# Two workers (pytest-xdist), a test file each at a time: the machines this runs on have 2 cores, and a test spends much
# of its time in one of them (Python, or lavapipe compiling a kernel). TEST_WORKERS=0 runs the tests in this process.
exec .venv/bin/pytest tests -q -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
