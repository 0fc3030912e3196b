"""Units of work for the soak test (tests/torch/test_soak.py): each builds its model and inputs from a seed of its
own, runs one path of the product on them and returns what it computed as named numpy arrays, so that the same unit
gives the same arrays whether it runs alone in a fresh process (``python tests/helpers/soak.py OUT.npz UNIT...``) or
among many others in one long-lived process.

A unit is (path, model, batch). Paths: ``infer`` (``torch.compile`` inference), ``step`` (``compile_train_step``,
AdamW), ``loop`` (the ordinary loop with ``keep_on_device(AdamW)``), ``export`` (a bundle run by
``meganeura.runtime.load``), ``export_lm`` (a generation bundle's greedy tokens), ``generate`` (HF ``generate``
through the backend). Models: the model sweep's families (tests/torch/test_model_sweep.py) and a few of our own:
``layerdrop`` (a residual MLP whose forward branches on a random draw and logs, so dynamo breaks its graph),
``resnet`` (HF ResNet with BatchNorm), ``llama`` (``helpers.models.LLAMA``).
"""
from __future__ import annotations

import copy
import logging
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

TESTS = Path(__file__).resolve().parents[1]
TRAIN_STEPS = 3
NEW_TOKENS = 12
_log = logging.getLogger("tests.soak")


class LayerDropBlock(nn.Module):
    """A residual block skipped when a uniform draw is below ``p`` (HF Whisper's layerdrop), with a logging call."""

    def __init__(self, width: int, p: float = 0.0):
        super().__init__()
        self.linear, self.p = nn.Linear(width, width), p

    def forward(self, x):
        if self.training and torch.rand([]) < self.p:
            return x
        _log.debug("block ran")
        return x + torch.tanh(self.linear(x))


def layerdrop(batch: int):
    """Three layerdrop blocks and a head (width 32) over ``batch`` x 10 tokens; the loss is a cross entropy."""
    model = nn.Sequential(*[LayerDropBlock(32) for _ in range(3)], nn.Linear(32, 4))
    x, t = torch.randn(batch, 10, 32), torch.randint(0, 4, (batch, 10))
    return model, dict(input=x), lambda out: F.cross_entropy(out.flatten(0, 1), t.flatten())


def resnet(batch: int):
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3)
    labels = torch.randint(0, 3, (batch,))
    return (ResNetForImageClassification(config), dict(pixel_values=torch.randn(batch, 3, 32, 32)),
            lambda out: F.cross_entropy(out.logits, labels))


def llama(batch: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers.models import LLAMA

    ids = torch.randint(0, LLAMA["vocab_size"], (batch, 8))
    return LlamaForCausalLM(LlamaConfig(**LLAMA)), dict(input_ids=ids, labels=ids), lambda out: out.loss


def _model_sweep():
    """tests/torch/test_model_sweep.py as a module: its families and how it takes their outputs apart."""
    if str(TESTS / "torch") not in sys.path:
        sys.path.append(str(TESTS / "torch"))
    import test_model_sweep

    return test_model_sweep


def sweep(family: str, batch: int):
    """A model sweep family; its inputs repeated ``batch`` times along the batch dimension."""
    module = _model_sweep()
    model, inputs, hf_loss = module.MODELS[family]()
    inputs = {k: torch.cat([v] * batch) if isinstance(v, torch.Tensor) and v.dim() else v for k, v in inputs.items()}
    cotangents = []

    def loss(out):
        if not cotangents:
            cotangents.extend(module._cotangents(out))
        return module._loss(out, cotangents, hf_loss)
    return model, inputs, loss


OWN_MODELS = {"layerdrop": layerdrop, "resnet": resnet, "llama": llama}


def build(model_name: str, batch: int):
    """(model, keyword inputs, loss of the output) for ``model_name`` at ``batch``, from the unit's own seed."""
    torch.manual_seed(zlib.crc32(f"{model_name}/{batch}".encode()))
    maker = OWN_MODELS.get(model_name)
    return maker(batch) if maker else sweep(model_name, batch)


def _tensors(prefix: str, named) -> dict[str, np.ndarray]:
    return {f"{prefix}.{name}": t.detach().float().numpy().copy() for name, t in named}


def _leaves(out) -> dict[str, np.ndarray]:
    return {name: t.detach().float().numpy().copy() for name, t in _model_sweep().named_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point()}


def infer(model, inputs, _loss) -> dict[str, np.ndarray]:
    torch._dynamo.reset()
    compiled = torch.compile(model.eval(), backend="meganeura")
    with torch.no_grad():
        out = compiled(**inputs)
    return {"out": out.detach().numpy().copy()} if isinstance(out, torch.Tensor) else _leaves(out)


def step(model, inputs, loss) -> dict[str, np.ndarray]:
    import torch_meganeura

    model.train()
    names = list(inputs)
    train = torch_meganeura.compile_train_step(model, lambda m, *values: loss(m(**dict(zip(names, values)))),
                                               torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = [float(train(*inputs.values())) for _ in range(TRAIN_STEPS)]
    train.sync_to_module()
    return {"losses": np.asarray(losses), **_tensors("param", model.named_parameters()),
            **_tensors("buffer", model.named_buffers())}


def loop(model, inputs, loss) -> dict[str, np.ndarray]:
    import torch_meganeura

    model.train()
    opt = torch_meganeura.keep_on_device(torch.optim.AdamW(model.parameters(), lr=1e-3))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="meganeura")
    losses = []
    for _ in range(TRAIN_STEPS):
        value = loss(compiled(**inputs))
        value.backward()
        opt.step()
        opt.zero_grad()
        losses.append(value.item())
    return {"losses": np.asarray(losses), **_tensors("param", model.named_parameters()),
            **_tensors("buffer", model.named_buffers())}


def export(model, inputs, _loss) -> dict[str, np.ndarray]:
    import torch_meganeura
    from meganeura.runtime import load

    with tempfile.TemporaryDirectory() as folder:
        torch_meganeura.export(model.eval(), inputs, Path(folder) / "bundle")
        outputs = load(Path(folder) / "bundle")(**{k: v.numpy() for k, v in inputs.items()})
    return {name: np.asarray(value, np.float32) for name, value in outputs.items()}


def export_lm(model, inputs, _loss) -> dict[str, np.ndarray]:
    import torch_meganeura
    from meganeura.runtime import load

    with tempfile.TemporaryDirectory() as folder:
        torch_meganeura.export_lm(model.eval(), Path(folder) / "lm", max_cache_len=32)
        tokens = load(Path(folder) / "lm").generate(inputs["input_ids"][0].numpy(), NEW_TOKENS)
    return {"tokens": np.asarray(tokens)}


def generate(model, inputs, _loss) -> dict[str, np.ndarray]:
    torch._dynamo.reset()
    model.eval().forward = torch.compile(model.forward, backend="meganeura")
    ids = inputs["input_ids"]
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    return {"tokens": tokens.numpy()}


PATHS = {f.__name__: f for f in (infer, step, loop, export, export_lm, generate)}


def run_unit(unit: str) -> dict[str, np.ndarray]:
    """Run ``unit`` ("path:model:batch"); its arrays keyed "unit/name"."""
    path, model_name, batch = unit.split(":")
    model, inputs, loss = build(model_name, int(batch))
    return {f"{unit}/{name}": array for name, array in PATHS[path](copy.deepcopy(model), inputs, loss).items()}


def main(out: str, *units: str) -> None:
    """Run each unit of ``units`` in turn; save every array in ``out`` (an .npz)."""
    arrays: dict[str, np.ndarray] = {}
    for unit in units:
        arrays.update(run_unit(unit))
    np.savez(out, **arrays)


if __name__ == "__main__":
    sys.path[:0] = [str(TESTS)]  # ``helpers`` as the tests import it
    main(*sys.argv[1:])
