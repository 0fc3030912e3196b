"""``python -m bench.decode_profile``: where a generation bundle's decode token goes, per plan kind and dtype.

    python -m bench.decode_profile --out bench/results/h100-decode-profile          # SmolLM2-135M's config
    python -m bench.decode_profile --out /tmp/decode-profile --smoke                # tiny model: checks the path

For each dtype of ``--dtypes`` and each plan kind (``portable``: kernels for WebGPU's default limits, what
``export_lm`` writes by default; ``adapter``: ``portable=False``, the adapter's own limits), the model (random
weights, ``bench.generate``'s configs) is exported, loaded and warmed, then:
- ``wall_ms``: the median decode step of a ``generate`` of ``--new-tokens`` (wall time, as ``GenerationStats``
  counts it: with run-ahead decoding, the host's share of the steps read together);
- the profiler's view of ``PROFILED_STEPS`` decode steps (``meganeura.runtime.profiler``: every dispatch in a pass
  of its own between two timestamps): ``gpu_ms``, the sum of the dispatches' GPU times per step; ``span_ms``, from
  the first dispatch's start to the last one's end (the passes add their own gaps, so the span is an upper bound of
  the unprofiled step's GPU time); the dispatches per step; and the names with the most GPU time per step.
Rows ``backend-static`` and ``backend-dynamic`` (``--plans``) profile HF ``generate`` itself with the model's forward
compiled by the backend (HF's static cache, or its default cache), each call of ``PROFILED_STEPS + 1`` new tokens (a
static cache is as long as the prompt and the new tokens: one length, one compile); their ``wall_ms`` is a decode
step's median wall time, from one forward's end to the next's (HF's own Python included), and their profiled steps
are every run of the backend's plans after the prefill's, one a token where the forward is one graph.
Wall time well above the span says the host bounds the step; a span well above the summed kernels, the gaps between
dispatches; kernel time near the span, the kernels. A small kernel alone in a timestamped pass also takes longer than
among its neighbours: on an H100 the summed kernels of a SmolLM2 step (2.49 ms) exceeded the unprofiled step's wall
time (1.75 ms), so compare rows with each other, and profiled times with wall times only as bounds. Writes
``OUT.json`` and the table ``OUT.md``; the device must offer timestamp queries.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

PROFILED_STEPS = 16  # decode steps under the profiler: enough for a stable median, few enough to stay quick
TOP_KERNELS = 8  # names listed per row, by GPU time per step
PROMPT_TOKENS = 16
PLAN_KINDS = {"portable": True, "adapter": False}  # row label -> export_lm's ``portable``
BACKEND_CACHES = {"backend-static": {"cache_implementation": "static"}, "backend-dynamic": {}}  # row -> generate's


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.decode_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results path without suffix: writes OUT.json and OUT.md")
    p.add_argument("--smoke", action="store_true", help="the model's smoke-scale config (checks the path)")
    p.add_argument("--model", default="smollm2", help="a model of bench.generate's (--model there)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="dtypes to export the model in, comma-separated")
    p.add_argument("--plans", default=",".join(PLAN_KINDS),
                   help=f"plan kinds of {', '.join(PLAN_KINDS)}, or HF generate through the backend: "
                        f"{', '.join(BACKEND_CACHES)}")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens of the timed generate")
    p.add_argument("--max-cache-len", type=int, default=256)
    return p


def profile_row(model, plans: str, new_tokens: int, max_cache_len: int) -> dict:
    """Export ``model`` with ``plans``' limits, load it, and time and profile its decode steps."""
    import numpy as np
    import torch_meganeura
    from meganeura.runtime import load
    from meganeura.runtime.profiler import profile

    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, PROMPT_TOKENS)
    with tempfile.TemporaryDirectory() as tmp:
        torch_meganeura.export_lm(model, Path(tmp) / "lm", max_cache_len=max_cache_len,
                                  portable=PLAN_KINDS[plans])
        lm = load(Path(tmp) / "lm")
        try:
            lm.generate(prompt, new_tokens, eos_token_id=[])  # warm at the timed length
            lm.generate(prompt, new_tokens, eos_token_id=[])
            wall_ms = statistics.median(lm.stats.decode_steps) * 1e3
            with profile(lm.device) as profiler:
                lm.generate(prompt, PROFILED_STEPS + 1, eos_token_id=[])
            events = profiler.events
            device = lm.device.describe()
        finally:
            lm.release()
    return {"plans": plans, "wall_ms": wall_ms, "device": device, **_decode_runs(events)}


def backend_row(model, plans: str) -> dict:
    """HF ``generate`` of ``model`` with its forward compiled by the backend (``BACKEND_CACHES[plans]``): warmed,
    timed (a decode step from one forward's end to the next's), then profiled, each of ``PROFILED_STEPS + 1`` new
    tokens."""
    import copy

    import torch
    import torch_meganeura

    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = copy.deepcopy(model)
    forward = torch.compile(compiled.forward, backend="meganeura")
    ends: list[float] = []

    def timed(*args, **kwargs):
        out = forward(*args, **kwargs)
        ends.append(time.perf_counter())
        return out

    def generate():
        with torch.no_grad():
            compiled.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=PROFILED_STEPS + 1,
                              min_new_tokens=PROFILED_STEPS + 1, do_sample=False, **BACKEND_CACHES[plans])

    compiled.forward = timed
    generate()  # compiles the prefill's and the decode step's graphs
    generate()  # and, with the default cache, the decode graph past its first bounds
    ends.clear()
    generate()
    wall_ms = statistics.median(b - a for a, b in zip(ends[1:], ends[2:])) * 1e3  # (after the first decode step)
    with torch_meganeura.profile() as profiler:
        generate()
    return {"plans": plans, "wall_ms": wall_ms, "device": profiler.device.describe(),
            **_decode_runs(profiler.events)}


def _decode_runs(events: list[dict]) -> dict:
    """The profiled runs after the first (the prefill's): GPU time, span and dispatches per step, top names."""
    runs: dict[int, list[dict]] = {}
    for e in events:
        runs.setdefault(e["run"], []).append(e)
    steps = [runs[r] for r in sorted(runs)[1:]]
    gpu = [sum(e["duration_ns"] for e in step) / 1e6 for step in steps]
    span = [(max(e["start_ns"] + e["duration_ns"] for e in step) - min(e["start_ns"] for e in step)) / 1e6
            for step in steps]
    per_name: dict[str, float] = {}
    for step in steps:
        for e in step:
            per_name[e["name"]] = per_name.get(e["name"], 0.0) + e["duration_ns"] / 1e3 / len(steps)
    top = sorted(per_name.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    return {"steps": len(steps), "dispatches": len(steps[0]), "gpu_ms": statistics.median(gpu),
            "span_ms": statistics.median(span), "top_us": [[name, round(us, 1)] for name, us in top]}


def markdown(result: dict) -> str:
    lines = [f"# Where a decode token goes: {result['description']}", "",
             f"{result['device']}; {PROMPT_TOKENS}-token prompt; wall: median decode step of {result['new_tokens']} "
             f"new tokens; GPU and span: medians of {PROFILED_STEPS} profiled steps (bench/decode_profile.py).", "",
             "| dtype | plans | dispatches | wall ms | span ms | GPU ms (kernels) | top kernels: us per step |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        top = "; ".join(f"{name} {us:.1f}" for name, us in r["top_us"])
        lines.append(f"| {r['dtype']} | {r['plans']} | {r['dispatches']} | {r['wall_ms']:.3f} | {r['span_ms']:.3f} "
                     f"| {r['gpu_ms']:.3f} | {top} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from .generate import MODELS

    name, build = MODELS[args.model]
    torch.manual_seed(0)
    base = build(args.smoke).eval()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"description": name + (" (smoke scale)" if args.smoke else ""), "device": "",
              "new_tokens": args.new_tokens, "max_cache_len": args.max_cache_len, "rows": []}
    for dtype in [d for d in args.dtypes.split(",") if d]:
        model = base.to(getattr(torch, dtype))
        for plans in [p for p in args.plans.split(",") if p]:
            row = {"dtype": dtype, **(backend_row(model, plans) if plans in BACKEND_CACHES else
                                       profile_row(model, plans, args.new_tokens, args.max_cache_len))}
            result["rows"].append(row)
            result["device"] = row["device"]
            print(f"{dtype:8s} {plans:8s} {row['dispatches']} dispatches: wall {row['wall_ms']:.3f} ms, span "
                  f"{row['span_ms']:.3f} ms, kernels {row['gpu_ms']:.3f} ms per step", flush=True)
            out.with_suffix(".json").write_text(json.dumps(result, indent=1))  # after each row: a run cut short
            out.with_suffix(".md").write_text(markdown(result))  # keeps what it finished
    print(f"wrote {out}.json and {out}.md", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
