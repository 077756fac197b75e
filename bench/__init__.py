"""The hidden-state dump benchmark (bench/README.md): ``python -m bench [flags]`` from the
repository root. One module per job, in a run's order: ``models`` (workloads), ``modes``
(every mode), ``plan`` (cells, estimates, ``--dry-run``), ``servers`` (the kinds of server),
``store`` (the store modes' Mooncake Store), ``loadgen`` (a cell's client; ``gen``, a
generate cell's), ``ceilings``
(what the host can move), ``peer`` and ``peerfiles`` (vLLM beside us), ``runner`` (one
model's run), ``cli`` (the whole run, the results file), ``report``, ``targets``,
``markdown`` and ``plot`` (what the results say). Nothing imports torch at module level:
the plan, the report and the tests run anywhere. What the GPU suite shares with it (the
launcher, the tiny models, the reference, the checks) is the top-level ``testing`` package.
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

