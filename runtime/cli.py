"""The ``meganeura`` command (also ``python -m meganeura.runtime``): adapters, bundle runs and bundle contents.

    meganeura info [--json]                               adapters wgpu sees: type, backend, features, limits
    meganeura run BUNDLE --input NAME=FILE.npy ... [--output DIR] [--repeat N] [--adapter A] [--seed S]
                                                          run a bundle on .npy inputs, write .npy outputs, time it
    meganeura inspect BUNDLE [--json] [--dispatches]      validate a bundle; print its manifest, plan and memory
    meganeura generate BUNDLE (--ids 1,2,3 ... | --prompt TEXT ... | --prompts-file FILE) [--max-new-tokens N]
                       [--temperature T] [--top-k K] [--top-p P] [--seed S] [--adapter A]
                                                          generate with a generation bundle (export_lm); print the
                                                          ids (and text) and tokens per second; several prompts
                                                          (repeated --ids or --prompt, or a file of one prompt a
                                                          line) go through a batched bundle together

Input files are read with ``numpy.load(..., allow_pickle=False)``. Errors print one line to stderr and exit 1.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from meganeura.kernels.sizes import from_json

from .bundle import read_bundle
from .errors import MeganeuraError
from .requirements import PORTABLE_LIMITS

SHOWN_LIMITS = ("max-storage-buffer-binding-size", "max-buffer-size", *PORTABLE_LIMITS)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        args.command(args)
    except (MeganeuraError, OSError, ValueError) as err:
        print(f"meganeura {args.name}: error: {err}", file=sys.stderr)
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meganeura", description="Run torch-meganeura bundles without torch.")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")

    info = commands.add_parser("info", help="list GPU adapters with their features and limits",
                               description="List the adapters wgpu sees, with their features and limits.")
    info.add_argument("--json", action="store_true", help="print every feature and limit as JSON")
    info.set_defaults(command=info_command, name="info")

    run = commands.add_parser("run", help="run a bundle on .npy inputs",
                              description="Run a bundle on .npy inputs; write .npy outputs and print timings.")
    run.add_argument("bundle", type=Path, help="bundle directory (written by torch_meganeura.export)")
    run.add_argument("--input", "-i", action="append", default=[], metavar="NAME=FILE",
                     help="an input by its manifest name and a .npy file; repeat for each input")
    run.add_argument("--output", "-o", type=Path, help="directory to write NAME.npy per output (created)")
    run.add_argument("--repeat", type=int, default=5, help="timed calls after the first (default 5)")
    run.add_argument("--adapter", help="adapter index or name substring (default: MEGANEURA_ADAPTER, else the best)")
    run.add_argument("--seed", type=int, help="seed for bundles with random ops")
    run.set_defaults(command=run_command, name="run")

    generate = commands.add_parser("generate", help="generate token ids with a generation bundle",
                                   description="Generate with a bundle written by torch_meganeura.export_lm: print "
                                               "the prompt and new ids (and text, with --prompt) and tokens/s. "
                                               "Several prompts (up to the bundle's batch_size) are generated "
                                               "together, each printed on lines of its own.")
    generate.add_argument("bundle", type=Path, help="generation bundle directory (written by export_lm)")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--ids", action="append", help="a prompt's token ids, comma-separated (repeat it for a batch)")
    prompt.add_argument("--prompt", action="append", help="a prompt as text (repeat it for a batch): needs the "
                                                          "bundle's tokenizer.json and the tokenizers package")
    prompt.add_argument("--prompts-file", type=Path, help="a text file of prompts, one a line (blank lines skipped), "
                                                          "generated together; needs the tokenizer as --prompt does")
    generate.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens (default 64)")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    generate.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    generate.add_argument("--top-p", type=float, help="sample among the most likely tokens holding this probability")
    generate.add_argument("--seed", type=int, help="seed of the sampler")
    generate.add_argument("--adapter",
                          help="adapter index or name substring (default: MEGANEURA_ADAPTER, else the best)")
    generate.set_defaults(command=generate_command, name="generate")

    inspect = commands.add_parser("inspect", help="validate a bundle and describe it",
                                  description="Validate a bundle and print its manifest, plan and memory use.")
    inspect.add_argument("bundle", type=Path, help="bundle directory")
    inspect.add_argument("--json", action="store_true", help="print the manifest and plan summary as JSON")
    inspect.add_argument("--dispatches", action="store_true", help="also list every dispatch")
    inspect.set_defaults(command=inspect_command, name="inspect")
    return parser


# ---- info


def info_command(args) -> None:
    from .device import get_device, list_adapters  # noqa: PLC0415 - help and argument errors load no wgpu

    adapters = list_adapters()
    if args.json:
        print(json.dumps(adapters, indent=1))
        return
    for a in adapters:
        print(f"[{a['index']}] {a['name']} ({a['type']}, {a['backend']})")
        print(f"    features: {', '.join(a['features']) or '-'}")
        for name in SHOWN_LIMITS:
            print(f"    {name}: {a['limits'].get(name, '-')}")
    print(f"default: {get_device().describe()}")


# ---- run


def run_command(args) -> None:
    from .model import load  # noqa: PLC0415 - help and argument errors load no wgpu

    inputs = dict(_read_input(text) for text in args.input)
    start = time.perf_counter()
    model = load(args.bundle, adapter=args.adapter, seed=args.seed)
    loaded = time.perf_counter()
    outputs = model(**inputs)
    first = time.perf_counter()
    times = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        model(**inputs)
        times.append(time.perf_counter() - t)
    print(f"adapter:     {model.device.describe()}")
    print(f"load:        {1e3 * (loaded - start):.1f} ms (validate, pipelines, weights upload)")
    print(f"first call:  {1e3 * (first - loaded):.1f} ms")
    if times:
        print(f"repeat call: {1e3 * statistics.median(times):.1f} ms median of {len(times)}")
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
    for name, array in outputs.items():
        line = f"output {name}: {array.dtype}{list(array.shape)}"
        if args.output:
            np.save(args.output / f"{name}.npy", array)
            line += f" -> {args.output / name}.npy"
        print(line)


def _read_input(text: str) -> tuple[str, np.ndarray]:
    name, sep, file = text.partition("=")
    if not sep or not name or not file:
        raise ValueError(f"--input {text!r}: expected NAME=FILE.npy")
    array = np.load(file, allow_pickle=False)
    if not isinstance(array, np.ndarray):
        raise ValueError(f"--input {text!r}: {file} holds several arrays; give one .npy file per input")
    return name, array


# ---- generate


def generate_command(args) -> None:
    from .lm_bundle import is_lm_bundle  # noqa: PLC0415 - help and argument errors load no wgpu
    from .model import load  # noqa: PLC0415

    if not is_lm_bundle(args.bundle):
        raise ValueError(f"{args.bundle} is not a generation bundle (written by torch_meganeura.export_lm)")
    start = time.perf_counter()
    lm = load(args.bundle, adapter=args.adapter)
    loaded = time.perf_counter()
    texts = _prompt_texts(args)
    tokenizer = _tokenizer(lm) if texts is not None else None
    prompts = [np.asarray(tokenizer.encode(t).ids if tokenizer is not None else _ids(t), dtype=np.int64)
               for t in (texts if texts is not None else args.ids)]
    batch = prompts if len(prompts) > 1 else prompts[0]
    outs = lm.generate(batch, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed)
    stats = lm.stats
    print(f"adapter:  {lm.device.describe()}")
    print(f"load:     {1e3 * (loaded - start):.1f} ms (validate, pipelines, weights upload)")
    print(f"prefill:  {stats.prompt_tokens} tokens, {stats.prefill_tokens_per_second:.1f} tokens/s")
    print(f"decode:   {stats.new_tokens} new tokens, {stats.decode_tokens_per_second:.1f} tokens/s"
          + (f" (all {len(prompts)} prompts together)" if len(prompts) > 1 else ""))
    for k, out in enumerate(outs if len(prompts) > 1 else [outs]):
        tag = f"[{k}]" if len(prompts) > 1 else ""
        print(f"{'ids' + tag + ':':<10}" + ",".join(str(int(i)) for i in out))
        if tokenizer is not None:
            print(f"{'text' + tag + ':':<10}" + tokenizer.decode(out.tolist()))


def _prompt_texts(args) -> list[str] | None:
    """The prompts as text (--prompt, --prompts-file), or None where they are ids (--ids)."""
    if args.prompts_file is None:
        return args.prompt
    try:
        lines = args.prompts_file.read_text().splitlines()
    except OSError as err:
        raise ValueError(f"--prompts-file {args.prompts_file}: {err.strerror}") from None
    texts = [line for line in lines if line.strip()]
    if not texts:
        raise ValueError(f"--prompts-file {args.prompts_file} holds no prompt")
    return texts


def _ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--ids {text!r}: expected comma-separated integers") from None


def _tokenizer(lm):
    """The bundle's tokenizer (``tokenizers``, torch-free)."""
    name = lm.manifest["tokenizer"]
    if name is None:
        raise ValueError(f"{lm.path} holds no tokenizer: export it with export_lm(..., tokenizer=...) or pass --ids")
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415 - optional: only --prompt needs it
    except ImportError:
        raise ValueError("--prompt needs the tokenizers package (pip install tokenizers; it does not need torch)")
    return Tokenizer.from_file(str(lm.path / name))


# ---- inspect


def inspect_command(args) -> None:
    bundle = read_bundle(args.bundle)
    summary = _summary(bundle)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        _print_summary(summary)
    if args.dispatches:
        for i, d in enumerate(bundle.plan.dispatches):
            bound = ", ".join(f"{b.buffer}@{b.offset}+{b.size}" for b in d.bindings)
            groups = [repr(w) for w in d.workgroups]  # (symbolic counts by their form)
            print(f"  {i:4d} {d.label or d.kernel}: kernel {d.kernel}, workgroups [{', '.join(groups)}], [{bound}]")


def _summary(bundle) -> dict:
    m, plan = bundle.manifest, bundle.plan
    by_role: dict[str, int] = {}
    for b in plan.buffers:
        by_role[b.role] = by_role.get(b.role, 0) + b.size
    files = {name: (bundle.path / name).stat().st_size for name in ["manifest.json", *m["files"]]}
    return {
        "path": str(bundle.path),
        "format": f"{m['format']} v{m['format_version']}",
        "producer": m["producer"],
        "inputs": [_tensor_line(e, plan.bounds) for e in m["inputs"]],
        "outputs": [_tensor_line(e, plan.bounds) for e in m["outputs"]],
        "params": {"count": len(m["params"]), "bytes": sum(w.nbytes for w in bundle.weights.values())},
        "kernels": len(plan.kernels),
        "dispatches": len(plan.dispatches),
        "memory_bytes_by_role": by_role,
        "arena": {"planned_bytes": plan.stats.get("arena_bytes"), "unplanned_bytes": plan.stats.get("unplanned_bytes")},
        "requires": m["requires"],
        "size_on_disk_bytes": sum(files.values()),
    }


def _tensor_line(entry: dict, bounds) -> str:
    """``name: dtype[dims]``, a dynamic dimension by its form over the dynamic dimensions s[k] and its largest value."""
    dims = [str(s) if isinstance(s, int) else f"{from_json(s, bounds)!r}<={from_json(s, bounds).hint}"
            for s in entry["shape"]]
    return f"{entry['name']}: {entry['dtype']}[{', '.join(dims)}]"


def _print_summary(s: dict) -> None:
    producer = s["producer"]
    print(f"bundle:      {s['path']} ({s['format']}, {s['size_on_disk_bytes']:,} bytes on disk)")
    print("producer:    " + ", ".join(f"{k} {v}" for k, v in producer.items()))
    for key in ("inputs", "outputs"):
        for line in s[key]:
            print(f"{key[:-1] + ':':<12} {line}")
    print(f"params:      {s['params']['count']} tensors, {s['params']['bytes']:,} bytes")
    print(f"kernels:     {s['kernels']}")
    print(f"dispatches:  {s['dispatches']}")
    print("memory plan: " + ", ".join(f"{role} {size:,} B" for role, size in s["memory_bytes_by_role"].items()))
    arena = s["arena"]
    if arena["planned_bytes"] is not None:
        print(f"arena:       {arena['planned_bytes']:,} B planned for {arena['unplanned_bytes']:,} B of intermediates")
    print(f"features:    {', '.join(s['requires']['features']) or 'none'}")
    for name, value in s["requires"]["limits"].items():
        print(f"limit:       {name} {'<=' if name.startswith('min-') else '>='} {value}")
