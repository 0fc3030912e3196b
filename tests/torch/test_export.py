"""Export: bundles of the spine's Llama and BERT and of HF ResNet-50 (eval) run without torch (``meganeura.runtime`` and
the CLI) and match eager; bad bundles are refused by name before any device object is built; what cannot be exported is
refused; a model trained with backend="meganeura" deploys with its trained weights."""
from __future__ import annotations

import copy
import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.numpy import load_file, save_file

import torch_meganeura
from meganeura.runtime import BundleError, FeatureError, InputError, LimitError, load
from meganeura.runtime.bundle import read_bundle
from meganeura.runtime.cli import main as cli
from meganeura.runtime.device import get_device
from meganeura.runtime.requirements import PORTABLE_LIMITS, compile_limits, plan_requirements
from helpers.bad_bundles import DEPLOY, SHARED, expected as shared_message
from helpers.models import llama, randomize_layer_norms, resnet50
from helpers.torch_free import BLOCK_TORCH

# torch.export deep-copies TreeSpecs, which warns inside torch 2.13 (copyreg): not ours, and noise in reports.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
RTOL, ATOL = 1e-4, 1e-5
RUN_BUNDLES = BLOCK_TORCH + textwrap.dedent("""\
    import json
    from pathlib import Path
    import numpy as np
    from meganeura.runtime import load
    for bundle, inputs, out in json.loads(sys.argv[1]):
        outputs = load(bundle)(**{name: np.load(file) for name, file in inputs.items()})
        for name, array in outputs.items():
            np.save(Path(out) / f"{name}.npy", array)
    assert not [m for m, v in sys.modules.items() if m.split(".")[0] == "torch" and v is not None]
""")
RUN_CLI = BLOCK_TORCH + "import runpy\nrunpy.run_module('meganeura.runtime', run_name='__main__', alter_sys=True)\n"


def _bert():
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, initializer_range=0.1)
    return randomize_layer_norms(BertModel(config))


def _exported(model, inputs: dict, path: Path) -> dict:
    """Export ``model`` on ``inputs`` to ``path``; save the inputs as .npy; return the case with eager outputs."""
    torch_meganeura.export(model, inputs, path / "bundle")
    (path / "inputs").mkdir()
    files = {}
    for name, value in inputs.items():
        files[name] = str(path / "inputs" / f"{name}.npy")
        np.save(files[name], value.numpy())
    with torch.no_grad():
        out = model(**inputs)
    want = {key: value.numpy() for key, value in out.items()}  # HF ModelOutput: its fields, in order
    return {"bundle": str(path / "bundle"), "inputs": files, "want": want, "path": path}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    bert_mask = mask.clone()
    bert_mask[0, 11:] = 0
    types = torch.zeros(2, 16, dtype=torch.long)
    types[:, 8:] = 1
    return {
        "llama": _exported(llama(), {"input_ids": ids, "attention_mask": mask}, tmp_path_factory.mktemp("llama")),
        "bert": _exported(_bert(), {"input_ids": ids, "attention_mask": bert_mask, "token_type_ids": types},
                          tmp_path_factory.mktemp("bert")),
        "resnet50": _exported(resnet50().eval(), {"pixel_values": torch.randn(1, 3, 32, 32)},
                              tmp_path_factory.mktemp("resnet50")),
    }


def _assert_outputs(out_dir: Path, want: dict) -> None:
    assert sorted(p.stem for p in out_dir.glob("*.npy")) == sorted(want)
    for name, expected in want.items():
        np.testing.assert_allclose(np.load(out_dir / f"{name}.npy"), expected, rtol=RTOL, atol=ATOL, err_msg=name)


def test_bundles_match_eager_in_a_process_without_torch(cases, tmp_path):
    jobs = []
    for name, case in cases.items():
        (tmp_path / name).mkdir()
        jobs.append([case["bundle"], case["inputs"], str(tmp_path / name)])
    subprocess.run([sys.executable, "-c", RUN_BUNDLES, json.dumps(jobs)], check=True, timeout=300)
    for name, case in cases.items():
        _assert_outputs(tmp_path / name, case["want"])
    assert list(cases["bert"]["want"]) == ["last_hidden_state", "pooler_output"]  # ModelOutput fields, named


@pytest.mark.parametrize("name", ["llama", "bert", "resnet50"])
def test_cli_run_matches_eager_without_torch(cases, tmp_path, name):
    case = cases[name]
    inputs = [f"--input={key}={file}" for key, file in case["inputs"].items()]
    result = subprocess.run([sys.executable, "-c", RUN_CLI, "run", case["bundle"], *inputs, "--output",
                             str(tmp_path), "--repeat", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for line in ("load:", "first call:", "repeat call:"):
        assert line in result.stdout
    _assert_outputs(tmp_path, case["want"])


def test_cli_inspect_info_and_help(cases, capsys):
    assert cli(["inspect", cases["llama"]["bundle"]]) == 0
    text = capsys.readouterr().out
    for line in ("input:       input_ids: int64[2, 16]", "output:      logits: float32[2, 16, 128]", "dispatches:",
                 "memory plan: param"):
        assert line in text
    assert cli(["inspect", "--json", cases["llama"]["bundle"]]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dispatches"] > 0 and summary["memory_bytes_by_role"]["arena"] > 0
    assert cli(["info"]) == 0
    assert "default:" in capsys.readouterr().out
    for command in ([], ["info"], ["run"], ["inspect"]):
        with pytest.raises(SystemExit) as exit_:
            cli([*command, "--help"])
        assert exit_.value.code == 0
    assert "usage: meganeura run" in capsys.readouterr().out
    help_ = subprocess.run([sys.executable, "-m", "meganeura.runtime", "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and "inspect" in help_.stdout


# ---- bad bundles: a small model, copied and broken per test


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.fc(x)), x.sum(-1)


@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("small") / "bundle"
    torch_meganeura.export(Small().eval(), (torch.randn(2, 4),), path)
    return path


@pytest.fixture
def bundle(small_bundle, tmp_path) -> Path:
    return Path(shutil.copytree(small_bundle, tmp_path / "bundle"))


def _edit_manifest(path: Path, edit) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _replace(path: Path, name: str, data: bytes) -> None:
    """Replace a file and record its new hash: a consistent-looking bundle, so the deeper checks are reached."""
    (path / name).write_bytes(data)
    _edit_manifest(path, lambda m: m["files"].__setitem__(name, hashlib.sha256(data).hexdigest()))


def _edit_plan(path: Path, edit) -> None:
    plan = json.loads((path / "plan.json").read_text())
    edit(plan)
    _replace(path, "plan.json", json.dumps(plan).encode())


def _edit_weights(path: Path, edit) -> None:
    weights = load_file(path / "weights.safetensors")
    edit(weights)
    save_file(weights, path / "weights.safetensors")
    _replace(path, "weights.safetensors", (path / "weights.safetensors").read_bytes())


BAD = {
    "manifest says another shape": (
        lambda p: _edit_manifest(p, lambda m: m["inputs"][0].update(shape=[2, 5])),
        "manifest.json says input 'x' is float32[2, 5], the plan says float32[2, 4]"),
    "plan names another output": (
        lambda p: _edit_plan(p, lambda plan: plan["outputs"][0].update(name="elsewhere")),
        "outputs ['out0', 'out1'] do not match the plan's"),
    "plan kernel missing from manifest": (
        lambda p: _edit_manifest(p, lambda m: m["kernels"].pop()), "lists files"),
    "weight of the wrong shape": (
        lambda p: _edit_weights(p, lambda w: w.update({k: np.zeros((3, 5), np.float32) for k in w if w[k].ndim == 2})),
        "is F32[3, 5], it must be F32[3, 4]"),
    "weight of the wrong dtype": (
        lambda p: _edit_weights(p, lambda w: w.update({k: v.astype(np.float64) for k, v in w.items()})),
        "is F64[3"),
    "unsafe output name": (lambda p: _edit_manifest(p, lambda m: m["outputs"][0].update(name="../x")),
                           "not a plain name"),
}
# and what both kinds of bundle refuse alike (the generation bundle's cases: test_export_lm.py)
BAD.update({case: (lambda p, damage=damage: damage(p, DEPLOY), shared_message(case, DEPLOY))
            for case, (damage, _) in SHARED.items()})


@pytest.mark.parametrize("case", list(BAD))
def test_bad_bundle_is_refused_before_the_device_is_touched(bundle, case):
    breaks, message = BAD[case]
    breaks(bundle)
    before = get_device().counters.snapshot()
    with pytest.raises(BundleError, match="bundle .*: ") as err:
        load(bundle)
    assert message in str(err.value)
    after = get_device().counters.snapshot()
    assert (after["buffers_created"], after["pipelines_created"]) == (before["buffers_created"],
                                                                      before["pipelines_created"])


@pytest.mark.parametrize("edit, error, message", [
    (lambda m: m["requires"]["features"].append("texture-compression-astc"), FeatureError,
     r"needs the feature\(s\) \['texture-compression-astc'\]"),
    (lambda m: m["requires"]["limits"].update({"max-storage-buffer-binding-size": 1 << 40}), LimitError,
     "needs max-storage-buffer-binding-size at least 1099511627776"),
    (lambda m: m["requires"]["limits"].update({"min-storage-buffer-offset-alignment": 4}), LimitError,
     "needs min-storage-buffer-offset-alignment at most 4"),
])
def test_adapter_without_a_requirement_is_refused(bundle, edit, error, message):
    _edit_manifest(bundle, edit)
    before = get_device().counters.snapshot()["buffers_created"]
    with pytest.raises(error, match=message):
        load(bundle)
    assert get_device().counters.snapshot()["buffers_created"] == before


def test_wrong_inputs_at_call_time(small_bundle):
    model = load(small_bundle)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    assert set(model(x)) == {"output.0", "output.1"}  # a tuple's items, named by position
    for call, message in [
        (lambda: model(x[:1]), r"input 'x' must be a float32 array of shape \(2, 4\), got float32 of shape \(1, 4\)"),
        (lambda: model(x.astype(np.float64)), "got float64"),
        (lambda: model(x.tolist()), "must be a numpy float32 array"),
        (lambda: model(), r"missing: \['x'\]"),
        (lambda: model(x, y=x), r"unknown: \['y'\]"),
        (lambda: model(x, x=x), r"given twice: \['x'\]"),
    ]:
        with pytest.raises(InputError, match=message):
            call()
    model.release()


def test_requirements_come_from_the_plan(small_bundle):
    bundle = read_bundle(small_bundle)
    manifest, plan = bundle.manifest, bundle.plan
    limits = manifest["requires"]["limits"]
    assert limits["min-storage-buffer-offset-alignment"] == 256  # portable: any WebGPU adapter's alignment
    assert limits["max-storage-buffers-per-shader-stage"] == max(len(d.bindings) for d in plan.dispatches)
    assert all(limits[name] <= value for name, value in PORTABLE_LIMITS.items() if name.startswith("max-"))
    device = compile_limits(get_device().limits, portable=False)
    assert device["min-storage-buffer-offset-alignment"] == get_device().limits["min-storage-buffer-offset-alignment"]
    plan.kernels = {name: "enable f16;\n" + wgsl for name, wgsl in plan.kernels.items()}
    assert plan_requirements(plan, device)["features"] == ["shader-f16"]


def test_cli_reads_no_pickle(small_bundle, tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.array([{"a": 1}], dtype=object))  # an object array: stored as a pickle
    assert cli(["run", str(small_bundle), "--input", f"x={tmp_path / 'x.npy'}"]) == 1
    assert "allow_pickle=False" in capsys.readouterr().err


# ---- what export refuses, random ops, train-to-deploy


class DataDependent(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x - 1


class Unsupported(nn.Module):
    def forward(self, x):
        return torch.sort(x).values * 2


class ReturnsAnObject(nn.Module):
    def forward(self, x):
        return {"y": x * 2, "state": Path("not a tensor")}


@pytest.mark.parametrize("model, x, message", [
    (DataDependent(), torch.randn(3), "could not trace DataDependent .*control flow that depends on tensor values"),
    (ReturnsAnObject(), torch.randn(3), "could not trace ReturnsAnObject .*outputs hold an object that is not a "
                                        "tensor"),
    (Unsupported(), torch.randn(3, 3), r"the device cannot run these ops.*aten.sort.default \(no lowering\)"),
    (nn.BatchNorm1d(3).train(), torch.randn(4, 3), "mutates .*running_mean.*model.eval"),
])
def test_export_refuses_with_the_reason(model, x, message, tmp_path):
    with pytest.raises(torch_meganeura.ExportError, match=message):
        torch_meganeura.export(model, x, tmp_path / "bundle")
    assert not (tmp_path / "bundle" / "manifest.json").exists()


def test_a_language_model_with_its_default_config_exports_without_its_kv_cache(tmp_path):
    """An HF causal LM returns a DynamicCache by default (config.use_cache), which a bundle cannot hold: it is
    exported without it, with a warning, and the user's config is left as it was."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0)).eval()
    assert model.config.use_cache
    ids = torch.randint(0, 64, (1, 8))
    with pytest.warns(UserWarning, match="without its KV cache output"):
        manifest = torch_meganeura.export(model, (ids,), tmp_path / "bundle")
    assert model.config.use_cache
    assert [o["name"] for o in manifest["outputs"]] == ["logits"]
    with torch.no_grad():
        want = model(ids).logits.numpy()
    got = load(tmp_path / "bundle")(input_ids=ids.numpy())["logits"]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


class Noisy(nn.Module):
    def forward(self, x):
        return x + torch.rand_like(x)


def test_random_ops_draw_a_new_key_per_call(tmp_path):
    torch_meganeura.export(Noisy(), torch.zeros(64), tmp_path / "bundle")
    x = np.zeros(64, np.float32)
    first, second = load(tmp_path / "bundle", seed=1), load(tmp_path / "bundle", seed=1)
    a, b = first(x)["output"], first(x)["output"]
    assert ((a >= 0) & (a < 1)).all() and not np.array_equal(a, b)
    np.testing.assert_array_equal(second(x)["output"], a)  # the seed makes runs reproducible


def test_train_with_backend_then_deploy(tmp_path):
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))
    initial = [p.detach().clone() for p in model.parameters()]
    compiled = torch.compile(model, backend="meganeura")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(compiled(x), y).backward()
        opt.step()
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), initial))
    torch_meganeura.export(compiled, x, tmp_path / "bundle")  # the compiled model: its trained weights
    got = load(tmp_path / "bundle")(x.numpy())["output"]
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), rtol=RTOL, atol=ATOL)
        for p, q in zip(model.parameters(), initial):
            p.copy_(q)
        assert np.abs(got - model(x).numpy()).max() > 1e-3  # not the untrained model


def test_export_takes_a_train_steps_weights_from_the_device(tmp_path):
    """A bundle exported from compile_train_step holds the trained weights without a sync: the module stays stale."""
    from torch_meganeura import compile_train_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))
    x, y = torch.randn(5, 8), torch.randn(5, 3)
    step = compile_train_step(model, lambda m, x, y: F.mse_loss(m(x), y), torch.optim.SGD(model.parameters(), lr=0.5))
    for _ in range(3):
        step(x, y)
    stale = copy.deepcopy(model)
    torch_meganeura.export(step, (x,), tmp_path / "bundle")
    for (name, p), q in zip(model.named_parameters(), stale.parameters()):
        assert torch.equal(p, q), f"export changed the module's {name}"
    got = load(tmp_path / "bundle")(x.numpy())["output"]
    step.sync_to_module()
    with torch.no_grad():
        trained, before = model(x).numpy(), stale(x).numpy()
    np.testing.assert_allclose(got, trained, rtol=RTOL, atol=ATOL)
    assert np.abs(trained - before).max() > 1e-2  # the three steps moved the output: the bundle is not stale


def test_export_replaces_only_a_bundle(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(BundleError, match="not empty; pass overwrite=True"):
        torch_meganeura.export(Noisy(), torch.zeros(4), tmp_path)
    with pytest.raises(BundleError, match="holds no bundle: not replaced"):
        torch_meganeura.export(Noisy(), torch.zeros(4), tmp_path, overwrite=True)
    assert (tmp_path / "keep.txt").read_text() == "mine"
    torch_meganeura.export(Noisy(), torch.zeros(4), tmp_path / "bundle")
    torch_meganeura.export(Noisy(), torch.zeros(8), tmp_path / "bundle", overwrite=True)
    assert load(tmp_path / "bundle").inputs[0]["shape"] == [8]
