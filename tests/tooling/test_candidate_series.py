"""The candidate series ``patches/candidates/v0.5.23`` (series 7 + 0009, output rows).

- It applies cleanly (no offsets) to the wheel its base.toml pins, as every ``patches/v*``
  series must (tests/tooling/test_nightly.py).
- Its 0001-0008 are series 7's byte for byte but the ``[PATCH N/9]`` counter, so a GPU run
  on it tests series 7 plus 0009 and nothing else.
- Nothing picks it by default: it is outside ``patches/v*``, and the newest gpu-verified
  series (build.sh, tests/run.sh, the GPU scripts' default) is still ``v0.5.23``.
- On the wheel's sources with the series applied by plain ``git apply``: the doors sit
  where ``DumpSession.on_outputs`` and ``wants_host_rows`` assume (after the finish checks
  and before the outputs are streamed; the decode copy to the host decided where SGLang
  queues it behind the forward; setup_model told that the doors exist).
"""

from __future__ import annotations

import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from sglang_ext.tools.patchtool.series import GPU_VERIFIED, known_series, load_series, newest_series

from test_nightly import CACHE, cli_json, get_wheel, persistent_cache  # noqa: F401 - a fixture

REPO = Path(__file__).resolve().parents[2]
CANDIDATE = REPO / "patches" / "candidates" / "v0.5.23"
V23 = REPO / "patches" / "v0.5.23"


def test_it_is_series_7_plus_0009_and_never_the_default(monkeypatch):
    cand, s7 = load_series(CANDIDATE), load_series(V23)
    assert [p.name for p in cand.patches] == [p.name for p in s7.patches] + [cand.patches[-1].name]
    assert cand.patches[-1].name.startswith("0009-")
    for mine, theirs in zip(cand.patches, s7.patches):
        a = re.sub(r"\[PATCH (\d+)/9\]", r"[PATCH \1/8]", mine.path.read_text())
        assert a == theirs.path.read_text(), f"{mine.name} differs from series 7's"
    assert sorted(cand.patches[-1].touched_paths()) == [
        "python/sglang/srt/managers/scheduler.py",
        "python/sglang/srt/managers/scheduler_components/batch_result_processor.py",
        "python/sglang/srt/model_executor/model_runner.py",
    ]
    assert cand.base.version == s7.base.version and cand.base.wheels == s7.base.wheels
    assert cand.base.status == "apply-checked" and int(cand.base.series_version) == int(s7.base.series_version) + 1
    monkeypatch.delenv("KIMI_SGLANG_PATCHES", raising=False)
    assert CANDIDATE not in known_series() and newest_series(GPU_VERIFIED) == V23


@pytest.mark.network
def test_it_applies_cleanly_to_its_pinned_base(capsys, persistent_cache):  # noqa: F811
    series = load_series(CANDIDATE)
    info = get_wheel(series.base.version, series.base)
    assert info.pinned, "the wheel used must match base.toml's sha256"
    rc, report = cli_json(capsys, "check", "--series", CANDIDATE, "--against", series.base.version)
    assert rc == 0 and report["state"] == "clean", report
    assert [p["status"] for p in report["patches"]] == ["clean"] * len(series.patches)


def _body(text: str, name: str) -> str:
    start = text.index(f"    def {name}(")
    end = text.find("\n    def ", start + 1)
    return text[start:end if end > 0 else len(text)]


@pytest.mark.network
def test_the_doors_sit_where_the_session_assumes(tmp_path, persistent_cache):  # noqa: F811
    series = load_series(CANDIDATE)
    info = get_wheel(series.base.version, series.base)
    touched = {p for patch in series.patches for p in patch.touched_paths()}
    with zipfile.ZipFile(info.path) as zf:
        for path in touched:
            name = path.removeprefix("python/")
            if name in zf.namelist():
                (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / path).write_bytes(zf.read(name))
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    for patch in series.patches:
        subprocess.run(["git", "apply", str(patch.path)], cwd=tmp_path, check=True)
    srt = tmp_path / "python" / "sglang" / "srt"
    for path in series.patches[-1].touched_paths():
        compile((tmp_path / path).read_text(), path, "exec")  # the patched files still parse
    brp = (srt / "managers" / "scheduler_components" / "batch_result_processor.py").read_text()
    decode = _body(brp, "process_batch_result_decode")
    sync, door = decode.find("result.copy_done.synchronize()"), decode.find("dump_hooks.on_outputs(")
    finish_check, stream = decode.find("req.update_finish_state("), decode.find("self.output_streamer.stream_output(")
    assert 0 < sync < finish_check < door < stream, (sync, finish_check, door, stream)
    prefill = _body(brp, "process_batch_result_prefill")
    door, stream = prefill.find("dump_hooks.on_outputs("), prefill.find("self.output_streamer.stream_output(")
    assert 0 < prefill.find("req.update_finish_state()") < door < stream
    assert prefill.find("dump_hooks.on_prefill_result(") < prefill.find("req.output_ids.append(")
    copy = _body((srt / "managers" / "scheduler.py").read_text(), "_copy_result_to_cpu")
    wants, fn = copy.find("dump_hooks.wants_host_rows("), copy.find("copy_fn = partial(")
    assert 0 < wants < fn and "return_hidden_states=return_hidden_states" in copy
    assert "elif return_hidden_states or" in copy, "the async copy path would miss the rows"
    runner = (srt / "model_executor" / "model_runner.py").read_text()
    assert runner.count("dump_hooks.setup_model(self, output_rows=True)") == 1
