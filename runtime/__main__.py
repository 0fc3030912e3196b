"""``python -m meganeura.runtime``: the ``meganeura`` command (see ``cli``)."""
import sys

from .cli import main

sys.exit(main())
