"""``python -m fp4compile ...`` is the ``fp4compile`` command (see fp4compile.train.cli)."""
import sys

from fp4compile.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
