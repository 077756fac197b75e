"""``[series] status`` in base.toml: its reader (``series_status``, ``newest_series``), the
``patches list`` verb, the real series' values, and no series literal in the scripts that
mean "the verified series" (they ask ``patches list`` instead)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from sglang_ext.__main__ import main
from sglang_ext.tools.patchtool.series import SeriesError, newest_series, series_status

REPO = Path(__file__).resolve().parents[2]


def make_patches(root: Path, series: dict[str, str | None]) -> Path:
    """patches/v<version>/ with an empty ``series`` and a base.toml per {version: status}."""
    for v, status in series.items():
        d = root / f"v{v}"
        d.mkdir(parents=True)
        (d / "series").write_text("")
        (d / "base.toml").write_text(f'[base]\nversion = "{v}"\n[series]\nversion = "1"\n'
                                     + (f'status = "{status}"\n' if status else ""))
    return root


@pytest.fixture
def patches(tmp_path, monkeypatch):
    root = make_patches(tmp_path / "patches", {"0.5.9": "gpu-verified", "0.5.17": "gpu-verified",
                                               "0.5.10": "apply-checked", "0.5.23": "apply-checked"})
    monkeypatch.setenv("KIMI_SGLANG_PATCHES", str(root))
    return root


def test_reader(patches):
    assert series_status(patches / "v0.5.17") == "gpu-verified"
    assert series_status(patches / "v0.5.23") == "apply-checked"
    assert newest_series("gpu-verified") == patches / "v0.5.17"  # version order, not lexical
    assert newest_series("apply-checked") == patches / "v0.5.23"
    assert newest_series() == patches / "v0.5.23"


def test_reader_errors(tmp_path, monkeypatch):
    root = make_patches(tmp_path / "p", {"0.5.1": None, "0.5.2": "verified"})
    monkeypatch.setenv("KIMI_SGLANG_PATCHES", str(root))
    with pytest.raises(SeriesError, match=r"v0.5.1/base.toml: \[series\] status missing"):
        series_status(root / "v0.5.1")
    with pytest.raises(SeriesError, match=r"\[series\] status is 'verified'; expected one of "
                                          "gpu-verified, apply-checked"):
        series_status(root / "v0.5.2")
    with pytest.raises(SeriesError, match="unknown status 'gpu'"):
        newest_series("gpu")
    with pytest.raises(SeriesError, match="base.toml not found"):
        series_status(tmp_path)
    monkeypatch.setenv("KIMI_SGLANG_PATCHES", str(make_patches(tmp_path / "q", {"0.5.1": "apply-checked"})))
    with pytest.raises(SeriesError, match="no gpu-verified series under"):
        newest_series("gpu-verified")


def test_list_verb(patches, capsys):
    assert main(["patches", "list", "--status", "gpu-verified", "--newest", "--names"]) == 0
    assert capsys.readouterr().out == "v0.5.17\n"
    assert main(["patches", "list", "--names"]) == 0
    assert capsys.readouterr().out.split() == ["v0.5.9", "v0.5.10", "v0.5.17", "v0.5.23"]
    assert main(["patches", "list", "--status", "apply-checked"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split() for ln in lines] == [["v0.5.10", "sglang", "0.5.10", "s1", "apply-checked"],
                                            ["v0.5.23", "sglang", "0.5.23", "s1", "apply-checked"]]
    (patches / "v0.5.23" / "base.toml").write_text('[base]\nversion = "0.5.23"\n')
    assert main(["patches", "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "[series] status missing" in err and "Traceback" not in err


def test_the_real_series():
    """The values CI and the default build rest on; change with a GPU run's results file."""
    statuses = {d.name: tomllib.loads((d / "base.toml").read_text())["series"]["status"]
                for d in (REPO / "patches").glob("v*") if (d / "series").is_file()}
    assert statuses == {"v0.5.17": "apply-checked", "v0.5.23": "gpu-verified"}
    for name, status in statuses.items():
        assert series_status(REPO / "patches" / name) == status
        evidence = tomllib.loads((REPO / "patches" / name / "base.toml").read_text())["series"]["evidence"]
        assert (REPO / evidence).is_file()


SCRIPTS = ["build.sh", "tests/run.sh", "tests/gpu/stage.sh", "tests/gpu/run_e2e.sh",
           "bench/run_bench.sh", ".ci/run"]


def test_scripts_name_no_series():
    """The scripts read the verified series from base.toml (patches list); a version
    literal of a pinned release in them is a second place that would go stale."""
    pinned = {tomllib.loads((d / "base.toml").read_text())["base"]["version"]
              for d in (REPO / "patches").glob("v*") if (d / "base.toml").is_file()}
    pattern = re.compile("|".join(re.escape(v) for v in sorted(pinned)) + r"(?![\d])")
    found = [f"{s}:{i}: {line.strip()}" for s in SCRIPTS
             for i, line in enumerate((REPO / s).read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def test_list_without_any_series_is_an_error_not_silence(tmp_path, monkeypatch, capsys):
    """A user outside a clone (or with KIMI_SGLANG_PATCHES mistyped) gets told why the
    list is empty, exit 2, instead of an empty list and exit 0."""
    monkeypatch.setenv("KIMI_SGLANG_PATCHES", str(tmp_path / "nowhere"))
    assert main(["patches", "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no patch series under ") and "KIMI_SGLANG_PATCHES" in err
    assert "Traceback" not in err


def test_list_from_outside_the_checkout_finds_its_series(tmp_path, monkeypatch, capsys):
    """An editable install run from another directory finds the checkout's patches/ next to
    the package (``default_patches_root``). Before, it looked one level too low (inside
    ``sglang_ext/``), so only ``./patches`` was found: 'no patch series under
    <cwd>/patches', exit 2."""
    monkeypatch.delenv("KIMI_SGLANG_PATCHES", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["patches", "list", "--names"]) == 0, capsys.readouterr().err
    want = {d.name for d in (REPO / "patches").glob("v*") if (d / "series").is_file()}
    assert set(capsys.readouterr().out.split()) == want and "v0.5.23" in want
