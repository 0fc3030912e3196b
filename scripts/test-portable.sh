#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the model and op tests on a device held to WebGPU's default limits and no
# shader-f16 or subgroups (MEGANEURA_LIMITS=webgpu-default: 8 storage buffers per shader stage, 16 KiB of workgroup
# storage, 256 threads per workgroup), as many Apple, Intel and mobile adapters offer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# PYTHONSAFEPATH: no Python started here puts the checkout's root on sys.path, where its kernels/ folder (installed
# as meganeura.kernels) would shadow Hugging Face's ``kernels`` package, which transformers >= 5.2x imports.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}" PYTHONSAFEPATH=1 MEGANEURA_LIMITS=webgpu-default
tests=(inference_models vision_models attention training train_step export conv precision portable fuzz_graphs
       pooling_norms scatter_ops op_gradients half_precision runtime_behaviour device_optimizer export_lm dynamic_shapes
       hf_generate export_dynamic)
paths=()
for t in "${tests[@]}"; do paths+=("tests/torch/test_$t.py"); done
exec .venv/bin/pytest -q "${paths[@]}" "$@"
