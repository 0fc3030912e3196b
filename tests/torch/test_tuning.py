"""The ``tune`` option: plans take the tuner's matmul variants (checked against eager with variants forced), and a
bad option value is refused."""
import pytest
import torch

from conftest import assert_same
from meganeura.kernels import matmul
from meganeura.kernels.matmul import MatmulChoice
import torch_meganeura.tuning as tuning


class ForcingTuner:
    """Stands in for MatmulTuner: forces one variant and records the problems it was asked about."""
    fingerprint = "forced-for-test"

    def __init__(self, choice):
        self.choice, self.asked = choice, []

    def choose_all(self, problems):
        self.asked.extend(problems)
        return [self.choice for _ in problems]


@pytest.mark.parametrize("choice", [MatmulChoice((16, 32), (4, 4), 2), MatmulChoice((32, 16), (8, 4), 1)])
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
        built.append((kw["tile"], kw["block"], kw.get("split", 1)))
        return generate(prelude, **kw)

    monkeypatch.setattr(matmul, "matmul_kernel", recording)
    compiled = torch.compile(model, backend="meganeura", options={"tune": True})
    with torch.no_grad():
        assert_same(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    assert sorted(tuner.asked) == [(1, 50, 40, 72, "p", "p", False), (1, 50, 72, 96, "p", "p", False)]  # once each
    assert built and all(b == (choice.tile, choice.block, choice.split) for b in built)


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
