"""The hidden-state dump benchmark (issue #7): dump overhead, the JSON path, the ceilings,
and vLLM side by side (issue 23).

Run it as ``python3 -m bench [flags]`` from the repository root (bench/README.md: flags,
what runs, the numbers). One module per job, in the order a run uses them:

- ``models``     the workloads (random-weight shapes) and their build (``python -m bench.models``).
- ``modes``      every mode: its server, how the report reads it and the plot draws it.
- ``plan``       profiles, cells, request counts, time estimates (``--dry-run`` prints it).
- ``servers``    the kinds of server a model's run starts (A-D; vLLM's V, W), their flags, dump
                 directories and environment; started and stopped by testing/server.py.
- ``loadgen``    the client: a cell's requests (closed loop), its files or JSON, the warm-up,
                 the server's memory and the writer's log (``serverlog`` reads its lines).
- ``ceilings``   pinned copies, /dev/shm writes, the writer alone (``python -m bench.ceilings``).
- ``profilers``  a cell again under py-spy.
- ``peer``       the peer, vLLM 0.33 (servers V and W): its command line, environment,
                 request and response, the wait for its files.
- ``peerfiles``  a few files of ours and vLLM's for the same prompts, compared
                 (``python -m bench.peerfiles``).
- ``runner``     one model's run: servers up, warm-up, every cell, profiles, host memory.
- ``cli``        the command line and the whole run, the results file.
- ``report``     the numbers of a results file (ratios, targets); ``markdown`` its tables;
                 ``plot`` its PNG (matplotlib).

Nothing here imports torch at module level: the plan, the report and the tests run on
any machine. What the benchmark shares with the GPU suite (the launcher, the tiny models,
the reference, the checks) is the top-level ``testing`` package. Sub-programs run with
this package's parent on ``PYTHONPATH`` (``child_env``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]


def module_argv(module: str, *args: str) -> list:
    """The argv of sub-program ``bench.<module>`` under this interpreter."""
    return [sys.executable, "-m", f"bench.{module}", *args]


def child_env(extra: Optional[dict] = None) -> dict:
    """This environment with the repository root first on ``PYTHONPATH`` (so that
    ``python -m bench.<module>`` and ``sglang_ext`` import wherever the child starts),
    plus ``extra``."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return os.environ | {"PYTHONPATH": path} | (extra or {})

