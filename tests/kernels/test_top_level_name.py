"""A Python started in the checkout's root (``python -c``, ``-m``, a REPL) has the root first on sys.path, where the
kernels/ folder (the package ``meganeura.kernels``) would be found as the top-level ``kernels``: the name of Hugging
Face's package, which transformers >= 5.25 imports. kernels/__init__.py hands that import to the installed one, where
there is one."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = """
import sys, kernels, meganeura.kernels
print(kernels.__file__)
print(meganeura.kernels.__file__)
"""


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)


def test_the_top_level_kernels_is_hugging_faces_even_in_the_checkouts_root():
    outside = _run("import sys, importlib.machinery; sys.path.remove(''); "
                   "print(importlib.machinery.PathFinder.find_spec('kernels') is not None)")
    if outside.stdout.strip() != "True":
        pytest.skip("Hugging Face's kernels package is not installed")
    done = _run(CHECK)
    assert done.returncode == 0, done.stderr
    hf, ours = done.stdout.split()
    assert Path(ours) == ROOT / "kernels" / "__init__.py" and Path(hf).parent != ROOT / "kernels"


def test_without_hugging_faces_kernels_the_folder_stays_ours():
    """transformers before 5.25 (the GPU machine's 5.17) imports ``kernels`` where it finds one and then asks its
    distribution's version: the import must not fail there (it stopped ``python -m bench`` on that machine)."""
    done = _run("import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]; import kernels; "
                "print(kernels.__file__)")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == ROOT / "kernels" / "__init__.py"
