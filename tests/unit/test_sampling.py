"""Capture from live traffic (issue 49): KIMI_SGLANG_SAMPLE_RATE, KIMI_SGLANG_DUMP_BUDGET_GB and
KIMI_SGLANG_MIN_FREE_GB, driven through a real session and writer process with the stand-ins
of tests/standins.py (as tests/unit/test_hooks.py). The references are independent of the
code: which rids are sampled is computed here from sha256 as the contract states it, the
bytes of the files from what the files hold, the free space from a real tmpfs mount.
"""

import hashlib
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch

from sglang_ext import format as fmt
from sglang_ext.config import DumpConfig, DumpConfigError, sampling_settings
from sglang_ext.sampling import DumpPolicy

from mooncake_fixture import master_config, needs_mooncake
from standins import MULTIPROC_HTTP, Req, finish, idle, make_runner, reference, run_extend, wait_for

IDS = [2, 4]
SETTINGS = ("KIMI_SGLANG_SAMPLE_RATE", "KIMI_SGLANG_DUMP_BUDGET_GB", "KIMI_SGLANG_MIN_FREE_GB")
GIB = 1 << 30


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def sampled(rid, rate):
    """The contract: first 8 bytes of sha256(rid, UTF-8) as a fraction of 2**64, below the rate."""
    return int.from_bytes(hashlib.sha256(rid.encode()).digest()[:8], "big") < rate * 2 ** 64


def dumped_rids(dump):
    return sorted(fmt.load(str(dump / n)).metadata["rid"] for n in os.listdir(dump) if n.endswith(fmt.SUFFIX))


def asking(req, value):
    req.sampling_params = types.SimpleNamespace(custom_params={fmt.DUMP_PARAM: value})
    return req


# ---- the rate --------------------------------------------------------------------------------

def test_the_rate_samples_a_fixed_share_of_rids_and_a_retry_gets_the_same_answer(dump, sessions, clean_env):
    """Rate 0.25 over 400 rids: exactly the rids whose sha256 point is below 0.25 get a file
    (about a quarter); the others answer with no dump keys; every rid retried (a new Req,
    as a client's retry is) gets the same decision; explicit hidden_states_dump true and
    false win over the rate either way."""
    clean_env.setenv("KIMI_SGLANG_SAMPLE_RATE", "0.25")
    sess = sessions.start(make_runner(dump, layers="2,4"))
    rids = [f"live-{i}" for i in range(400)]
    want = {r for r in rids if sampled(r, 0.25)}
    assert 70 <= len(want) <= 130  # the rids are fixed: a sanity check of the reference, not luck
    reqs = [Req(r, 2, i + 1) for i, r in enumerate(rids)]
    run_extend(sess, [(r, 0, 2) for r in reqs], IDS)
    for req in reqs:
        meta = finish(req)
        if req.rid in want:
            assert torch.equal(fmt.load(meta["hidden_states_path"]).hidden_states, reference(req, IDS))
        else:
            assert meta == {}, (req.rid, meta)
    assert dumped_rids(dump) == sorted(want)
    # a retry of each of 40 rids, in another batch: the same answer
    retries = [Req(r, 2, 1000 + i) for i, r in enumerate(rids[:40])]
    run_extend(sess, [(r, 0, 2) for r in retries], IDS)
    assert [("hidden_states_path" in finish(r)) for r in retries] == [r.rid in want for r in retries]
    # explicit wins: true for a rid the rate drops, false for one it keeps
    out, kept = next(r for r in rids if r not in want), next(r for r in rids if r in want)
    forced, refused = asking(Req(out, 3, 5000), True), asking(Req(kept, 3, 5001), False)
    run_extend(sess, [(forced, 0, 3), (refused, 0, 3)], IDS)
    assert torch.equal(fmt.load(finish(forced)["hidden_states_path"]).hidden_states, reference(forced, IDS))
    assert finish(refused) == {}
    counts = sess.policy.counts
    assert counts["sampled"] == len(want) + sum(r.rid in want for r in retries) + 1
    assert counts["rate"] == 440 - counts["sampled"] + 1 and counts["budget"] == counts["disk_floor"] == 0
    assert idle(sess)["failures"] == 0


def test_rate_zero_dumps_only_requests_that_ask(dump, sessions, clean_env):
    clean_env.setenv("KIMI_SGLANG_SAMPLE_RATE", "0")
    sess = sessions.start(make_runner(dump, layers="2,4"))
    plain, asked = Req("plain", 3, 1), asking(Req("asked", 3, 2), True)
    run_extend(sess, [(plain, 0, 3), (asked, 0, 3)], IDS)
    assert finish(plain) == {}
    assert torch.equal(fmt.load(finish(asked)["hidden_states_path"]).hidden_states, reference(asked, IDS))
    assert dumped_rids(dump) == ["asked"]


# ---- the budget ------------------------------------------------------------------------------

def file_payload(path):
    """Bytes of a file's rows and token ids, from what it holds."""
    rec = fmt.load(path)
    return rec.hidden_states.numel() * rec.hidden_states.element_size() + rec.token_ids.numel() * 8


def test_files_stop_at_the_budget_with_one_log_line(dump, sessions, clean_env, caplog):
    """A budget of 1000 bytes and requests of 4 tokens (4 x (2 layers x 8 x 4 B + 8 B) = 288 B
    a file): three fit, the fourth would pass the budget and is skipped, and so is every
    sampled request after it, even one small enough to fit (one log line for all); a
    request that asks is still dumped. Chunked prefill: the decision is the first chunk's."""
    clean_env.setenv("KIMI_SGLANG_DUMP_BUDGET_GB", repr(1000 / GIB))
    sess = sessions.start(make_runner(dump, layers="2,4"))
    reqs = [Req(f"b{i}", 4, i + 1) for i in range(6)]
    with caplog.at_level("INFO", logger="sglang_ext.sampling"):
        run_extend(sess, [(r, 0, 4) for r in reqs[:2]] + [(reqs[2], 0, 2)], IDS)
        run_extend(sess, [(reqs[2], 2, 4)] + [(r, 0, 4) for r in reqs[3:]], IDS)
        small, asked = Req("small", 1, 10), asking(Req("asked", 4, 11), True)
        run_extend(sess, [(small, 0, 1), (asked, 0, 4)], IDS)
    metas = {r.rid: finish(r) for r in reqs + [small, asked]}
    assert [rid for rid, m in metas.items() if m == {}] == ["b3", "b4", "b5", "small"]
    paths = [m["hidden_states_path"] for rid, m in metas.items() if rid in ("b0", "b1", "b2")]
    assert sum(file_payload(p) for p in paths) == 3 * 288 <= 1000
    assert torch.equal(fmt.load(metas["asked"]["hidden_states_path"]).hidden_states, reference(asked, IDS))
    lines = [r.getMessage() for r in caplog.records if "budget" in r.getMessage()]
    assert len(lines) == 1 and "no longer dumped" in lines[0] and "1000 bytes" in lines[0], lines
    assert sess.policy.counts == {"sampled": 4, "rate": 0, "budget": 4, "disk_floor": 0}
    assert idle(sess)["files_written"] == 4


def test_output_requests_count_their_longest_file_until_they_end_then_what_they_wrote(dump, clean_env,
                                                                                     sessions):
    """Requests with output rows (patch 0009), prompts of 4 tokens, max_new_tokens 6, a
    budget of 1000 bytes (72 bytes a row: 2 layers x 8 x 4 B and the 8-byte token id).
    Each is admitted on the longest file it can write, 4 + 6 - 1 = 9 rows (648 B), and
    settles at its end to what it wrote: "a" stops after 1 token (a 4-row file, 288 B),
    so "b" fits (288 + 648 <= 1000) and writes 9 rows; "c" would not fit next to them
    and is skipped. Before, only the prompt counted (288 B each): "c" was admitted too and
    the files took 1584 bytes, past the budget."""
    from standins import GenReq, run_decode, run_output_prefill

    clean_env.setenv("KIMI_SGLANG_DUMP_BUDGET_GB", repr(1000 / GIB))
    sess = sessions.start(make_runner(dump, layers="2,4"), output_rows=True)
    a = GenReq("a", 4, 1, max_new_tokens=6, stops_after=1)
    run_output_prefill(sess, [(a, 0, 4)], IDS)  # "a" ends with its first token
    b, c = GenReq("b", 4, 2, max_new_tokens=6), GenReq("c", 4, 3, max_new_tokens=6)
    run_output_prefill(sess, [(b, 0, 4)], IDS)
    assert sess.policy.admitted_bytes == 288 + 648  # a settled, b's bound
    run_output_prefill(sess, [(c, 0, 4)], IDS)
    while not (b.finished() and c.finished()):
        run_decode(sess, [r for r in (b, c) if not r.finished()], IDS)
    metas = {r.rid: finish(r) for r in (a, b, c)}
    assert metas["c"] == {}, metas["c"]
    paths = [metas[rid]["hidden_states_path"] for rid in ("a", "b")]
    assert [file_payload(p) for p in paths] == [288, 648]
    for req, path in zip((a, b), paths):
        n = len(req.origin_input_ids) + len(req.output_ids) - 1
        assert torch.equal(fmt.load(path).hidden_states, reference(req, IDS, 0, n))
    run_output_prefill(sess, [(GenReq("probe", 1, 9, 1, output=False), 0, 1)], IDS)  # applies the settlements
    assert sess.policy.admitted_bytes == 288 + 648 + 0 and sess.policy.provisional_bytes == 0
    assert sess.policy.counts == {"sampled": 2, "rate": 0, "budget": 2, "disk_floor": 0}


def test_an_output_request_sglang_lets_go_of_gives_its_bound_back(dump, clean_env, sessions):
    """An output request retracted (or aborted while waiting) and then dropped by SGLang
    never ends in a batch: when its Req is collected (weakref finalizer) it gives its
    bound back, so the budget it held is free for the next one."""
    import gc

    from standins import GenReq, run_decode, run_output_prefill

    clean_env.setenv("KIMI_SGLANG_DUMP_BUDGET_GB", repr(1000 / GIB))
    sess = sessions.start(make_runner(dump, layers="2,4"), output_rows=True)
    gone = GenReq("gone", 4, 1, max_new_tokens=10)  # (4 + 9) x 72 = 936 bytes at most
    run_output_prefill(sess, [(gone, 0, 4)], IDS)
    run_decode(sess, [gone], IDS)
    assert sess.policy.admitted_bytes == 936
    del gone
    gc.collect()
    after = GenReq("after", 4, 2, max_new_tokens=10)
    run_output_prefill(sess, [(after, 0, 4)], IDS)  # fits only if "gone" gave its 936 back
    while not after.finished():
        run_decode(sess, [after], IDS)
    assert "hidden_states_path" in finish(after) and sess.policy.counts["budget"] == 0
    assert sess.writer.held_bytes() == 0


@pytest.mark.parametrize("value, rate, words", [("-0", 0.0, "rate 0"), ("-0.0e5", 0.0, "rate 0"),
                                                 ("1e-9", 1e-9, "rate 1e-09"), (" 0.25 ", 0.25, "rate 0.25")])
def test_the_rate_as_the_start_line_says_it(clean_env, value, rate, words):
    """'-0' is a rate of 0 (nothing sampled), which the start line said as 'rate -0'."""
    clean_env.setenv("KIMI_SGLANG_SAMPLE_RATE", value)
    got = sampling_settings()["sample_rate"]
    assert got == rate and str(got) == str(rate)
    assert DumpPolicy(rate=got).describe() == words


def test_the_budget_is_shared_by_the_writing_ranks(clean_env):
    clean_env.setenv("KIMI_SGLANG_DUMP_BUDGET_GB", "3")
    assert sampling_settings(writers=2)["budget_bytes"] == 3 * GIB // 2
    assert sampling_settings() == {"sample_rate": 1.0, "budget_bytes": 3 * GIB, "min_free_bytes": None}


# ---- the free-space floor ----------------------------------------------------------------------

@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs mounted for this test (root only; skipped with the reason if refused)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_below_the_free_space_floor_requests_are_skipped_until_space_is_back(small_fs, sessions, clean_env,
                                                                              monkeypatch, caplog):
    """A floor of 4 MiB on an 8 MiB tmpfs: dumped while free; a 5 MiB file put there (by
    someone else) stops dumping at the next check (at most a second later) with one
    warning, every request meanwhile answered without dump keys; the file removed,
    dumping resumes with one info line."""
    clean_env.setenv("KIMI_SGLANG_MIN_FREE_GB", repr(4 / 1024))
    monkeypatch.setenv("KIMI_SGLANG_WRITER_SPARES", "0")  # no files allocated ahead on the tmpfs
    sess = sessions.start(make_runner(small_fs, layers="2,4"))
    seq = iter(range(1, 10000))

    def one():
        req = Req(f"d{next(seq)}", 4, 1)
        run_extend(sess, [(req, 0, 4)], IDS)
        meta = finish(req)
        assert "hidden_states_error" not in meta, meta
        return "hidden_states_path" in meta

    with caplog.at_level("INFO", logger="sglang_ext.sampling"):
        assert one()
        with open(small_fs / "filler", "wb") as f:
            f.write(b"\1" * (5 << 20))
        assert wait_for(lambda: not one(), timeout=30)
        assert not any(one() for _ in range(5))
        assert sess.policy.counts["disk_floor"] >= 6
        os.unlink(small_fs / "filler")
        assert wait_for(one, timeout=30)
        assert one()
    lines = [r.getMessage() for r in caplog.records if "floor" in r.getMessage()]
    assert len(lines) == 2 and "below the floor of 4194304" in lines[0] and "above the floor again" in lines[1], lines
    assert idle(sess)["failures"] == 0


def test_a_burst_across_a_free_space_check_stays_within_the_floor(small_fs, sessions, clean_env, monkeypatch):
    """A floor of 4 MiB on an 8 MiB tmpfs, requests of 576 KiB files whose prompts come in
    two chunks: a burst of 12 first chunks, then (past the next free-space check) another
    12. The free space read at the second check does not hold the first burst's files
    (only their first rows are written), so those still count: no request of the second
    burst is admitted, every admitted file is written, and the admitted bytes stay within
    the free space less the floor, each request's own bytes counted before it is
    admitted. Before: the second check forgot the first burst, admitted 8 more and the
    tmpfs ran out (files failed with no space); then one request still crossed the floor
    (it was checked without its own bytes)."""
    clean_env.setenv("KIMI_SGLANG_MIN_FREE_GB", repr(4 / 1024))
    monkeypatch.setenv("KIMI_SGLANG_WRITER_SPARES", "0")  # no files allocated ahead on the tmpfs
    from sglang_ext import sampling
    from standins import HIDDEN

    sess = sessions.start(make_runner(small_fs, layers="2,4"))
    tokens = 8192
    file_bytes = tokens * (len(IDS) * HIDDEN * 4 + 8)  # float32 rows and int64 ids: 576 KiB
    st = os.statvfs(small_fs)
    free = st.f_bavail * st.f_frsize
    first = [Req(f"a{i}", tokens, i + 1) for i in range(12)]
    run_extend(sess, [(r, 0, 1) for r in first], IDS)
    idle(sess)  # their first rows are on the tmpfs, the rest is not
    time.sleep(sampling.DISK_CHECK_S * 1.2)  # the next request reads the free space again
    second = [Req(f"b{i}", tokens, 100 + i) for i in range(12)]
    run_extend(sess, [(r, 0, 1) for r in second], IDS)
    admitted = sess.policy.counts["sampled"]
    run_extend(sess, [(r, 1, tokens) for r in first + second], IDS)
    metas = {r.rid: finish(r, timeout=60) for r in first + second}
    assert [rid for rid, m in metas.items() if "hidden_states_error" in m] == [], metas
    written = sorted(rid for rid, m in metas.items() if "hidden_states_path" in m)
    assert len(written) == admitted
    assert 0 < admitted * file_bytes <= free - (4 << 20), (admitted, free)
    assert not any(rid.startswith("b") for rid in written), written
    idle(sess)
    assert sess.writer.unwritten_bytes() == 0  # every admitted file settled: nothing held back
    for rid in written[:2]:
        req = next(r for r in first if r.rid == rid)
        assert torch.equal(fmt.load(metas[rid]["hidden_states_path"]).hidden_states, reference(req, IDS))


def test_output_requests_in_flight_count_against_the_floor_across_a_check(small_fs, sessions, clean_env,
                                                                          monkeypatch):
    """A floor of 4 MiB on an 8 MiB tmpfs and requests with output rows whose longest file
    (prompt 4 + max_new_tokens - 1 rows) is about 2/5 of the room above the floor: two are
    admitted, the third is skipped; past the next free-space check (their rows still held
    in the host arena, nothing of them on disk) a fourth is skipped too. Both stop after
    3 tokens (6-row files): once they settled, a fifth is admitted. Before, only the
    prompt's rows counted: all were admitted."""
    from sglang_ext import sampling
    from standins import GenReq, run_decode, run_output_prefill

    clean_env.setenv("KIMI_SGLANG_MIN_FREE_GB", repr(4 / 1024))
    monkeypatch.setenv("KIMI_SGLANG_WRITER_SPARES", "0")  # no files allocated ahead on the tmpfs
    sess = sessions.start(make_runner(small_fs, layers="2,4"), output_rows=True)
    st = os.statvfs(small_fs)
    room = st.f_bavail * st.f_frsize - (4 << 20)
    max_new = int(room / 2.5) // 72 - 3  # 72 bytes a row: (4 + max_new - 1) x 72 ~ room / 2.5
    reqs = [GenReq(f"o{i}", 4, i + 1, max_new_tokens=max_new, stops_after=3) for i in range(5)]
    run_output_prefill(sess, [(r, 0, 4) for r in reqs[:3]], IDS)
    assert sess.policy.counts["sampled"] == 2 and sess.policy.counts["disk_floor"] == 1
    time.sleep(sampling.DISK_CHECK_S * 1.2)  # the next request reads the free space again
    run_output_prefill(sess, [(reqs[3], 0, 4)], IDS)
    assert sess.policy.counts["sampled"] == 2 and sess.policy.counts["disk_floor"] == 2
    while not all(r.finished() for r in reqs[:4]):
        run_decode(sess, [r for r in reqs[:4] if not r.finished()], IDS)
    metas = {r.rid: finish(r) for r in reqs[:4]}
    assert [rid for rid, m in metas.items() if "hidden_states_path" in m] == ["o0", "o1"], metas
    assert metas["o2"] == {} and metas["o3"] == {}
    run_output_prefill(sess, [(reqs[4], 0, 4)], IDS)
    while not reqs[4].finished():
        run_decode(sess, [reqs[4]], IDS)
    assert "hidden_states_path" in finish(reqs[4]) and sess.policy.counts["sampled"] == 3
    for req in (reqs[0], reqs[4]):
        rec = fmt.load(finish(req)["hidden_states_path"])
        assert torch.equal(rec.hidden_states, reference(req, IDS, 0, 6))


@needs_mooncake
def test_the_store_sink_samples_within_the_budget_and_has_no_floor(master, sessions, clean_env):
    """mooncake://: the rate and the budget apply as to files (a skipped request has no
    manifest), the floor does not (a floor no disk could meet leaves requests dumped)."""
    clean_env.setenv("KIMI_SGLANG_SAMPLE_RATE", "0.5")
    clean_env.setenv("KIMI_SGLANG_DUMP_BUDGET_GB", repr(2 * 288 / GIB))
    clean_env.setenv("KIMI_SGLANG_MIN_FREE_GB", "1e9")
    sess = sessions.start(make_runner(master_config(master), layers="2,4"))
    rids = [f"s{i}" for i in range(12)]
    want = [r for r in rids if sampled(r, 0.5)][:2]
    assert len(want) == 2
    reqs = [Req(r, 4, i + 1) for i, r in enumerate(rids)]
    run_extend(sess, [(r, 0, 4) for r in reqs], IDS)
    assert [r.rid for r in reqs if "hidden_states_manifest" in finish(r)] == want
    assert all(finish(r) == {} for r in reqs if r.rid not in want)
    assert idle(sess)["files_written"] == 2 and sess.policy.counts["disk_floor"] == 0


# ---- bad values at start ----------------------------------------------------------------------

@pytest.mark.parametrize("name, value, words", [
    ("KIMI_SGLANG_SAMPLE_RATE", "1.5", "a number from 0 to 1"),
    ("KIMI_SGLANG_SAMPLE_RATE", "-0.1", "a number from 0 to 1"),
    ("KIMI_SGLANG_SAMPLE_RATE", "nan", "a number from 0 to 1"),
    ("KIMI_SGLANG_SAMPLE_RATE", "10%", "a number from 0 to 1"),
    ("KIMI_SGLANG_SAMPLE_RATE", "\u0660.5", "a number from 0 to 1"),  # Arabic-Indic 0
    ("KIMI_SGLANG_DUMP_BUDGET_GB", "-1", "must be >= 0 GiB"),
    ("KIMI_SGLANG_DUMP_BUDGET_GB", "inf", "must be a finite number of GiB"),
    ("KIMI_SGLANG_DUMP_BUDGET_GB", "10G", "must be a finite number of GiB"),
    ("KIMI_SGLANG_MIN_FREE_GB", "-5", "must be >= 0 GiB"),
    ("KIMI_SGLANG_MIN_FREE_GB", "1_0", "must be a finite number of GiB"),
    # past 2**63 bytes (8 EiB, the largest file offset): GiB * 2**30 overflowed float to inf
    # and int(inf) raised OverflowError, a traceback at start-up
    ("KIMI_SGLANG_DUMP_BUDGET_GB", "1e300", "must be at most 8589934592 GiB"),
    ("KIMI_SGLANG_MIN_FREE_GB", "1e300", "must be at most 8589934592 GiB"),
])
def test_a_bad_value_stops_the_start_with_one_sentence_naming_it(dump, clean_env, name, value, words):
    clean_env.setenv(name, value)
    args = types.SimpleNamespace(dump_hidden_states_dir=str(dump), dump_hidden_states_max_host_mb=64,
                                 dump_hidden_states_layers=None, dump_hidden_states_dtype=None)
    with pytest.raises(DumpConfigError) as e:
        DumpConfig.from_server_args(args)
    msg = str(e.value)
    assert msg.startswith(f"{name} ") and words in msg and repr(value) in msg and "\n" not in msg, msg


def test_a_floor_no_dump_directory_could_meet_stops_the_start(dump, clean_env):
    """A floor at or above the size of the dump directory's file system (a typo, MiB for
    GiB, or a tmpfs smaller than thought) would skip every sampled request for good: one
    sentence at start-up naming the variable and the size, where it started and dumped
    nothing (the store sink has no floor: test_the_store_sink_samples_within_...)."""
    st = os.statvfs(dump)
    size = st.f_blocks * st.f_frsize
    args = types.SimpleNamespace(dump_hidden_states_dir=str(dump), dump_hidden_states_max_host_mb=64,
                                 dump_hidden_states_layers=None, dump_hidden_states_dtype=None)
    for value in (repr(size / GIB), "1e9"):
        clean_env.setenv("KIMI_SGLANG_MIN_FREE_GB", value)
        with pytest.raises(DumpConfigError) as e:
            DumpConfig.from_server_args(args)
        msg = str(e.value)
        assert msg.startswith(f"KIMI_SGLANG_MIN_FREE_GB {value!r} is not below the size of the dump "
                              f"directory's file system ({size} bytes)"), msg
        assert "\n" not in msg
    clean_env.setenv("KIMI_SGLANG_MIN_FREE_GB", repr((size - 4096) / GIB))
    assert DumpConfig.from_server_args(args).min_free_bytes == size - 4096


# ---- Prometheus --------------------------------------------------------------------------------

SCHEDULER = textwrap.dedent(r"""
    import sys
    sys.path.insert(0, sys.argv[2])
    from standins import Req, finish, make_runner, run_extend
    from sglang_ext.session import DumpSession
    runner = make_runner(sys.argv[1], layers="2,4")
    runner.server_args.enable_metrics = True
    sess = DumpSession.start(runner)
    reqs = [Req(f"p{i}", 4, i + 1) for i in range(40)]
    run_extend(sess, [(r, 0, 4) for r in reqs], [2, 4])
    print(sum("hidden_states_path" in finish(r) for r in reqs))
    assert sess.close(10)
""")


def test_the_counters_reach_sglangs_multiprocess_registry(dump, tmp_path):
    """A scheduler process with --enable-metrics (PROMETHEUS_MULTIPROC_DIR set, as SGLang
    sets it) samples 40 rids at rate 0.5 within a budget of 3 files: what SGLang's
    /metrics collector reads is kimi_sglang:dump_requests_sampled_total and
    ..._skipped_total by reason, with the model_name label."""
    pytest.importorskip("prometheus_client")
    prom = tmp_path / "prom"
    prom.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(prom), KIMI_SGLANG_SAMPLE_RATE="0.5",
               KIMI_SGLANG_DUMP_BUDGET_GB=repr(3 * 288 / GIB))
    tests = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", SCHEDULER, str(dump), tests], env=env, check=True,
                         capture_output=True, text=True).stdout
    assert int(out) == 3
    text = subprocess.run([sys.executable, "-c", MULTIPROC_HTTP], env=env, check=True, capture_output=True,
                          text=True).stdout
    values = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
              if ln.startswith("kimi_sglang:dump_requests")}
    by_rate = sum(sampled(f"p{i}", 0.5) for i in range(40))
    label = 'model_name="/models/tiny"'
    assert values == {
        f"kimi_sglang:dump_requests_sampled_total{{{label}}}": 3.0,
        f'kimi_sglang:dump_requests_skipped_total{{{label},reason="rate"}}': float(40 - by_rate),
        f'kimi_sglang:dump_requests_skipped_total{{{label},reason="budget"}}': float(by_rate - 3),
        f'kimi_sglang:dump_requests_skipped_total{{{label},reason="disk_floor"}}': 0.0,
    }, values


def test_unsettled_output_bounds_skip_a_request_without_spending_the_budget():
    """A budget of 1000 bytes: an output request admitted on its bound of 800 makes a
    300-byte request not fit, which is skipped alone; once the output request settles to
    the 100 bytes it wrote, the next 300-byte request fits (before, the budget was marked
    spent for good at the first skip, with its warning)."""
    policy = DumpPolicy(budget_bytes=1000)
    assert policy.admit("out", None, 800, provisional=True)
    assert not policy.admit("p1", None, 300)
    policy.settle(800, 100)
    assert policy.admit("p2", None, 300) and policy.admitted_bytes == 400
    assert not policy.admit("p3", None, 700)  # 400 that stay + 700: spent for good
    assert not policy.admit("p4", None, 10)
    assert policy.counts == {"sampled": 2, "rate": 0, "budget": 3, "disk_floor": 0}


def test_an_output_request_whose_own_bound_passes_the_budget_is_skipped_alone(dump, clean_env, sessions,
                                                                               caplog):
    """A budget of 1000 bytes, nothing dumped yet: an output request of a 4-token prompt
    with max_new_tokens 100 may write (4 + 99) x 72 = 7416 bytes, so it is skipped; its
    bound is an upper bound, not bytes that stay, so the budget is not spent: a 4-token
    prompt-only request after it (288 B) is dumped, and no 'spent' line is logged. Before,
    the skip marked the budget spent for good with 0 bytes admitted, and every sampled
    request after it was skipped."""
    from standins import GenReq, run_output_prefill

    clean_env.setenv("KIMI_SGLANG_DUMP_BUDGET_GB", repr(1000 / GIB))
    sess = sessions.start(make_runner(dump, layers="2,4"), output_rows=True)
    long = GenReq("long", 4, 1, max_new_tokens=100)
    plain = GenReq("plain", 4, 2, max_new_tokens=3, output=False)
    with caplog.at_level("INFO", logger="sglang_ext.sampling"):
        run_output_prefill(sess, [(long, 0, 4)], IDS)
        run_output_prefill(sess, [(plain, 0, 4)], IDS)
    assert finish(long) == {}
    meta = finish(plain)
    assert "hidden_states_path" in meta, meta
    assert torch.equal(fmt.load(meta["hidden_states_path"]).hidden_states, reference(plain, IDS))
    assert file_payload(meta["hidden_states_path"]) == 288
    assert [r.getMessage() for r in caplog.records if "budget" in r.getMessage()] == []
    assert sess.policy.counts == {"sampled": 1, "rate": 0, "budget": 1, "disk_floor": 0}
