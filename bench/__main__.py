"""``python3 -m bench [flags]``: the benchmark (bench/cli.py; bench/README.md)."""

import sys

from bench.cli import main

sys.exit(main())
