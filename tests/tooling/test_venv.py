"""tests/venv.sh, which tests/run.sh creates its cached venvs with: two runs that start
at once on a cold cache both succeed with one venv, and a half-built venv is rebuilt.

A tiny wheel made here stands in for the requirements, so no index is needed."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_SH = REPO / "tests" / "venv.sh"


def tiny_wheel(tmp_path: Path) -> Path:
    path = tmp_path / "tinypkg-1.0-py3-none-any.whl"
    files = {
        "tinypkg/__init__.py": "VALUE = 42\n",
        "tinypkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "tinypkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr("tinypkg-1.0.dist-info/RECORD", record)
    return path


def start(dest: Path, wheel: Path) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(VENV_SH), str(dest), sys.executable, f"--no-index {wheel}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_cold_runs_at_once_both_get_one_working_venv(tmp_path):
    wheel = tiny_wheel(tmp_path)
    dest = tmp_path / "cache" / "venv-x"
    procs = [start(dest, wheel), start(dest, wheel)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    # One of them built it; the other waited on the lock and reused it.
    assert sum("== creating venv" in o for o in outs) == 1, outs
    assert sum("waiting for another run" in o for o in outs) == 1, outs
    assert (dest / ".complete").is_file()
    r = subprocess.run([str(dest / "bin" / "python"), "-c", "import tinypkg; print(tinypkg.VALUE)"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "42", r.stderr
    # A third run finds it complete and does nothing.
    third = start(dest, wheel)
    assert third.communicate(timeout=60)[0] == "" and third.returncode == 0


def test_a_half_built_venv_is_rebuilt_and_a_failed_install_shows_pips_error(tmp_path):
    wheel = tiny_wheel(tmp_path)
    dest = tmp_path / "venv-y"
    (dest / "bin").mkdir(parents=True)
    (dest / "bin" / "leftover").write_text("a killed build")
    p = start(dest, wheel)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0 and "== creating venv" in out, out
    assert not (dest / "bin" / "leftover").exists() and (dest / ".complete").is_file()
    bad = tmp_path / "venv-z"
    p = subprocess.Popen(["bash", str(VENV_SH), str(bad), sys.executable,
                          f"--no-index {tmp_path / 'missing-1.0-py3-none-any.whl'}"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = p.communicate(timeout=300)[0]
    assert p.returncode != 0 and "missing-1.0-py3-none-any.whl" in out, out
    assert not (bad / ".complete").exists()
