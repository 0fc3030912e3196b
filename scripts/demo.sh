#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the main job: python -m torch_meganeura.demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# PYTHONSAFEPATH: the checkout's root stays off sys.path (its kernels/ folder would shadow Hugging Face's ``kernels``)
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}" PYTHONSAFEPATH=1
exec .venv/bin/python -m torch_meganeura.demo "$@"
