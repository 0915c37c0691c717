"""``python -m aiak_training.compat --pythonpath``: the directory to prepend to PYTHONPATH.

For plain mpirun/mpiexec users of the Horovod compatibility switch, e.g.::

    export PYTHONPATH=$(python -m aiak_training.compat --pythonpath)${PYTHONPATH:+:$PYTHONPATH}
    mpiexec -n 2 python train_with_import_horovod.py

Exits with status 1 and prints nothing on stdout if a real Horovod is installed (the shim must
never shadow it), so ``$(...)`` yields an empty value rather than a wrong one.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from aiak_training.compat import find_real_horovod, shim_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line entry point."""
    p = argparse.ArgumentParser(prog="python -m aiak_training.compat",
                                description="Horovod compatibility shim helper")
    p.add_argument("--pythonpath", action="store_true",
                   help="print the directory to put in front of PYTHONPATH")
    args = p.parse_args(argv)
    if not args.pythonpath:
        p.print_help()
        return 0
    real = find_real_horovod()
    if real:
        print(f"aiak_training.compat: a real Horovod is installed at {real}; refusing to "
              "shadow it with the compatibility shim", file=sys.stderr)
        return 1
    print(shim_dir())
    return 0


if __name__ == "__main__":
    sys.exit(main())
