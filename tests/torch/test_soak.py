"""Long-lived processes: one process runs many paths interleaved (inference, the resident step with graph breaks, the
ordinary loop, export, generation bundles, HF ``generate`` through the backend), over several models, batch sizes
growing and shrinking, and each result equals the same unit of work run alone in a fresh process
(``helpers.soak``). The programs of all these paths share one device: its arena, its buffer pool, its pipelines.

Equal means equal to float32 rounding: a unit run again at a new batch size may find dynamo compiling a dynamic graph
for its frame (the second shape a frame sees), whose kernels may add in another order than the fresh process's
static ones; tokens must be identical. The default suite runs a short sequence against one fresh process that runs
the units in another order; the slow stage runs each unit in a fresh process of its own, after the model sweep's
families (pytest -m slow runs test_model_sweep.py first in the same process).
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from helpers import soak

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
RTOL, ATOL = 1e-4, 1e-5  # three AdamW steps apart in the order of a few sums: far below any wrong result

SHORT = ["infer:gpt2:2", "step:layerdrop:4", "loop:resnet:2", "export:gpt2:2", "generate:llama:1",
         "infer:gpt2:3", "step:layerdrop:6", "infer:gpt2:2", "step:layerdrop:4"]
# Six sweep families and our own models, every path; each model comes back at another batch size and then its first.
LONG = ["infer:vit:1", "step:layerdrop:4", "loop:resnet:2", "step:bart:1", "export:vit:1", "export_lm:llama:1",
        "generate:llama:1", "loop:gpt2:1", "step:autoencoder_kl:1", "infer:qwen2:1", "loop:t5:1",
        "infer:vit:2", "step:layerdrop:6", "loop:resnet:3", "step:bart:2", "infer:qwen2:2", "generate:llama:2",
        "step:unet2d_condition:1", "infer:vit:1", "step:layerdrop:4", "loop:resnet:2", "export:vit:1",
        "loop:gpt2:2", "infer:qwen2:1"]


def fresh(out: Path, *units: str) -> dict[str, np.ndarray]:
    """The arrays of ``units`` run one after another in a fresh Python process."""
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    done = subprocess.run([sys.executable, soak.__file__, str(out), *units], capture_output=True, text=True,
                          env=env, timeout=3000)
    assert done.returncode == 0, done.stderr[-4000:]
    with np.load(out) as arrays:
        return dict(arrays)


def interleaved(units: list[str]) -> list[dict[str, np.ndarray]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [soak.run_unit(unit) for unit in units]


def assert_equal_to_fresh(got: list[dict[str, np.ndarray]], want: dict[str, np.ndarray]) -> None:
    failures = []
    for arrays in got:
        for key, value in arrays.items():
            exact = key.endswith("/tokens")
            try:
                if exact:
                    np.testing.assert_array_equal(value, want[key])
                else:
                    np.testing.assert_allclose(value, want[key], rtol=RTOL, atol=ATOL)
            except AssertionError as error:
                failures.append(f"{key}: {str(error).strip().splitlines()[-3:]}")
    assert not failures, "\n".join(failures)


def test_interleaved_paths_give_what_a_fresh_process_gives(tmp_path):
    units = sorted(set(SHORT), reverse=True)  # another order, each unit once
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(fresh, tmp_path / "fresh.npz", *units)
        got = interleaved(SHORT)
        want = reference.result()
    assert_equal_to_fresh(got, want)


@pytest.mark.slow
def test_soak_against_each_unit_alone(tmp_path):
    units = sorted(set(LONG))
    with ThreadPoolExecutor(2) as pool:
        alone = list(pool.map(lambda ix: fresh(tmp_path / f"{ix[0]}.npz", ix[1]), enumerate(units)))
    want = {key: value for arrays in alone for key, value in arrays.items()}
    assert_equal_to_fresh(interleaved(LONG), want)
