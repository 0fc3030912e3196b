"""Dynamo's guards of a decode step alone, with HF ``generate`` through the backend on the null device.

    python -m bench.guard_check --caches default,static-one-length [--smoke]

The model and the calls are ``bench.decode_breakdown``'s (SmolLM2's config, a 16-token prompt, greedy). After warm
calls (8, 40, 8 and 40 new tokens), a ``generate(8)`` stops at its first decode step (one new token) and, before
running it, finds the graph of the forward's frame whose guards pass on that call's frame locals (HF's wrapper's
``args`` and ``kwargs`` and its closure), and times its guard check (``guard_manager.check``) in a loop: CPU
microseconds a check, the minimum and median over ``BATCHES`` batches of ``CHECKS``. The whole token's time with and
without guards (``decode_breakdown --guard-rounds``) moves with the load by more than the guards take; this does not.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from .decode_breakdown import CACHES
from .host import HOST_THREADS
from .memory import use_null_device
from .workloads import WORKLOADS

BATCHES, CHECKS = 15, 100
WARM = (8, 40, 8, 40)  # new tokens of the warm calls (``decode_breakdown``'s)


def frame_locals(model, args: tuple, kwargs: dict) -> dict:
    """What dynamo's guards read at a call of the model's forward: its wrapper's arguments and closure."""
    fn = type(model).forward
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    return {"args": (model, *args), "kwargs": kwargs, **cells}


def time_check(model, args: tuple, kwargs: dict) -> dict:
    """The guard check of the graph that serves this call, timed in a loop."""
    f_locals = frame_locals(model, args, kwargs)
    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(type(model).forward.__code__)
    checks = [e.guard_manager.check(f_locals) for e in entries]
    manager = entries[checks.index(True)].guard_manager
    times = []
    for _ in range(BATCHES):
        start = time.thread_time()
        for _ in range(CHECKS):
            manager.check(f_locals)
        times.append((time.thread_time() - start) / CHECKS * 1e6)
    return {"entries_passing": checks, "python_guards": str(manager).count("LAMBDA_GUARD"),
            "check_us_min": min(times), "check_us_median": statistics.median(times)}


def measure(cache: str, smoke: bool) -> dict:
    torch.manual_seed(0)
    model = WORKLOADS["smollm2"].build(smoke).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 16))
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend="meganeura")
    found = {}

    def forward(*args, **kwargs):
        if found.get("wanted") and kwargs["input_ids"].shape[1] == 1:
            found.update(time_check(model, args, kwargs), wanted=False)
        return compiled(*args, **kwargs)

    def generate(n: int) -> None:
        with torch.no_grad():
            model.forward = forward
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, **CACHES[cache])

    for n in WARM:
        generate(n)
    found["wanted"] = True
    generate(WARM[0])
    del found["wanted"]
    return {"cache": cache, **found, "load_average": list(os.getloadavg())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.guard_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--caches", default="default,static-one-length", help=f"comma-separated, from {', '.join(CACHES)}")
    p.add_argument("--smoke", action="store_true", help="the model at smoke scale")
    args = p.parse_args(argv)
    use_null_device()
    torch.set_num_threads(HOST_THREADS)
    for cache in args.caches.split(","):
        print(measure(cache, args.smoke), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
