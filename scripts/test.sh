#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the test suite on the Vulkan adapter wgpu finds (lavapipe on CPU machines).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
exec .venv/bin/python -m pytest tests -q "$@"
