"""The backend's entry point and option validation."""
import os
import subprocess
import sys

import pytest
import torch

from torch_meganeura import meganeura_backend

PROBE = """
import sys
import torch
import torch._dynamo
names = torch._dynamo.list_backends()
loaded = sorted(m for m in sys.modules if m.startswith("torch_meganeura") or m.startswith("meganeura"))
print("meganeura" in names, loaded)
"""


def test_listed_without_import():
    """A fresh interpreter that never imports torch_meganeura lists "meganeura" (entry point registration)."""
    env = dict(os.environ, XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR", "/tmp"))
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120,
                          cwd="/")
    assert done.returncode == 0, done.stderr
    listed, loaded = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert listed == "True", done.stdout
    assert loaded == "[]", f"listing backends imported {loaded}"


def _compile_and_call(options):
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1, backend="meganeura", options=options)
    return f(torch.randn(3))


def test_unknown_option_names_valid_ones():
    with pytest.raises(Exception) as info:
        _compile_and_call({"fallbak": "error"})
    text = str(info.value)
    assert "fallbak" in text
    for name in ("adapter", "fallback"):
        assert name in text
    # torch may wrap the backend's exception; the ValueError must be in the chain
    assert _in_chain(info.value, ValueError)


def test_bad_fallback_policy():
    with pytest.raises(Exception) as info:
        _compile_and_call({"fallback": "bogus"})
    assert "bogus" in str(info.value) and "warn" in str(info.value) and "error" in str(info.value)
    assert _in_chain(info.value, ValueError)


def test_direct_call_validates():
    """The backend function itself validates before any tracing."""
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    with pytest.raises(ValueError,
                       match=r"valid options are \['adapter', 'fallback', 'precision', 'profile', 'tune'\]"):
        meganeura_backend(gm, [torch.randn(2)], options={"nope": 1})
    with pytest.raises(ValueError, match="bogus"):
        meganeura_backend(gm, [torch.randn(2)], options={"fallback": "bogus"})


def _in_chain(exc, kind) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
