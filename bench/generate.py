"""``python -m bench.generate``: text generation at SmolLM2-135M's or Llama-3.2-1B's shapes (random weights), greedy,
one process.

    python -m bench.generate --out bench/results/h200-generate                 # 16-token prompt, 256 new tokens
    python -m bench.generate --out /tmp/generate-smoke --smoke                 # tiny model: checks the path
    python -m bench.generate --out OUT --model llama-3.2-1b --dtype bfloat16 --rows hf-compiled,bundle --batch 1
    python -m bench.generate --out OUT --rows bundle --new-tokens 2032 --max-cache-len 2048 --compare-tokens 64
    python -m bench.generate --out OUT --rows bundle --batch 1,2,4,8 --new-tokens 64   # tokens/s against batch

Rows (``--rows``): PyTorch eager HF ``generate`` with its default (dynamic) cache and with a static cache
(``disable_compile=True``: pure eager), on CUDA where it exists, else on the CPU; on CUDA, HF's static cache as HF
ships it (``generate`` compiles the forward with Inductor by itself) as a row of its own, with its first call's time;
every PyTorch row is warmed by a call of the length it is timed at; HF ``generate`` with ``model.forward`` compiled with
backend="meganeura", both caches, with the first call's time (compile included) and a second call's tokens/s and decode
tokens/s by context length; and the generation bundle (``torch_meganeura.export_lm``) run by the torch-free runtime,
with its export time, bundle size, load time, prefill and decode tokens/s, and decode tokens/s by context length (each
decode step's time at its position); with ``--half-bundle`` a bundle exported from the model in bfloat16 beside it,
and the ratio of their tokens/s; then, for each batch size of ``--batch`` above 1 (one size, 8 by default, or
several: ``--batch 1,2,4,8``, where 1 is the batch-1 bundle's row), a bundle exported with that ``batch_size``
generating for that many prompts of different lengths together (the first the 16-token prompt, each next one a
token shorter), its tokens/s the aggregate over every prompt, and the ratio of that to the batch-1 bundle's. Every
row's tokens are compared with eager's default ``generate`` on the CPU in the model's dtype (the bfloat16 bundle's
with eager's in bfloat16; a batched row's, each prompt's with that prompt alone; ``--compare-tokens``: the first so
many new tokens): a row whose tokens differ is marked. Writes ``OUT.json``, the markdown table ``OUT.md`` (with the
bundle's tokens/s by batch size where a batched row ran, and decode tokens/s by bands of context length),
``OUT.png`` (decode tokens/s against context length) and, where a batched row ran, ``OUT-batch.png`` (the bundle's
aggregate tokens/s against batch size); the JSON and the table after each group of rows as well, so that a run cut
short keeps the rows it finished.
"""
from __future__ import annotations

import argparse
import copy
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
    p.add_argument("--batch", type=_batch_sizes, default=(8,),
                   help="prompts that a batched bundle's row generates together, or several sizes comma-separated "
                        "(1,2,4,8: a row each, and OUT-batch.png); default 8; 1 is the batch-1 bundle's row")
    p.add_argument("--adapter", help="meganeura's adapter (index or name substring)")
    p.add_argument("--caches", default=",".join(CACHES),
                   help="HF caches of the eager and backend rows, comma-separated (HF's compiled row is always there)")
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="the model's config (random weights)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's dtype, every row")
    p.add_argument("--rows", default=",".join(ROWS),
                   help=f"rows to run, comma-separated, of {', '.join(ROWS)} (the batched bundle's row: --batch)")
    p.add_argument("--half-bundle", action="store_true",
                   help="also a batch-1 bundle exported from the model in bfloat16 (a float32 --dtype)")
    p.add_argument("--bundle-synchronous", action="store_true",
                   help="also the batch-1 bundle reading each decode step's tokens before submitting the next "
                        "(run_ahead = 1, as before run-ahead decoding), on the same loaded bundle")
    p.add_argument("--compare-tokens", type=int,
                   help="compare the first this many tokens with eager's (default: all; eager's reference on the "
                        "CPU is slow for long runs)")
    return p


def _batch_sizes(text: str) -> tuple[int, ...]:
    """``--batch``: one size or several, comma-separated, each at least 1; sorted, without repeats."""
    try:
        sizes = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"not whole numbers: {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes are at least 1: {text!r}")
    return tuple(sorted(sizes))


CACHES = ("dynamic", "static")
EAGER_CACHES = {  # cache label -> generate's arguments; every row is warmed with the call it then times
    "dynamic": {},
    "static": {"cache_implementation": "static", "disable_compile": True},  # pure eager: HF compiles it otherwise
}
# HF's static cache as HF ships it: on CUDA, generate compiles the forward with Inductor (CUDA graphs included) by
# itself; a row of its own, warmed at the timed length (a warm call at another length times a recompile)
HF_COMPILED_CACHE = {"hf-compiled-static": {"cache_implementation": "static"}}


# Row groups (``--rows``): PyTorch eager with the caches of ``--caches``, HF's auto-compiled static cache (CUDA only),
# HF generate through the backend, the torch-free bundle.
ROWS = ("eager", "hf-compiled", "backend", "bundle")


def _llama_1b(smoke: bool):
    """Llama-3.2-1B's config (random weights): hidden 2048, 16 layers, 32 heads of 64, 8 KV heads, vocabulary
    128,256, tied embeddings; at smoke scale the same proportions, tiny."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if smoke:
        return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                            num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                            max_position_embeddings=256, tie_word_embeddings=True))
    return LlamaForCausalLM(LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                        head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
                                        rms_norm_eps=1e-5, tie_word_embeddings=True))


def _smollm2(smoke: bool):
    from .workloads import WORKLOADS

    return WORKLOADS["smollm2"].build(smoke)


MODELS = {"smollm2": ("SmolLM2-135M's config", _smollm2), "llama-3.2-1b": ("Llama-3.2-1B's config", _llama_1b)}


def _eager_rows(model, prompt, new: int, device: str, caches=CACHES, compiled: bool = True) -> list[dict]:
    """PyTorch's rows: eager with each cache, and on CUDA HF's auto-compiled static cache. Each is warmed by a
    call of the length it is timed at (the static cache's size, and the compiled graphs, depend on it)."""
    import torch

    rows = []
    model = model.to(device)
    ids = prompt.to(device)
    chosen = {c: kwargs for c, kwargs in EAGER_CACHES.items() if c in caches}
    for cache, kwargs in {**chosen, **(HF_COMPILED_CACHE if device == "cuda" and compiled else {})}.items():
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


def _bundle_row(model, prompts: list, new: int, max_cache_len: int, adapter, synchronous: bool = False) -> list:
    """The generation bundle's row: batch 1 for one prompt, else a bundle of ``batch_size=len(prompts)`` generating
    for them together (tokens/s: the aggregate over the prompts; ``tokens``: a list per prompt). ``synchronous``:
    also the same bundle reading each decode step's tokens before it submits the next (``run_ahead = 1``)."""
    import torch_meganeura
    from meganeura.runtime import load

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lm"
        start = time.perf_counter()
        torch_meganeura.export_lm(model, path, max_cache_len=max_cache_len, batch_size=len(prompts), adapter=adapter)
        exported = time.perf_counter()
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        lm = load(path, adapter=adapter)
        loaded = time.perf_counter()
        rows = [{"competitor": "meganeura-bundle", "export_seconds": exported - start, "bundle_bytes": size,
                 "load_seconds": loaded - exported, **_bundle_timing(lm, prompts, new)}]
        if synchronous:
            lm.run_ahead = 1
            rows.append({"competitor": "meganeura-bundle-synchronous", **_bundle_timing(lm, prompts, new)})
        lm.release()
    return rows


def _bundle_timing(lm, prompts: list, new: int) -> dict:
    """A loaded bundle's timed ``generate`` of ``new`` tokens for ``prompts`` (warmed first): tokens/s, and the
    tokens."""
    batch = len(prompts)
    ids = [p[0].numpy() for p in prompts]
    request = ids if batch > 1 else ids[0]
    lm.generate(request, 4)  # warm: pipelines and bind groups over both cache arrays
    out = lm.generate(request, new, eos_token_id=[])  # every prompt makes ``new`` tokens
    stats = lm.stats
    length = max(len(i) for i in ids)
    by_context = {str(length + i + 1): batch / t for i, t in enumerate(stats.decode_steps)}
    return {"cache": "static", "batch": batch, "seconds": stats.prefill_seconds + stats.decode_seconds,
            "tokens_per_second": stats.new_tokens / (stats.prefill_seconds + stats.decode_seconds),
            "prefill_tokens_per_second": stats.prefill_tokens_per_second,
            "decode_tokens_per_second": stats.decode_tokens_per_second, "decode_by_context": by_context,
            "tokens": [o.tolist() for o in out] if batch > 1 else out.tolist(), "adapter": lm.device.describe()}


def _prompts(vocab: int, prompt_tokens: int, batch: int) -> list:
    """``batch`` prompts of different lengths: ``prompt_tokens``, then a token fewer each (at least one)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (1, max(1, prompt_tokens - k)), generator=generator) for k in range(batch)]


def markdown(result: dict, name: str) -> str:
    """The results as a markdown table, then the tables by batch and by context length; ``name``: the results'
    path without suffix, whose plots the text names."""
    compared = result.get("compared_tokens", result["new_tokens"])
    lines = [f"# Generation at {result['description']}", "",
             f"{result['machine']}; greedy, prompt {result['prompt_tokens']} tokens, "
             f"{result['new_tokens']} new tokens; "
             "tokens/s over the whole generate call (prefill included) unless a column says otherwise"
             + (f"; tokens compared with eager's over the first {compared} new tokens." if compared <
                result["new_tokens"] else "."), "",
             "| competitor | cache | batch | dtype | tokens/s | prefill tok/s | decode tok/s | tokens equal eager "
             "(new tokens before the first that differs) | "
             "first call s | load s | export s | bundle MiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        f = lambda key, fmt: format(r[key], fmt) if key in r else "-"  # noqa: E731
        size = f"{r['bundle_bytes'] / (1 << 20):.1f}" if "bundle_bytes" in r else "-"
        lines.append(f"| {r['competitor']} | {r['cache']} | {r['batch']} | {r.get('dtype', 'float32')} | "
                     f"{r['tokens_per_second']:.1f} | "
                     f"{f('prefill_tokens_per_second', '.1f')} | {f('decode_tokens_per_second', '.1f')} | "
                     f"{'yes' if r['equal'] else 'NO'} ({r.get('agreeing_tokens', '-')}) | "
                     f"{f('first_call_seconds', '.1f')} | "
                     f"{f('load_seconds', '.2f')} | {f('export_seconds', '.1f')} | {size} |")
    if "batch_speedups" in result:
        lines += _batch_table(result, f"{name}-batch.png")
    if "bfloat16_speedup" in result:
        lines += ["", f"The bundle exported in bfloat16: {result['bfloat16_speedup']:.2f}x the float32 bundle's "
                  "tokens/s."]
    if "run_ahead_speedup" in result:
        lines += ["", f"The bundle's decode steps run ahead of the reads of their tokens: "
                  f"{result['run_ahead_speedup']:.2f}x its tokens/s reading each step before the next."]
    by_context = [r for r in result["rows"] if r.get("decode_by_context")]
    if by_context:
        lines += ["", f"Decode tokens/s by context length (medians of the steps in each band; `{name}.png` shows "
                  "every step):", "", "| row | " + " | ".join(CONTEXT_BANDS_LABELS) + " |",
                  "|---|" + "---|" * len(CONTEXT_BANDS)]
        for r in by_context:
            cells = [f"{m:.1f}" if m else "-" for m in _band_medians(r["decode_by_context"])]
            lines.append(f"| {_label(r)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _batch_table(result: dict, plot: str) -> list[str]:
    """The bundle's aggregate tokens/s by batch size (batch 1: the batch-1 bundle's row), each over batch 1's."""
    lines = ["", "The bundle by batch size (tokens/s counts every prompt's new tokens; batch 1 is the batch-1 "
             f"bundle's row; plotted in `{plot}`):", "",
             "| batch | tokens/s | decode tok/s | x batch 1 | tokens equal eager |", "|---|---|---|---|---|"]
    for batch, r in _by_batch(result):
        speedup = result["batch_speedups"].get(str(batch), 1.0)
        lines.append(f"| {batch} | {r['tokens_per_second']:.1f} | {r['decode_tokens_per_second']:.1f} | "
                     f"{speedup:.2f}x | {'yes' if r['equal'] else 'NO'} |")
    return lines


def _by_batch(result: dict) -> list[tuple[int, dict]]:
    """The bundle's rows in the model's dtype by batch size, smallest first."""
    return sorted(((r["batch"], r) for r in result["rows"]
                   if r["competitor"] == "meganeura-bundle" and r["dtype"] == result["dtype"]), key=lambda p: p[0])


# Context bands of the by-context table: (first, last) context length of each band.
CONTEXT_BANDS = ((1, 64), (65, 256), (257, 1024), (1025, 2048), (2049, 1 << 30))
CONTEXT_BANDS_LABELS = ("<= 64", "65-256", "257-1024", "1025-2048", "> 2048")


def _band_medians(by_context: dict) -> list:
    """The median tokens/s of the decode steps whose context falls in each of ``CONTEXT_BANDS`` (None where none)."""
    import statistics

    steps = [(int(c), rate) for c, rate in by_context.items()]
    return [statistics.median(rates) if (rates := [r for c, r in steps if lo <= c <= hi]) else None
            for lo, hi in CONTEXT_BANDS]


def _label(row: dict) -> str:
    return f"{row['competitor']} {row['cache']} batch {row['batch']} {row.get('dtype', 'float32')}"


def plot_by_context(result: dict, path: Path) -> None:
    """Decode tokens/s against context length, one line per row that records its steps (the aggregate over a
    batched row's prompts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in result["rows"]:
        if r.get("decode_by_context"):
            points = sorted((int(c), rate) for c, rate in r["decode_by_context"].items())
            ax.plot([c for c, _ in points], [rate for _, rate in points], label=_label(r), linewidth=1)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Generation at {result['description']}", fontsize=9)
    _save(fig, ax, path)


def plot_by_batch(result: dict, path: Path) -> None:
    """The bundle's aggregate tokens/s (the whole call's, and decode's) against batch size, each point marked with
    its ratio to batch 1's, beside batch 1's tokens/s times the batch (what it would be if a step for the whole batch
    took as long as one for a single prompt); both axes logarithmic, so that this line is straight."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    by_batch = _by_batch(result)
    sizes = [b for b, _ in by_batch]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.plot(sizes, [r["tokens_per_second"] for _, r in by_batch], marker="o", label="tokens/s (prefill included)")
    ax.plot(sizes, [r["decode_tokens_per_second"] for _, r in by_batch], marker="s", label="decode tokens/s")
    one = by_batch[0][1]["tokens_per_second"]  # (``batch_speedups`` exists: so does the batch-1 row)
    ax.plot(sizes, [one * b for b in sizes], linestyle="--", color="grey", label="batch 1's tokens/s x batch")
    for b, r in by_batch:
        ax.annotate(f"{result['batch_speedups'].get(str(b), 1.0):.2f}x", (b, r["tokens_per_second"]),
                    textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):  # 200, not 2 x 10^2
        set_formatter(ScalarFormatter())
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.margins(x=0.08)
    ax.set_xlabel("batch (prompts generated together)")
    ax.set_ylabel("aggregate tokens/s (every prompt's new tokens)")
    ax.set_title(f"The generation bundle by batch size\n{result['description']}", fontsize=9)
    _save(fig, ax, path)


def _save(fig, ax, path: Path) -> None:
    """The figure with its legend, written to ``path`` and closed."""
    import matplotlib.pyplot as plt

    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    import torch

    torch.manual_seed(0)
    name, build = MODELS[args.model]
    model = build(args.smoke).eval().to(getattr(torch, args.dtype))
    wanted = set(args.rows.split(","))
    if wanted - set(ROWS):
        raise SystemExit(f"--rows: unknown {sorted(wanted - set(ROWS))}; choose of {', '.join(ROWS)}")
    largest = max(args.batch)
    prompts = _prompts(model.config.vocab_size, args.prompt_tokens, largest)
    prompt = prompts[0]
    new = min(args.new_tokens, args.max_cache_len - args.prompt_tokens)
    checked = min(new, args.compare_tokens or new)
    half = copy.deepcopy(model).to(torch.bfloat16) if args.half_bundle and args.dtype == "float32" else None
    with torch.no_grad():
        references = {args.dtype: _references(model, prompts if "bundle" in wanted and largest > 1 else [prompt],
                                              checked)}
        if half is not None:
            references["bfloat16"] = _references(half, [prompt], checked)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    description = f"{name} (HF Llama, random weights, {args.dtype})" + (", smoke scale" if args.smoke else "")
    result = {"description": description, "machine": device, "torch": torch.__version__, "model": args.model,
              "dtype": args.dtype, "prompt_tokens": args.prompt_tokens, "new_tokens": new,
              "compared_tokens": checked, "smoke": args.smoke, "rows": []}
    report = _Report(Path(args.out), result, references, prompt.shape[1])
    for group in _row_groups(args, model, half, prompts, new, device, wanted):
        report.add(group())  # written after each group: a run cut short keeps the rows it finished
    for key, value in result.items():
        if key.endswith("_speedup"):
            print(f"{key}: {value:.2f}x", flush=True)
    print(f"wrote {', '.join(str(path) for path in report.write(plot=True))}", flush=True)
    return 0


def _row_groups(args, model, half, prompts: list, new: int, device: str, wanted: set) -> list:
    """The rows to run, as callables each returning a list of rows, in the order they run."""
    import torch

    prompt, caches = prompts[0], [c for c in args.caches.split(",") if c]

    def batch_one(rows: list) -> list:
        return [{**row, "batch": 1} for row in rows]

    def no_grad(run):
        def wrapped():
            with torch.no_grad():
                return run()
        return wrapped

    groups = [no_grad(lambda: batch_one(_eager_rows(model, prompt, new, device, caches if "eager" in wanted else [],
                                                    "hf-compiled" in wanted)))]
    if "backend" in wanted:
        groups.append(no_grad(lambda: batch_one(_backend_rows(model, prompt, new, caches))))
    if "bundle" in wanted:
        groups.append(lambda: _bundle_row(model, [prompt], new, args.max_cache_len, args.adapter,
                                          args.bundle_synchronous))
        if half is not None:
            groups.append(lambda: [{**row, "dtype": "bfloat16"}
                                   for row in _bundle_row(half, [prompt], new, args.max_cache_len, args.adapter)])
        for size in (size for size in args.batch if size > 1):  # batch 1: the batch-1 bundle's row above
            groups.append(lambda size=size: _bundle_row(model, prompts[:size], new, args.max_cache_len, args.adapter))
    return groups


class _Report:
    """The result being built: each row checked against eager's tokens as it comes, the files written again after
    each group of rows."""

    def __init__(self, out: Path, result: dict, references: dict, prompt_tokens: int):
        self.out, self.result, self.references = out, result, references
        self.prompt_tokens = prompt_tokens
        out.parent.mkdir(parents=True, exist_ok=True)

    def add(self, rows: list) -> None:
        for row in rows:
            row.setdefault("dtype", self.result["dtype"])
            want = self.references[row["dtype"]]
            want = want if row["batch"] > 1 else want[0]
            batched, compared = row["batch"] > 1, len(want[0] if row["batch"] > 1 else want) - self.prompt_tokens
            row["agreeing_tokens"] = _agreeing(row.pop("tokens"), want, self.prompt_tokens, batched)
            row["equal"] = row["agreeing_tokens"] == compared
            print(f"{row['competitor']:18s} {row['cache']:8s} batch {row['batch']} {row['dtype']:8s} "
                  f"{row['tokens_per_second']:9.1f} tokens/s  "
                  f"{'tokens equal eager' if row['equal'] else 'TOKENS DIFFER after %d' % row['agreeing_tokens']}",
                  flush=True)
            self.result["rows"].append(row)
        self.write()

    def write(self, plot: bool = False) -> list[Path]:
        """OUT.json and OUT.md; with ``plot``, OUT.png, and OUT-batch.png where the bundle ran at several batch
        sizes. Returns the paths written."""
        import torch

        rows, result = self.result["rows"], self.result
        adapter = next((r["adapter"] for r in rows if "adapter" in r), "")
        cuda = torch.cuda.is_available()
        result["machine"] = (f"{torch.cuda.get_device_name()} (CUDA)" + (f" beside {adapter}" if adapter else "")
                             if cuda else adapter or "CPU")
        result.update(_ratios(rows))
        written = [self.out.with_suffix(".json"), self.out.with_suffix(".md")]
        written[0].write_text(json.dumps(result, indent=1))
        written[1].write_text(markdown(result, self.out.name))
        if plot:
            written.append(self.out.with_suffix(".png"))
            plot_by_context(result, written[-1])
        if plot and "batch_speedups" in result:
            written.append(self.out.with_name(self.out.name + "-batch.png"))
            plot_by_batch(result, written[-1])
        return written


def _references(model, prompts: list, new: int) -> list:
    """Eager greedy ``generate`` on the CPU of each prompt alone, ``new`` tokens (None for no model)."""
    if model is None:
        return []
    return [model.generate(p, max_new_tokens=new, min_new_tokens=new, do_sample=False)[0].tolist() for p in prompts]


def _agreeing(tokens: list, want: list, prompt_tokens: int, batched: bool) -> int:
    """How many new tokens a row's tokens (prompt and new ones; a batched row's, a list per prompt, the least of
    them) share with eager's ``want`` before the first that differs (``want``'s new tokens where none does)."""
    if batched:
        return min(_agreeing(t, w, len(w) - (len(want[0]) - prompt_tokens), False) for t, w in zip(tokens, want))
    same = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), min(len(tokens), len(want)))
    return same - prompt_tokens


def _ratios(rows: list) -> dict:
    """Each batched bundle's aggregate tokens/s over batch 1's (``batch_speedups``, by batch size; ``batch`` and
    ``batch_speedup``: the largest batch's), the bf16 bundle's over the f32 one's, and batch 1's run ahead over its
    synchronous (``--bundle-synchronous``)."""
    bundles = {(r["batch"], r["dtype"]): r["tokens_per_second"] for r in rows if r["competitor"] == "meganeura-bundle"}
    ratios = {}
    one = bundles.get((1, "float32"), bundles.get((1, "bfloat16")))
    # (none before the rows come: ``_Report`` writes after each group; batched rows are in the model's dtype)
    speedups = {b: rate / one for (b, _), rate in sorted(bundles.items()) if b > 1} if one else {}
    if speedups:
        ratios["batch_speedups"] = {str(b): speedup for b, speedup in speedups.items()}
        ratios["batch"], ratios["batch_speedup"] = max(speedups), speedups[max(speedups)]
    if (1, "float32") in bundles and (1, "bfloat16") in bundles:
        ratios["bfloat16_speedup"] = bundles[1, "bfloat16"] / bundles[1, "float32"]
    synchronous = [r["tokens_per_second"] for r in rows if r["competitor"] == "meganeura-bundle-synchronous"]
    if synchronous and one:
        ratios["run_ahead_speedup"] = one / synchronous[0]
    return ratios


if __name__ == "__main__":
    raise SystemExit(main())
