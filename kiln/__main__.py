"""``python -m kiln``: the command line."""

from kiln.entrypoints.cli import run

run()
