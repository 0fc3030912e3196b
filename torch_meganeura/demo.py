"""The main job: compile a small HF Llama with ``backend="meganeura"``, check it against eager PyTorch and
time both sides.

    python -m torch_meganeura.demo [--layers N] [--hidden H] [--seq S] [--repeats R]

Prints the adapter, the explain() report (partitions, kernels, dispatches, planned memory), the largest
elementwise error against eager, and median call times (compiled on the adapter vs eager on the CPU).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from .explain import explain


def build_model(layers: int, hidden: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(hidden // 32, 1)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(heads // 2, 1), max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


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
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
