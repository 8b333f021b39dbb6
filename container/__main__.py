import sys

from container.cli import run

sys.exit(run())
