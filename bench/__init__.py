"""Benchmarks of torch-meganeura side by side with PyTorch: five workloads and micro benchmarks.

``python -m bench --help`` runs them and writes ``bench/results/<tag>.json``; ``python -m bench.report`` turns a
results file into its markdown table and plot; ``bench.cold`` times cold first calls and ``bench.cold_phases``
splits a cold first HF generate into torch's phases and ours, ``bench.generate`` times text generation,
``bench.decode_profile`` where a generation bundle's decode token goes, ``bench.ddp`` data parallel, ``bench.host``
host work per step on the null device and ``bench.host_breakdown`` the loop's step split into torch's share and
ours. See ``bench/results/README.md``.
"""
import os
import sys

# ``python -m bench`` puts the checkout's root first on sys.path. The root holds kernels/, lowering/ and runtime/,
# installed as meganeura.kernels and so on; ahead of site-packages they would shadow PyPI packages of those names
# (transformers >= 5.2x imports Hugging Face's ``kernels``). Once this package is imported, the root goes last.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_entries = [p for p in sys.path if os.path.abspath(p or os.curdir) == _ROOT]
if _entries:
    sys.path[:] = [p for p in sys.path if p not in _entries] + _entries[:1]
