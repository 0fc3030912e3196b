"""``python -m torch_meganeura.coverage``: the OpInfo sweep (``sweep.main``)."""
import sys

from .sweep import main

sys.exit(main())
