"""`python -m ettr`: the same as the `ettr` command."""

import sys

from ettr.cli import main

if __name__ == "__main__":
    sys.exit(main())
