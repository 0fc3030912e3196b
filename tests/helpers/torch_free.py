"""Running the torch-free runtime in a process where torch cannot be imported."""
from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK_TORCH = textwrap.dedent("""\
    import sys
    sys.modules["torch"] = None  # importing torch now raises ImportError
    try:
        import torch
    except ImportError:
        pass
    else:
        raise SystemExit("torch is importable")
""")
CHECK_NO_TORCH = ('\nassert not [m for m, v in sys.modules.items() if m.split(".")[0] == "torch" and v is not None], '
                  '"torch was imported"\n')


def run_without_torch(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``script`` (Python source) with ``args`` in a fresh process that cannot import torch, and check that it
    succeeded and imported none of torch; returns the finished process (its stdout)."""
    done = subprocess.run([sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(script) + CHECK_NO_TORCH, *args],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done
