"""A pytest plugin that writes the GPU suite's results record as JSON (``--results-json
PATH``): per test its id, outcome, duration and the properties it recorded with
``record_property`` (the measured errors), plus the environment and the servers started.

Registered by tests/gpu/conftest.py; it holds no pass/fail logic of its own: outcomes are
pytest's reports. Written again after every test, so a run cut off by a time limit keeps
what finished."""

from __future__ import annotations

import datetime
import json
import os
import platform
from importlib import metadata
from typing import Callable, Dict, List


def _versions() -> Dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "sglang", "transformers", "pytest"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


class ResultsJSON:
    """``path``: where to write; ``environment``: a callable returning extra header fields
    (GPU name and count; called when the file is written)."""

    def __init__(self, path: str, environment: Callable[[], dict] = dict):
        self.path = path
        self.environment = environment
        self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.tests: Dict[str, dict] = {}
        self.servers: List[dict] = []

    def pytest_runtest_logreport(self, report):
        entry = self.tests.setdefault(report.nodeid, {"id": report.nodeid, "outcome": None,
                                                       "duration_s": 0.0, "properties": {}})
        entry["duration_s"] = round(entry["duration_s"] + report.duration, 3)
        entry["properties"].update(dict(report.user_properties))
        if report.when == "call" or report.outcome != "passed":
            if entry["outcome"] in (None, "passed"):  # the first failure or skip wins
                entry["outcome"] = report.outcome if report.when == "call" or report.outcome == "skipped" \
                    else "error"
            if report.outcome == "failed":
                entry["message"] = str(report.longrepr)[-2000:]
            elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
                entry["message"] = report.longrepr[2]
        self.write()

    def pytest_sessionfinish(self, session, exitstatus):
        self.write(exitstatus=int(exitstatus))

    def write(self, exitstatus=None) -> None:
        counts: Dict[str, int] = {}
        for t in self.tests.values():
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        doc = {"started": self.started, "versions": _versions(), **self.environment(),
               "exitstatus": exitstatus, "counts": counts, "servers": self.servers,
               "tests": list(self.tests.values())}
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, self.path)


def add_option(parser) -> None:
    parser.addoption("--results-json", default=None, metavar="PATH",
                     help="write the results record (ids, outcomes, durations, recorded properties) as JSON")


def configure(config, environment: Callable[[], dict] = dict):
    """Register a ResultsJSON when --results-json is given; returns it (or None)."""
    path = config.getoption("--results-json")
    if not path:
        return None
    plugin = ResultsJSON(path, environment)
    config.pluginmanager.register(plugin, "kimi-results-json")
    return plugin


# As a plugin of its own (``pytest -p record``, tests/gpu on sys.path):
def pytest_addoption(parser):
    add_option(parser)


def pytest_configure(config):
    configure(config)
