"""The ``tune`` option: plans take the tuner's matmul variants (checked against eager with variants forced), and a
bad option value is refused."""
import re

import pytest
import torch

from helpers.compare import assert_same
from meganeura.kernels import matmul, matmul_plans, matmul_tuning
from meganeura.kernels.matmul_plans import MatmulChoice
from meganeura.runtime.device import get_device
from meganeura.runtime.matmul_tuner import MatmulTuner
import torch_meganeura.lower.tuning as tuning


class ForcingTuner:
    """Stands in for MatmulTuner: forces one variant and records the problems it was asked about."""
    fingerprint = "forced-for-test"

    def __init__(self, choice):
        self.choice, self.asked = choice, []

    def choose_all(self, problems):
        self.asked.extend(problems)
        return [self.choice for _ in problems]


@pytest.mark.parametrize("choice", [
    MatmulChoice((16, 32), (4, 4), 2), MatmulChoice((32, 16), (8, 4), 1),
    # quad staging and thread patches: both operands read along K (K = 96, 72: rows of whole vec4s), so as vec4s
    MatmulChoice((64, 64), (8, 8), 1, quads=True, patches=True),
    MatmulChoice((32, 64), (4, 4), 2, quads=True, patches=True),
    MatmulChoice((64, 64), (4, 4), 1, double=True, quads=True, patches=True),
    # double-buffered unpadded (two chunks in exactly WebGPU's 16 KiB for this tile) and at a capped chunk
    MatmulChoice((128, 128), (8, 8), 1, double=True, unpadded=True),
    MatmulChoice((128, 128), (8, 8), 1, double=True, quads=True, patches=True, chunk=8),
])
def test_tuned_variants_reach_the_plan_and_match_eager(monkeypatch, choice):
    torch._dynamo.reset()  # dynamo would reuse the graph compiled for another model of the same shapes
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 72), torch.nn.Tanh(), torch.nn.Linear(72, 40))
    x = torch.randn(50, 96)
    tuner = ForcingTuner(choice)
    monkeypatch.setattr(tuning, "tuner_for", lambda device: tuner)
    built = []
    generate = matmul.matmul_kernel

    def recording(prelude, **kw):
        built.append((kw["tile"], kw["block"], kw.get("split", 1), kw["double"], kw["quads"], kw["patches"],
                      kw["vector_loads"], kw["chunk"], kw["unpadded"]))
        return generate(prelude, **kw)

    monkeypatch.setattr(matmul, "matmul_kernel", recording)
    compiled = torch.compile(model, backend="meganeura", options={"tune": True})
    with torch.no_grad():
        assert_same(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    shapes = sorted((p.batch, p.m, p.n, p.k, p.a_fast, p.b_fast, p.f16) for p in tuner.asked)
    assert shapes == [(1, 50, 40, 72, "p", "p", False), (1, 50, 72, 96, "p", "p", False)]  # once each
    assert built and all(b == (choice.tile, choice.block, choice.split, choice.double, choice.quads, choice.patches,
                               "ab" if choice.quads else "", choice.chunk, choice.unpadded) for b in built)


def _functions(prelude: str) -> str:
    """A prelude's functions (loads, store), without the binding declarations, nor the vec4 loaders that only
    quad-staged variants call (a tuning problem's prelude has them for those candidates; a plan's kernel only where
    its variant is one)."""
    return re.sub(r"fn load_[ab]4\(.*?\n}\n?", "", prelude[prelude.index("fn "):], flags=re.S)


def test_the_tuner_times_each_kernel_with_its_own_loads_and_store(monkeypatch, tmp_path):
    """A convolution's problems carry its gather and fused epilogue, exactly as the plan's kernels have them; the
    real tuner times them (zero-filled scratch buffers) and the tuned plan matches eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 16, 3, stride=2))
    x = torch.randn(2, 3, 10, 10)
    monkeypatch.setattr(matmul_tuning, "CONFIGS", (((16, 32), (4, 4)),))  # few pipelines for a CPU driver
    monkeypatch.setattr(matmul_tuning, "SPLITS", (1, 2))
    real = MatmulTuner(get_device(), tmp_path)
    asked, built = [], []  # built: the preludes of the plan's matmul kernels (generated after tuning)
    choose = real.choose_all

    def choosing(problems):
        asked.extend(problems)
        chosen = choose(problems)
        built.clear()  # the tuner's own candidates
        return chosen

    monkeypatch.setattr(real, "choose_all", choosing)
    monkeypatch.setattr(tuning, "tuner_for", lambda device: real)
    generate = matmul.matmul_kernel
    monkeypatch.setattr(matmul, "matmul_kernel", lambda prelude, **kw: built.append(prelude) or generate(prelude, **kw))
    compiled = torch.compile(model, backend="meganeura", options={"tune": True})
    with torch.no_grad():
        assert_same(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    assert len(asked) == 2 and real.tuned == 2 and len(real.entries) == 2
    assert {_functions(p.prelude) for p in asked} == {_functions(p) for p in built}
    assert any("select(" in p.prelude for p in asked)  # the padded convolution's gather


def test_tune_off_never_asks_the_tuner(monkeypatch):
    def refuse(device):
        raise AssertionError("tuning is off")

    monkeypatch.setattr(tuning, "tuner_for", refuse)
    monkeypatch.delenv(tuning.TUNE_ENV, raising=False)
    torch._dynamo.reset()
    model = torch.nn.Linear(24, 8)
    x = torch.randn(5, 24)
    with torch.no_grad():
        assert_same(torch.compile(model, backend="meganeura")(x), model(x), rtol=1e-4, atol=1e-5)


def test_environment_turns_tuning_on_where_the_option_is_absent(monkeypatch):
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    assert tuning.tuning_enabled(None) and not tuning.tuning_enabled(False)
    monkeypatch.setenv(tuning.TUNE_ENV, "0")
    assert not tuning.tuning_enabled(None) and tuning.tuning_enabled(True)


def test_bad_tune_value_is_refused():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(Exception, match="tune"):
        torch.compile(model, backend="meganeura", options={"tune": "yes"})(torch.randn(2, 4))


def test_untuned_large_products_take_the_wide_tile_and_match_eager(monkeypatch):
    """Untuned, an output of at least 128 whole 128x256 tiles gets WIDE_TILE's kernel where the adapter's limits
    allow it (lavapipe: 1,024 invocations, 32 KiB of workgroup storage), K not a whole chunk; f64 reference, rtol
    1e-4 (positive operands: no cancellation)."""
    assert matmul_plans.wide_tile_suits(1, 2048, 2048, 20, get_device().limits)
    torch._dynamo.reset()
    built = []
    generate = matmul.matmul_kernel

    def recording(prelude, **kw):
        built.append((kw["tile"], kw["block"], kw.get("split", 1)))
        return generate(prelude, **kw)

    monkeypatch.setattr(matmul, "matmul_kernel", recording)
    x, w = torch.rand(2048, 20) + 0.25, torch.rand(20, 2048) + 0.25
    compiled = torch.compile(lambda a, b: a @ b, backend="meganeura", options={"tune": False})
    assert_same(compiled(x, w).double(), x.double() @ w.double(), rtol=1e-4, atol=1e-5)
    assert built == [(matmul_plans.WIDE_TILE, matmul_plans.WIDE_BLOCK, 1)]


def test_untuned_square_product_takes_the_quad_tile_and_matches_eager(monkeypatch):
    """Untuned, 1024x1024 @ 1024x1024 (256 whole 64x64 tiles, K no longer than an edge, which the rule would cut into
    8 slices) gets QUAD_TILE's kernel, quad staged in thread patches, its operands read as vec4s, unsplit; f64
    reference, rtol 1e-4 (positive operands: no cancellation)."""
    assert matmul_plans.quad_tile_suits(1, 1024, 1024, 1024, get_device().limits)
    torch._dynamo.reset()
    built = []
    generate = matmul.matmul_kernel

    def recording(prelude, **kw):
        built.append((kw["tile"], kw["block"], kw.get("split", 1), kw["quads"], kw["patches"], kw["vector_loads"]))
        return generate(prelude, **kw)

    monkeypatch.setattr(matmul, "matmul_kernel", recording)
    x, w = torch.rand(1024, 1024) + 0.25, torch.rand(1024, 1024) + 0.25
    compiled = torch.compile(lambda a, b: a @ b, backend="meganeura", options={"tune": False})
    assert_same(compiled(x, w).double(), x.double() @ w.double(), rtol=1e-4, atol=1e-5)
    assert built == [(matmul_plans.QUAD_TILE, matmul_plans.QUAD_BLOCK, 1, True, True, "ab")]
