"""Roles of a resident training step: their checkpoint keys, equality, and the cost of using them as dict keys
(each step looks its device arrays up by role thousands of times; bench/results/h200-issue34-ab.md)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_meganeura
from torch_meganeura.roles import Kind, Role


def test_keys_keep_the_checkpoint_format():
    assert Role.param("fc.weight").key == "param:fc.weight"
    assert Role.state("exp_avg", "fc.weight").key == "state:exp_avg:fc.weight"
    assert Role.batch(1).key == "batch:1" and Role.hyper().key == "hyper" and Role.loss().key == "loss"


def test_equal_fields_are_one_role():
    assert Role.param("w") is Role.param("w")
    direct = Role(Kind.PARAM, "w")  # not through a constructor: a distinct object, still the same key
    assert direct == Role.param("w") and hash(direct) == hash(Role.param("w"))
    assert {direct: 1}[Role.param("w")] == 1
    assert Role.param("w") != Role.grad("w") and Role.state("exp_avg", "w") != Role.state("exp_avg_sq", "w")


def test_a_step_finds_its_arrays_without_comparing_roles(monkeypatch):
    """Steady steps look roles up by identity: no ``Role.__eq__`` call. The generated equality and hash of the
    first Role type ran about 1,800 comparisons and 4,800 Enum hashes a step here, 2-7 ms a step on the H200."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(6)])
    step = torch_meganeura.compile_train_step(model, lambda m, x, y: F.mse_loss(m(x), y),
                                              torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    step(x, y)
    calls = []
    equal = Role.__eq__
    monkeypatch.setattr(Role, "__eq__", lambda self, other: calls.append(1) or equal(self, other))
    for _ in range(3):
        step(x, y)
    assert calls == []
