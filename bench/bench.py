"""The benchmark's command line: ``python3 bench/bench.py [flags]``, the same as
``python3 -m bench [flags]`` from the repository root. The code is the ``bench`` package
around this file (bench/__init__.py lists its modules, bench/README.md the flags)."""

import os
import sys

if __name__ == "__main__":
    # Run as a script, this file's folder is sys.path[0], where ``bench`` would name this
    # file; the repository root instead, where it names the package.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    sys.path.insert(0, os.path.dirname(here))
    from bench.cli import main

    sys.exit(main())
