"""Test settings and fixtures only. Helpers shared by test modules live in tests/helpers (``from helpers.compare
import check_against_eager``): pytest puts this folder on ``sys.path`` because tests/ has no ``__init__.py``.
"""
from __future__ import annotations

import gc
import logging
import os
import sys

os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # silences the Vulkan loader's warning; before wgpu loads
os.environ["MEGANEURA_CACHE_DIR"] = "off"  # every test compiles (tests of the plan cache turn it on for themselves)

import pytest
import torch

# torch's structured trace log is always at DEBUG and pytest captures it: thousands of empty lines in failure
# reports. Raising its level turns the records off (torch only writes them for TORCH_TRACE, not set here).
logging.getLogger("torch.__trace").setLevel(logging.WARNING)


FULL_COLLECTION_EVERY = 50  # tests; a frozen object that dies in a reference cycle is reclaimed only by these
_tests_since_full_collection = 0


@pytest.fixture(autouse=True)
def _no_gc_during_test():
    """Garbage collection frees device copies of dead tensors (weakref callbacks) at arbitrary points;
    collect before each test and pause it during, so tests that assert on device counters are exact. What
    survives the collection is frozen out of the collector: the next test's collection scans only what this test
    made. A full collection of everything (torch, transformers and OpInfo's database are ~500,000 objects, and
    dynamo's caches of earlier tests' compiled functions grow) took 0.3-0.6 s a test: half of the suite's time on
    the 2-core machine."""
    global _tests_since_full_collection
    _tests_since_full_collection += 1
    if _tests_since_full_collection >= FULL_COLLECTION_EVERY:  # frozen objects that died since: reclaimed
        _tests_since_full_collection = 0
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    gc.disable()
    yield
    gc.enable()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield



@pytest.fixture(autouse=True)
def _runs_in_flight_read_by_their_test():
    """A run's status is read at the next wait (``meganeura.runtime.in_flight``): wait at the end of each test, so
    that an error a test's runs set is raised in that test, not in the next one to wait."""
    yield
    runtime_device = sys.modules.get("meganeura.runtime.device")
    for device in list(getattr(runtime_device, "_devices", {}).values()):
        if device.in_flight and not device.lost:
            device.synchronize()
