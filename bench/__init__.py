"""Benchmarks of torch-meganeura side by side with PyTorch: five workloads and micro benchmarks.

``python -m bench --help`` runs them and writes ``bench/results/<tag>.json``; ``python -m bench.report`` turns a
results file into its markdown table and plot. See ``bench/README.md``.
"""
