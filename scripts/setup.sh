#!/usr/bin/env bash
# Set up a fresh machine for torch-meganeura: the lavapipe Vulkan driver (when no Vulkan loader is
# installed and we are root), a virtual environment in .venv, torch 2.13 (CPU) and the package with its
# test extras. Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! ldconfig -p 2>/dev/null | grep -q libvulkan.so.1 || ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
  else
    echo "setup: no Vulkan driver found; install mesa-vulkan-drivers and libvulkan1 (or a GPU driver)" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[test]"
