"""``python -m bench.generate``: text generation at SmolLM2-135M's shapes (random weights), greedy, one process.

    python -m bench.generate --out bench/results/h200-generate                 # 16-token prompt, 256 new tokens
    python -m bench.generate --out /tmp/generate-smoke --smoke                 # tiny model: checks the path

Rows: PyTorch eager HF ``generate`` with its default (dynamic) cache and with a static cache
(``disable_compile=True``: pure eager), on CUDA where it exists, else on the CPU; on CUDA, HF's static cache as HF
ships it (``generate`` compiles the forward with Inductor by itself) as a row of its own, with its first call's time;
every PyTorch row is warmed by a call of the length it is timed at; HF ``generate`` with ``model.forward`` compiled with
backend="meganeura", both caches, with the first call's time (compile included) and a second call's tokens/s and decode
tokens/s by context length; and the generation bundle (``torch_meganeura.export_lm``) run by the torch-free runtime,
with its export time, bundle size, load time, prefill and decode tokens/s, and decode tokens/s by context length (each
decode step's time at its position); then a bundle exported with ``batch_size=--batch`` generating for that many
prompts of different lengths together (the first the 16-token prompt, each next one a token shorter), its
tokens/s the aggregate over every prompt, and the ratio of that to the batch-1 bundle's. Every row's tokens are
compared with eager's default ``generate`` on the CPU in float32 (the batched row's, each prompt's with that prompt
alone): a row whose tokens differ is marked. Writes ``OUT.json`` and the markdown table ``OUT.md``.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results path without suffix: writes OUT.json and OUT.md")
    p.add_argument("--smoke", action="store_true", help="the workload's smoke-scale model (checks the path)")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--max-cache-len", type=int, default=1024, help="the bundle's cache (prompt and new tokens)")
    p.add_argument("--batch", type=int, default=8,
                   help="prompts that the batched bundle's row generates together (default 8; 1: no such row)")
    p.add_argument("--adapter", help="meganeura's adapter (index or name substring)")
    p.add_argument("--caches", default=",".join(CACHES),
                   help="HF caches of the eager and backend rows, comma-separated (HF's compiled row is always there)")
    return p


CACHES = ("dynamic", "static")
EAGER_CACHES = {  # cache label -> generate's arguments; every row is warmed with the call it then times
    "dynamic": {},
    "static": {"cache_implementation": "static", "disable_compile": True},  # pure eager: HF compiles it otherwise
}
# HF's static cache as HF ships it: on CUDA, generate compiles the forward with Inductor (CUDA graphs included) by
# itself; a row of its own, warmed at the timed length (a warm call at another length times a recompile)
HF_COMPILED_CACHE = {"hf-compiled-static": {"cache_implementation": "static"}}


def _eager_rows(model, prompt, new: int, device: str, caches=CACHES) -> list[dict]:
    """PyTorch's rows: eager with each cache, and on CUDA HF's auto-compiled static cache. Each is warmed by a
    call of the length it is timed at (the static cache's size, and the compiled graphs, depend on it)."""
    import torch

    rows = []
    model = model.to(device)
    ids = prompt.to(device)
    chosen = {c: kwargs for c, kwargs in EAGER_CACHES.items() if c in caches}
    for cache, kwargs in {**chosen, **(HF_COMPILED_CACHE if device == "cuda" else {})}.items():
        competitor = f"torch-{device}-{'hf-compiled' if cache in HF_COMPILED_CACHE else 'eager'}"
        seconds = []
        for _ in range(2):  # warm, then timed: the same call
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new, **kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        row = {"competitor": competitor, "cache": cache, "tokens_per_second": new / seconds[1],
               "seconds": seconds[1], "tokens": out[0].tolist()}
        if cache in HF_COMPILED_CACHE:
            row["first_call_seconds"] = seconds[0]
        rows.append(row)
        print(f"{competitor} {cache}: {new / seconds[1]:.1f} tokens/s", flush=True)
    model.to("cpu")
    return rows


def _backend_rows(model, prompt, new: int, caches=CACHES) -> list[dict]:
    """HF ``generate`` with ``forward`` compiled by the backend: the first call (compiling) and a second, timed."""
    import copy

    import torch

    rows = []
    for cache in caches:
        kwargs = {"cache_implementation": "static"} if cache == "static" else {}
        torch._dynamo.reset()
        compiled = copy.deepcopy(model)
        forward = torch.compile(compiled.forward, backend="meganeura")
        ends: list[float] = []

        def timed(*args, _forward=forward, _ends=ends, **kw):
            out = _forward(*args, **kw)  # returns once the device is done: the logits are read back
            _ends.append(time.perf_counter())
            return out

        compiled.forward = timed
        start = time.perf_counter()
        compiled.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
        first = time.perf_counter() - start
        ends.clear()
        start = time.perf_counter()
        out = compiled.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
        seconds = time.perf_counter() - start
        steps = [b - a for a, b in zip(ends, ends[1:])]  # decode steps: from one call's end to the next's
        by_context = {str(prompt.shape[1] + i + 1): 1.0 / t for i, t in enumerate(steps)}
        rows.append({"competitor": "meganeura-backend", "cache": cache, "first_call_seconds": first,
                     "seconds": seconds, "tokens_per_second": new / seconds,
                     "decode_tokens_per_second": len(steps) / sum(steps), "decode_by_context": by_context,
                     "tokens": out[0].tolist()})
        print(f"meganeura-backend {cache}: first generate {first:.1f} s, then {new / seconds:.1f} tokens/s", flush=True)
    return rows


def _bundle_row(model, prompts: list, new: int, max_cache_len: int, adapter) -> dict:
    """The generation bundle's row: batch 1 for one prompt, else a bundle of ``batch_size=len(prompts)`` generating
    for them together (tokens/s: the aggregate over the prompts; ``tokens``: a list per prompt)."""
    import torch_meganeura
    from meganeura.runtime import load

    batch = len(prompts)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lm"
        start = time.perf_counter()
        torch_meganeura.export_lm(model, path, max_cache_len=max_cache_len, batch_size=batch, adapter=adapter)
        exported = time.perf_counter()
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        lm = load(path, adapter=adapter)
        loaded = time.perf_counter()
        ids = [p[0].numpy() for p in prompts]
        request = ids if batch > 1 else ids[0]
        lm.generate(request, 4)  # warm: pipelines and bind groups over both cache arrays
        out = lm.generate(request, new, eos_token_id=[])  # every prompt makes ``new`` tokens
        stats = lm.stats
        length = max(len(i) for i in ids)
        by_context = {str(length + i + 1): batch / t for i, t in enumerate(stats.decode_steps)}
        row = {"competitor": "meganeura-bundle", "cache": "static", "batch": batch, "export_seconds": exported - start,
               "bundle_bytes": size, "load_seconds": loaded - exported, "seconds": stats.prefill_seconds
               + stats.decode_seconds, "tokens_per_second": stats.new_tokens / (stats.prefill_seconds
               + stats.decode_seconds), "prefill_tokens_per_second": stats.prefill_tokens_per_second,
               "decode_tokens_per_second": stats.decode_tokens_per_second, "decode_by_context": by_context,
               "tokens": [o.tolist() for o in out] if batch > 1 else out.tolist(), "adapter": lm.device.describe()}
        lm.release()
    return row


def _prompts(vocab: int, prompt_tokens: int, batch: int) -> list:
    """``batch`` prompts of different lengths: ``prompt_tokens``, then a token fewer each (at least one)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (1, max(1, prompt_tokens - k)), generator=generator) for k in range(batch)]


def markdown(result: dict) -> str:
    lines = [f"# Generation at {result['description']}", "",
             f"{result['machine']}; greedy, prompt {result['prompt_tokens']} tokens, "
             f"{result['new_tokens']} new tokens; "
             "tokens/s over the whole generate call (prefill included) unless a column says otherwise.", "",
             "| competitor | cache | batch | tokens/s | prefill tok/s | decode tok/s | tokens equal eager | "
             "first call s | load s | export s | bundle MiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        f = lambda key, fmt: format(r[key], fmt) if key in r else "-"  # noqa: E731
        size = f"{r['bundle_bytes'] / (1 << 20):.1f}" if "bundle_bytes" in r else "-"
        lines.append(f"| {r['competitor']} | {r['cache']} | {r['batch']} | {r['tokens_per_second']:.1f} | "
                     f"{f('prefill_tokens_per_second', '.1f')} | {f('decode_tokens_per_second', '.1f')} | "
                     f"{'yes' if r['equal'] else 'NO'} | {f('first_call_seconds', '.1f')} | "
                     f"{f('load_seconds', '.2f')} | {f('export_seconds', '.1f')} | {size} |")
    if "batch_speedup" in result:
        lines += ["", f"The bundle at batch {result['batch']}: {result['batch_speedup']:.2f}x batch 1's aggregate "
                  "tokens/s (tokens/s counts every prompt's new tokens)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from .workloads import WORKLOADS

    torch.manual_seed(0)
    workload = WORKLOADS["smollm2"]
    model = workload.build(args.smoke).eval()
    vocab = model.config.vocab_size
    prompts = _prompts(vocab, args.prompt_tokens, max(args.batch, 1))
    prompt = prompts[0]
    new = min(args.new_tokens, args.max_cache_len - args.prompt_tokens)
    with torch.no_grad():
        alone = [model.generate(p, max_new_tokens=new, min_new_tokens=new, do_sample=False)[0].tolist()
                 for p in prompts]
        reference = alone[0]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        caches = [c for c in args.caches.split(",") if c]
        rows = _eager_rows(model, prompt, new, device, caches)
        rows += _backend_rows(model, prompt, new, caches)
    for row in rows:
        row["batch"] = 1
    rows.append(_bundle_row(model, [prompt], new, args.max_cache_len, args.adapter))
    if args.batch > 1:
        rows.append(_bundle_row(model, prompts, new, args.max_cache_len, args.adapter))
    for row in rows:
        row["equal"] = row.pop("tokens") == (alone if row["batch"] > 1 else reference)
        print(f"{row['competitor']:18s} {row['cache']:8s} batch {row['batch']} "
              f"{row['tokens_per_second']:9.1f} tokens/s  {'tokens equal eager' if row['equal'] else 'TOKENS DIFFER'}",
              flush=True)
    machine = (f"{torch.cuda.get_device_name()} (CUDA) beside {rows[-1]['adapter']}" if device == "cuda"
               else rows[-1]["adapter"])
    description = "SmolLM2-135M's config (HF Llama, random weights)" + (", smoke scale" if args.smoke else "")
    result = {"description": description, "machine": machine, "torch": torch.__version__,
              "prompt_tokens": args.prompt_tokens, "new_tokens": new, "smoke": args.smoke, "rows": rows}
    if args.batch > 1:
        result["batch"] = args.batch
        result["batch_speedup"] = rows[-1]["tokens_per_second"] / rows[-2]["tokens_per_second"]
        print(f"bundle batch {args.batch}: {result['batch_speedup']:.2f}x batch 1's aggregate tokens/s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {out}.json and {out}.md", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
