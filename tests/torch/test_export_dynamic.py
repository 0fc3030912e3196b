"""Bundles with dynamic dimensions: ``export(..., dynamic_shapes=...)`` with torch.export's ``Dim``s, each with a
largest value. One plan over symbolic sizes, sized for those values, runs without torch at any size in the range and
matches eager; sizes outside it, or that the plan's guards exclude, are refused by name; a manifest whose dynamic
section was edited into something else is refused before anything runs."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.export import Dim

import torch_meganeura
from meganeura.runtime import BundleError, InputError, load
from torch_meganeura.bundles.export import ExportError
from helpers.models import randomize_layer_norms
from helpers.torch_free import BLOCK_TORCH

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
RTOL, ATOL = 1e-4, 1e-5
MAX_BATCH, MAX_SEQ = 4, 48
SIZES = [(2, 16), (3, 9), (4, 48), (2, 2)]  # the traced size, others within the ranges, and the ends
RUN = BLOCK_TORCH + textwrap.dedent("""\
    import json
    import numpy as np
    from meganeura.runtime import load
    bundle, cases = json.loads(sys.argv[1])
    model = load(bundle)
    for inputs, out in cases:
        np.save(out, model(**{name: np.load(file) for name, file in inputs.items()})["last_hidden_state"])
    assert not [m for m, v in sys.modules.items() if m.split(".")[0] == "torch" and v is not None]
""")


def _bert():
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, initializer_range=0.1)
    return randomize_layer_norms(BertModel(config))


def _inputs(batch: int, seq: int) -> dict:
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq // 2:] = 0
    return {"input_ids": torch.randint(0, 128, (batch, seq)), "attention_mask": mask}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = _bert()
    batch, seq = Dim("batch", max=MAX_BATCH), Dim("seq", max=MAX_SEQ)
    dims = {name: {0: batch, 1: seq} for name in ("input_ids", "attention_mask")}
    path = tmp_path_factory.mktemp("bert") / "bundle"
    manifest = torch_meganeura.export(model, _inputs(*SIZES[0]), path, dynamic_shapes=dims)
    return model, path, manifest


def test_a_dynamic_bundle_runs_every_size_without_torch(exported, tmp_path):
    model, path, manifest = exported
    assert [(s["input"], s["dim"], s["max"]) for s in manifest["dynamic"]["symbols"]] == [
        ("input_ids", 0, MAX_BATCH), ("input_ids", 1, MAX_SEQ)]
    cases, wants = [], []
    for k, (batch, seq) in enumerate(SIZES):
        inputs = _inputs(batch, seq)
        files = {}
        for name, value in inputs.items():
            files[name] = str(tmp_path / f"{name}{k}.npy")
            np.save(files[name], value.numpy())
        cases.append([files, str(tmp_path / f"out{k}.npy")])
        with torch.no_grad():
            wants.append(model(**inputs).last_hidden_state.numpy())
    subprocess.run([sys.executable, "-c", RUN, json.dumps([str(path), cases])], check=True, timeout=300)
    for (_, out), want in zip(cases, wants):
        np.testing.assert_allclose(np.load(out), want, rtol=RTOL, atol=ATOL)


def test_sizes_outside_the_bundle_are_refused_by_name(exported):
    _, path, _ = exported
    model = load(path)
    ids = np.zeros((2, MAX_SEQ + 1), np.int64)
    with pytest.raises(InputError, match=r"'input_ids' dimension 1 is 49; this bundle takes"):
        model(input_ids=ids, attention_mask=np.ones_like(ids))
    ids = np.zeros((2, 5), np.int64)
    with pytest.raises(InputError, match=r"'attention_mask' must be a int64 array of shape \(2, 5\)"):
        model(input_ids=ids, attention_mask=np.ones((2, 6), np.int64))
    ids = np.zeros((2, 1), np.int64)  # a length of 1: the plan's guards (torch.export's sizes are at least 2)
    with pytest.raises(InputError, match="not ones this bundle's plan serves"):
        model(input_ids=ids, attention_mask=np.ones_like(ids))


def test_an_edited_dynamic_section_is_refused(exported, tmp_path):
    _, path, manifest = exported
    edited = json.loads(json.dumps(manifest))
    edited["dynamic"]["guards"][0][1] = [[[0], "__import__('os').system('true')"]]  # not a size
    target = tmp_path / "edited"
    target.mkdir()
    for item in path.iterdir():
        if item.is_file():
            (target / item.name).write_bytes(item.read_bytes())
        else:
            (target / item.name).mkdir()
            for kernel in item.iterdir():
                (target / item.name / kernel.name).write_bytes(kernel.read_bytes())
    (target / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(BundleError, match="'dynamic'"):
        load(target)


def test_a_dimension_without_a_largest_value_is_refused(tmp_path):
    model = torch.nn.Linear(8, 4)
    with pytest.raises(ExportError, match="have no largest value"):
        torch_meganeura.export(model, (torch.randn(3, 8),), tmp_path / "b", dynamic_shapes=({0: Dim("rows")},))
