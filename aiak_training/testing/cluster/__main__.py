"""``python -m aiak_training.testing.cluster``: the command line of :mod:`.cli`."""
import sys

from aiak_training.testing.cluster.cli import main

if __name__ == "__main__":
    sys.exit(main())
