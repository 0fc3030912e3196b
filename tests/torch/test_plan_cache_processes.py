"""The plan cache across processes: a second process compiling the same model reads every plan from the cache
and gets eager's result, like the first."""
import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, torch, warnings
from transformers import LlamaConfig, LlamaForCausalLM
import torch_meganeura
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     initializer_range=0.1, use_cache=False)).eval()
ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
with torch.no_grad(), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    report = torch_meganeura.explain(lambda t: model(t).logits, ids)
    compiled = torch.compile(lambda t: model(t).logits, backend="meganeura")
    error = (compiled(ids) - model(ids).logits).abs().max().item()
print(json.dumps({"partitions": report.partitions, "cached": report.cached_plans, "error": error,
                  "seconds": report.compile_seconds}))
"""


def _run(cache_dir) -> dict:
    env = dict(os.environ, MEGANEURA_CACHE_DIR=str(cache_dir),
               XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR", "/tmp"))
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# 25 s on the 2-core machine: a second process compiles every plan (the slow stage: docs/architecture.md, Tests)
@pytest.mark.slow
def test_second_process_reads_every_plan_from_the_cache(tmp_path):
    cold = _run(tmp_path)
    warm = _run(tmp_path)
    assert cold["cached"] == 0 and cold["partitions"] >= 1, cold
    assert warm["cached"] == warm["partitions"] == cold["partitions"], warm
    assert cold["error"] < 1e-4 and warm["error"] < 1e-4, (cold, warm)
    assert list(tmp_path.glob("*.json")), "no entry was written"
