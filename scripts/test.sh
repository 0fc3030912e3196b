#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the test suite on the Vulkan adapter wgpu finds (lavapipe on CPU machines).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# PYTHONSAFEPATH: no Python started here puts the checkout's root on sys.path, where its kernels/ folder (installed
# as meganeura.kernels) would shadow Hugging Face's ``kernels`` package, which transformers >= 5.2x imports.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}" PYTHONSAFEPATH=1
exec .venv/bin/pytest tests -q "$@"
