"""``python -m kiln``: the command line."""

import sys

from kiln.entrypoints.cli import main

sys.exit(main())
