"""tests/bench imports the ``bench`` package from the checkout's root. The root goes last on sys.path, after
site-packages: its kernels/, lowering/ and runtime/ folders (installed as meganeura.*) must not shadow PyPI packages
of those names (transformers >= 5.2x imports Hugging Face's ``kernels``). The ``null_device`` fixture serves the
host-work tests: the process's devices replaced by the recording device, then restored."""
import os
import sys

import pytest
import torch

from helpers.recording_device import RecordingDevice

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)


@pytest.fixture(scope="module")
def null_device():
    """The process's devices replaced by one null device for the test, then restored (dynamo's graphs and the
    backend's plans, made for it, are dropped either way)."""
    import meganeura.runtime.device as runtime_device

    real = runtime_device.get_device()  # (its limits and features: the plans are those it would run)
    saved = dict(runtime_device._devices)
    null = RecordingDevice(limits=real.limits, features=real.features, name="null device")
    for key in saved:
        runtime_device._devices[key] = null
    torch._dynamo.reset()
    try:
        yield null
    finally:
        torch._dynamo.reset()
        runtime_device._devices.clear()
        runtime_device._devices.update(saved)
