"""tests/bench imports the ``bench`` package from the checkout's root. The root goes last on sys.path, after
site-packages: its kernels/, lowering/ and runtime/ folders (installed as meganeura.*) must not shadow PyPI packages
of those names (transformers >= 5.2x imports Hugging Face's ``kernels``)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)
