"""The hidden-state dump benchmark: what the dump costs the server, against the JSON
path, the host's ceilings and vLLM (bench/README.md). ``python -m bench [flags]`` from the
repository root. One module per job, in the order a run uses them:

- ``models``     the workloads (random-weight shapes) and their build (``python -m bench.models``).
- ``modes``      every mode: its server, how the report reads it and the plot draws it.
- ``plan``       profiles, cells, request counts, time estimates (``--dry-run`` prints it).
- ``servers``    the kinds of server (A, B, D, S; vLLM's V, W), their flags and environment.
- ``store``      the store modes' Mooncake Store: master, store node, the trainer's wait and deletion.
- ``loadgen``    the client: a cell's requests (closed loop), its files or JSON, the warm-up,
                 the server's memory, the writer's log and stage trace.
- ``ceilings``   pinned copies, /dev/shm writes, the writer alone (``python -m bench.ceilings``).
- ``peer``       vLLM 0.33 (servers V and W): its command line, environment, request, files.
- ``peerfiles``  ours and vLLM's files for the same prompts, compared (``python -m bench.peerfiles``).
- ``runner``     one model's run: servers up, warm-up, every cell, host memory.
- ``cli``        the command line, the whole run, the results file.
- ``report``     ratios, targets, stage times; ``markdown`` its tables; ``plot`` its PNG.

Nothing here imports torch at module level: the plan, the report and the tests run on
any machine. What the benchmark shares with the GPU suite (the launcher, the tiny models,
the reference, the checks) is the top-level ``testing`` package.
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

