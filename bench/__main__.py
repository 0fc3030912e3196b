"""Entry point of ``python -m bench`` (see bench.run)."""
import sys

from .run import main

sys.exit(main())
