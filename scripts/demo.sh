#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the main job: python -m torch_meganeura.demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
exec .venv/bin/python -m torch_meganeura.demo "$@"
