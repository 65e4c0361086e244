"""`python -m kvtier` runs the `kvtier` command."""

import sys

from kvtier.cli.parser import main

if __name__ == "__main__":  # not when a rank of `kvtier serve --tp` is spawned and imports it
    sys.exit(main())
