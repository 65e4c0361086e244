"""`python -m kvtier.cli` runs the `kvtier` command (as `python -m kvtier` does)."""

import sys

from kvtier.cli.parser import main

if __name__ == "__main__":
    sys.exit(main())
