"""The main job: compile a small HF Llama with ``backend="meganeura"``, check it against eager PyTorch and
time both sides; check one training step's gradients; export it and run the bundle in a process without torch.

    python -m torch_meganeura.demo [--layers N] [--hidden H] [--seq S] [--repeats R]

Prints the adapter, the explain() report (partitions, kernels, dispatches, planned memory), the largest
elementwise error against eager, median call times (compiled on the adapter vs eager on the CPU), the worst
gradient error of a training step, and the torch-free run of the exported bundle (``meganeura run``: load,
first-call and repeat-call times) with its error against eager.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from .backend.explain import explain
from .bundles.export import export

# Runs the meganeura CLI in a process where importing torch fails.
TORCH_FREE_CLI = ('import sys; sys.modules["torch"] = None; import runpy; '
                  'runpy.run_module("meganeura.runtime", run_name="__main__", alter_sys=True)')


def build_model(layers: int, hidden: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 - an optional dependency (seconds)

    heads = max(hidden // 32, 1)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(heads // 2, 1), max_position_embeddings=512, use_cache=False)
    return LlamaForCausalLM(config).eval()


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def check_training_step(model, ids) -> bool:
    """One forward + backward (causal-LM loss) compiled and eager; print the worst relative gradient error."""
    trained, ref = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    torch._dynamo.reset()
    compiled = torch.compile(trained, backend="meganeura")
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    want = ref(ids, labels=ids).loss
    want.backward()
    worst = max(((p.grad - q.grad).norm() / q.grad.norm()).item()
                for p, q in zip(trained.parameters(), ref.parameters()) if q.grad.norm() > 0)
    ok = abs(loss.item() - want.item()) <= 1e-4 * abs(want.item()) and worst <= 1e-4
    print(f"training step: loss {loss.item():.6f} vs eager {want.item():.6f}, worst gradient relative L2 "
          f"{worst:.2e} -> {'OK' if ok else 'MISMATCH'}")
    return ok


def export_and_run_without_torch(model, ids, want: np.ndarray, repeats: int) -> bool:
    """Export to a bundle, run it with ``meganeura run`` in a process where torch cannot be imported."""
    with tempfile.TemporaryDirectory() as tmp:
        bundle, inputs = Path(tmp) / "llama.bundle", Path(tmp) / "input_ids.npy"
        start = time.perf_counter()
        export(model, {"input_ids": ids}, bundle)
        print(f"export: {time.perf_counter() - start:.2f} s -> {bundle.name}, "
              f"{sum(f.stat().st_size for f in bundle.rglob('*') if f.is_file()):,} bytes")
        np.save(inputs, ids.numpy())
        result = subprocess.run([sys.executable, "-c", TORCH_FREE_CLI, "run", str(bundle),
                                 f"--input=input_ids={inputs}", "--output", tmp, "--repeat", str(repeats)],
                                capture_output=True, text=True)
        print("torch-free run (meganeura run):\n  " + "\n  ".join((result.stdout + result.stderr).strip().splitlines()))
        if result.returncode:
            return False
        got = np.load(Path(tmp) / "logits.npy")
    ok = np.allclose(got, want, rtol=1e-4, atol=1e-5)
    print(f"bundle vs eager: max |diff| {np.abs(got - want).max():.2e} -> {'OK' if ok else 'MISMATCH'}")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    parser.add_argument("--vocab", type=int, default=1000, help="vocabulary size (default 1000)")
    parser.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per side (default 10)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = build_model(args.layers, args.hidden, args.vocab)
    ids = torch.randint(0, args.vocab, (1, args.seq))
    print(f"model: LlamaForCausalLM, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
          f"seq {args.seq}, {sum(p.numel() for p in model.parameters()):,} parameters (random weights)")
    with torch.no_grad():
        report = explain(model, ids)
        print(report)
        compiled = torch.compile(model, backend="meganeura")
        start = time.perf_counter()
        got = compiled(ids).logits
        first = time.perf_counter() - start
        want = model(ids).logits
        err = (got - want).abs().max().item()
        rel = ((got - want).norm() / want.norm()).item()
        ok = torch.allclose(got, want, rtol=1e-4, atol=1e-5)
        print(f"check vs eager: max |diff| {err:.2e}, relative L2 {rel:.2e} -> {'OK' if ok else 'MISMATCH'}")
        ours = median_ms(lambda: compiled(ids), args.repeats)
        eager = median_ms(lambda: model(ids), args.repeats)
    print(f"first call (compile + run): {first:.2f} s")
    print(f"median call: meganeura {ours:.2f} ms vs eager PyTorch CPU {eager:.2f} ms "
          f"(ratio {ours / eager:.2f}x, inputs uploaded and logits read back on our side)")
    trained_ok = check_training_step(model, ids)
    bundle_ok = export_and_run_without_torch(model, ids, want.numpy(), args.repeats)
    return 0 if ok and trained_ok and bundle_ok else 1


if __name__ == "__main__":
    sys.exit(main())
