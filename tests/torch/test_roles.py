"""Roles of a resident training step: their checkpoint keys, equality, and the cost of using them as dict keys
(each step looks its device arrays up by role thousands of times; bench/results/h200-issue34-ab.md)."""
import copy
import pickle
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_meganeura
from torch_meganeura.training import roles
from torch_meganeura.training.roles import Kind, Role


def test_keys_keep_the_checkpoint_format():
    assert Role.param("fc.weight").key == "param:fc.weight"
    assert Role.state("exp_avg", "fc.weight").key == "state:exp_avg:fc.weight"
    assert Role.batch(1).key == "batch:1" and Role.hyper().key == "hyper" and Role.loss().key == "loss"


def test_equal_fields_are_one_role():
    assert Role.param("w") is Role.param("w") and Role(Kind.PARAM, "w") is Role.param("w")
    assert copy.deepcopy(Role.param("w")) is Role.param("w")
    assert pickle.loads(pickle.dumps(Role.state("exp_avg", "w"))) is Role.state("exp_avg", "w")
    assert Role.param("w") != Role.grad("w") and Role.state("exp_avg", "w") != Role.state("exp_avg_sq", "w")
    with pytest.raises(AttributeError, match="immutable"):
        Role.param("w").name = "v"


def test_a_step_runs_no_python_of_roles():
    """Steady steps hash and compare roles in C: no function of roles.py runs. The first Role type's generated
    equality and hash ran about 1,800 comparisons and 4,800 Enum hashes a step here, 2-7 ms a step on the H200; its
    hash of a cached tuple still ran ~6,600 times a step, ~1 ms."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(6)])
    step = torch_meganeura.compile_train_step(model, lambda m, x, y: F.mse_loss(m(x), y),
                                              torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    step(x, y)
    calls = []

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == roles.__file__:
            calls.append(frame.f_code.co_name)

    sys.setprofile(count)
    try:
        for _ in range(3):
            step(x, y)
    finally:
        sys.setprofile(None)
    assert calls == []
