"""The kimi-sglang entrypoint's command building (no GPU, no SGLang needed)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ext.tools import entrypoint as ep

REPO = Path(__file__).resolve().parents[2]
SM120x8 = ["12.0"] * 8
SM90x8 = ["9.0"] * 8


def build(argv, env=None, caps=SM120x8):
    return ep.build_launch(argv, environ=env or {}, compute_caps=caps, python="python3")


def opt(argv, flag):
    """Values given for `flag` in argv (every occurrence)."""
    return [argv[i + 1] for i, t in enumerate(argv) if t == flag]


def test_defaults_on_sm120():
    launch = build([])
    a = launch.argv
    assert a[:3] == ["python3", "-m", "sglang.launch_server"]
    assert opt(a, "--model-path") == ["/models/Kimi-K2.5"]
    assert opt(a, "--tp-size") == ["8"]
    assert "--trust-remote-code" in a
    assert opt(a, "--tool-call-parser") == ["kimi_k2"]
    assert opt(a, "--reasoning-parser") == ["kimi_k2"]
    assert opt(a, "--host") == ["0.0.0.0"]
    assert opt(a, "--port") == ["30000"]
    assert opt(a, "--attention-backend") == ["triton"]
    assert "--disable-custom-all-reduce" in a
    assert launch.profile_env == {
        "NCCL_P2P_DISABLE": "1",
        "NCCL_CUMEM_ENABLE": "0",
        "NCCL_CUMEM_HOST_ENABLE": "0",
        "NVCC_APPEND_FLAGS": "--split-compile=8",
    }
    assert launch.env["NCCL_P2P_DISABLE"] == "1"
    assert launch.applied == ["kimi-k25", "sm120"]
    assert launch.warnings == []


def test_sm90_gets_no_sm120_profile():
    launch = build([], caps=SM90x8)
    assert launch.applied == ["kimi-k25"]
    assert "--attention-backend" not in launch.argv
    assert "--disable-custom-all-reduce" not in launch.argv
    assert launch.profile_env == {"NVCC_APPEND_FLAGS": "--split-compile=8"}  # kimi-k25's, on every GPU
    assert "NCCL_P2P_DISABLE" not in launch.env
    assert opt(launch.argv, "--tp-size") == ["8"]


def test_mixed_gpus_are_not_sm120():
    assert build([], caps=["12.0", "9.0"]).applied == ["kimi-k25"]


@pytest.mark.parametrize(
    "user, flag, expected",
    [
        (["--attention-backend", "flashinfer"], "--attention-backend", ["flashinfer"]),
        (["--attention-backend=flashinfer"], "--attention-backend", []),
        (["--tp", "4"], "--tp", ["4"]),
        (["--tensor-parallel-size", "4"], "--tensor-parallel-size", ["4"]),
        (["--model", "/models/other"], "--model", ["/models/other"]),
        (["--port", "8000"], "--port", ["8000"]),
    ],
)
def test_user_flag_replaces_default(user, flag, expected):
    a = build(user).argv
    assert a[-len(user):] == user  # the user's args, as given, at the end
    assert opt(a, flag) == expected
    # The default under any of its spellings is gone.
    default_flag = {
        "--attention-backend": "--attention-backend",
        "--tp": "--tp-size",
        "--tensor-parallel-size": "--tp-size",
        "--model": "--model-path",
        "--port": "--port",
    }[flag]
    if default_flag != flag:
        assert default_flag not in a
    assert a.count(flag) + sum(t.startswith(flag + "=") for t in a) == 1


def test_user_env_wins_over_profile_env():
    launch = build([], env={"NCCL_P2P_DISABLE": "0", "PATH": "/usr/bin", "NVCC_APPEND_FLAGS": "-lineinfo"})
    assert launch.env["NVCC_APPEND_FLAGS"] == "-lineinfo"
    assert launch.env["NCCL_P2P_DISABLE"] == "0"
    assert launch.profile_env["NCCL_P2P_DISABLE"] == "0"
    assert launch.env["NCCL_CUMEM_ENABLE"] == "0"
    assert launch.env["PATH"] == "/usr/bin"


def test_env_knobs():
    launch = build([], env={"KIMI_SGLANG_MODEL": "/m/k", "KIMI_SGLANG_PORT": "31000", "KIMI_SGLANG_GPU_COUNT": "4"})
    assert opt(launch.argv, "--model-path") == ["/m/k"]
    assert opt(launch.argv, "--port") == ["31000"]
    assert opt(launch.argv, "--tp-size") == ["4"]


def test_compute_cap_from_env_and_nvidia_smi():
    ctx = ep.make_context({"KIMI_SGLANG_COMPUTE_CAP": "12.0,12.0"})
    assert ctx.is_sm120 and ctx.gpu_count == 2

    def smi(cmd):
        assert cmd == ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]
        return "12.0\n12.0\n9.0\n12.0\n"

    assert ep.detect_compute_caps({}, runner=smi) == ("12.0", "12.0", "9.0", "12.0")
    ctx = ep.make_context({"CUDA_VISIBLE_DEVICES": "0,3"}, runner=smi)
    assert ctx.compute_caps == ("12.0", "12.0") and ctx.is_sm120 and ctx.gpu_count == 2

    def broken(cmd):
        raise subprocess.CalledProcessError(9, cmd)

    ctx = ep.make_context({}, runner=broken)
    assert ctx.compute_caps == () and not ctx.is_sm120 and ctx.gpu_count is None


def test_no_gpu_leaves_tp_to_sglang():
    launch = build([], caps=[])
    assert "--tp-size" not in launch.argv
    assert any("no GPU compute capability" in w for w in launch.warnings)


@pytest.mark.parametrize("how", [["--no-profile", "sm120"], ["--no-profile=sm120"], "env"])
def test_profile_can_be_switched_off(how):
    if how == "env":
        launch = build(["--x"], env={"KIMI_SGLANG_NO_PROFILE": "sm120"})
    else:
        launch = build([*how, "--x"])
    assert launch.applied == ["kimi-k25"]
    assert "--attention-backend" not in launch.argv
    assert "--no-profile" not in " ".join(launch.argv)
    assert launch.argv[-1] == "--x"


def test_all_profiles_off_and_no_default():
    launch = build(["--no-profile", "sm120,kimi-k25", "--model-path", "/m"])
    assert launch.argv == ["python3", "-m", "sglang.launch_server", "--model-path", "/m"]
    launch = build(["--no-default", "--disable-custom-all-reduce"])
    assert "--disable-custom-all-reduce" not in launch.argv
    assert "--attention-backend" in launch.argv


def test_unknown_profile_is_an_error():
    with pytest.raises(SystemExit, match="unknown profile"):
        build(["--no-profile", "nope"])


@pytest.mark.parametrize("flag", ep.ATTENTION_FLAGS)
@pytest.mark.parametrize("backend, cite", [("trtllm_mla", "24633"), ("fa3", "12178")])
def test_bad_backend_on_sm120_warns_but_user_wins(flag, backend, cite):
    launch = build([flag, backend])
    assert launch.argv[-2:] == [flag, backend]
    assert len(launch.warnings) == 1 and backend in launch.warnings[0] and cite in launch.warnings[0]
    assert build([flag, backend], caps=SM90x8).warnings == []


def test_dump_dir_is_found():
    assert build(["--dump-hidden-states-dir", "/dev/shm/hs"]).dump_dir == "/dev/shm/hs"
    assert build(["--dump-hidden-states-dir=/x"]).dump_dir == "/x"
    assert build([]).dump_dir is None


def test_a_dump_dir_flag_without_its_value_makes_no_directory_named_after_the_next_flag():
    """`--dump-hidden-states-dir --port 8000` (the value forgotten): argparse takes no
    value that starts with '-' and refuses the line, but the entrypoint took '--port' as
    the directory and made ./--port before SGLang said so. Given twice, the last wins
    (as in argparse), in either spelling."""
    assert build(["--dump-hidden-states-dir", "--port", "8000"]).dump_dir is None
    assert build(["--dump-hidden-states-dir", "-v"]).dump_dir is None
    assert build(["--dump-hidden-states-dir=/a", "--dump-hidden-states-dir", "/b"]).dump_dir == "/b"
    assert build(["--dump-hidden-states-dir", "/a", "--dump-hidden-states-dir=/b"]).dump_dir == "/b"


def run_cli(args, env_extra, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KIMI_SGLANG_", "NCCL_"))}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "sglang_ext.tools.entrypoint", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )


def test_print_command_cli(tmp_path):
    dump = tmp_path / "hs"
    r = run_cli(
        ["--print-command", "--attention-backend", "flashinfer", "--dump-hidden-states-dir", str(dump)],
        {"KIMI_SGLANG_COMPUTE_CAP": ",".join(SM120x8)},
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "# kimi-sglang: profiles applied: kimi-k25, sm120"
    words = shlex.split(lines[1])
    assert words[:5] == ["env", "NCCL_CUMEM_ENABLE=0", "NCCL_CUMEM_HOST_ENABLE=0", "NCCL_P2P_DISABLE=1",
                         "NVCC_APPEND_FLAGS=--split-compile=8"]
    assert words[6:8] == ["-m", "sglang.launch_server"]
    assert opt(words, "--attention-backend") == ["flashinfer"]
    assert "--print-command" not in words
    assert not dump.exists()  # --print-command has no side effects


def test_exec_builds_dump_dir_and_runs_command(tmp_path):
    """The exec path: fake `python` on PATH stands in for sglang.launch_server."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    out = tmp_path / "argv"
    fake = bin_dir / "fakepy"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {out}\necho "P2P=$NCCL_P2P_DISABLE" >> {out}\n')
    fake.chmod(0o755)
    dump = tmp_path / "deep" / "hs"
    code = (
        "import sys; from sglang_ext.tools import entrypoint as ep; "
        f"orig = ep.build_launch; ep.build_launch = lambda a: orig(a, python={str(fake)!r}); "
        "sys.exit(ep.main(sys.argv[1:]))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KIMI_SGLANG_", "NCCL_"))}
    env["KIMI_SGLANG_COMPUTE_CAP"] = "12.0,12.0"
    r = subprocess.run(
        [sys.executable, "-c", code, "--dump-hidden-states-dir", str(dump)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert dump.is_dir()
    got = out.read_text().splitlines()
    assert got[:2] == ["-m", "sglang.launch_server"]
    assert "--dump-hidden-states-dir" in got and "--disable-custom-all-reduce" in got
    assert got[-1] == "P2P=1"


def test_executable_first_arg_passes_through(tmp_path):
    r = run_cli(["sh", "-c", 'echo "args:$0 $1"', "a0", "a1"], {}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "args:a0 a1"
    r = run_cli(["python3", "-c", "import sys; print(sys.argv[1:])", "--attention-backend", "x"], {}, tmp_path)
    assert r.stdout.strip() == "['--attention-backend', 'x']"


def test_console_script_declared():
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["kimi-sglang"] == "sglang_ext.tools.entrypoint:main"


@pytest.mark.parametrize("env", [{"KIMI_SGLANG_GPU_COUNT": "abc"}, {"KIMI_SGLANG_GPU_COUNT": "0"},
                                 {"KIMI_SGLANG_PORT": "abc"}, {"KIMI_SGLANG_PORT": "70000"}])
def test_bad_environment_values_are_refused_with_a_message(env):
    with pytest.raises(SystemExit, match="must be a"):
        ep.make_context({"KIMI_SGLANG_COMPUTE_CAP": "9.0", **env})


def test_help_is_ours_and_points_to_sglangs(tmp_path):
    r = run_cli(["--help"], {}, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("usage: kimi-sglang") and len(lines) < 60
    for needed in ("--print-command", "--no-profile NAME", "--no-default FLAG", "--help-sglang",
                   "--dump-hidden-states-dir DIR", "--dump-hidden-states-layers",
                   "--dump-hidden-states-max-host-mb", "KIMI_SGLANG_MODEL", "KIMI_SGLANG_PORT",
                   "KIMI_SGLANG_GPU_COUNT", "KIMI_SGLANG_COMPUTE_CAP", "KIMI_SGLANG_NO_PROFILE",
                   "kimi-k25", "sm120", "NCCL_P2P_DISABLE=1"):
        assert needed in r.stdout, needed
    # every default flag of every profile, spelled as SGLang takes it
    for flag in ("--model-path", "--tp-size", "--trust-remote-code", "--tool-call-parser kimi_k2",
                 "--reasoning-parser kimi_k2", "--host 0.0.0.0", "--port", "--attention-backend triton",
                 "--disable-custom-all-reduce"):
        assert f"    {flag}" in r.stdout, flag
    assert lines[-1] == "SGLang's own flags: kimi-sglang --help-sglang (or python -m sglang.launch_server --help)"
    assert "--enable-return-hidden-states" not in r.stdout  # none of SGLang's own help
    assert run_cli(["-h"], {}, tmp_path).stdout == r.stdout


def test_help_sglang_runs_sglangs_own_help(monkeypatch):
    seen = []

    def fake_exec(file, args):
        seen.append(args)
        raise SystemExit(0)

    monkeypatch.setattr(ep.os, "execvp", fake_exec)
    with pytest.raises(SystemExit):
        ep.main(["--help-sglang"])
    assert seen == [[sys.executable, "-m", "sglang.launch_server", "--help"]]


@pytest.mark.parametrize("caps", ["abc", "12.0,x", "12", ",,"])
def test_bad_compute_cap_names_the_variable(caps):
    with pytest.raises(SystemExit, match=r"KIMI_SGLANG_COMPUTE_CAP must be a comma list of compute "
                                         r"capabilities, one per GPU \(e\.g\. 12\.0,12\.0\), got"):
        ep.make_context({"KIMI_SGLANG_COMPUTE_CAP": caps})


def test_no_default_must_name_a_default_flag():
    with pytest.raises(SystemExit, match=r"--no-default --bogus: not a default flag of any profile"):
        build(["--no-default", "--bogus"])
    with pytest.raises(SystemExit, match=r"--no-default tp-size: not a default flag"):
        build(["--no-default=tp-size"])
    launch = build(["--no-default", "--tp"])  # any spelling of a default counts
    assert "--tp-size" not in launch.argv and "--model-path" in launch.argv


@pytest.mark.parametrize("make_bad", [
    lambda tmp: tmp / "afile",            # an existing file: FileExistsError
    lambda tmp: tmp / "afile" / "below",  # below a file: NotADirectoryError
    lambda tmp: Path("/proc/kimi-sglang-no-such-dir"),  # mkdir refused: FileNotFoundError
], ids=["file", "below-file", "proc"])
def test_unusable_dump_dir_is_one_sentence_and_exit_2(tmp_path, make_bad, capsys, monkeypatch):
    monkeypatch.setenv("KIMI_SGLANG_COMPUTE_CAP", "9.0")
    (tmp_path / "afile").write_text("x")
    bad = make_bad(tmp_path)
    code = ep.main(["--dump-hidden-states-dir", str(bad)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"--dump-hidden-states-dir {bad}: cannot make the directory" in err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("kimi-sglang: --dump")
    assert (tmp_path / "afile").read_text() == "x"


# ---- settings: one sentence each, ASCII digits only, sane ranges (issue 36, item 10) ----

@pytest.mark.parametrize("name, value, words", [
    ("KIMI_SGLANG_GPU_COUNT", "\u0663", "a whole number of GPUs from 1 to 64"),  # Arabic-Indic 3
    ("KIMI_SGLANG_GPU_COUNT", "\uff18", "a whole number of GPUs from 1 to 64"),  # fullwidth 8
    ("KIMI_SGLANG_GPU_COUNT", "\u00b2", "a whole number of GPUs from 1 to 64"),  # superscript 2
    ("KIMI_SGLANG_GPU_COUNT", "65", "a whole number of GPUs from 1 to 64"),
    ("KIMI_SGLANG_GPU_COUNT", "100000000000000000000", "a whole number of GPUs from 1 to 64"),
    ("KIMI_SGLANG_GPU_COUNT", "-1", "a whole number of GPUs from 1 to 64"),
    ("KIMI_SGLANG_PORT", "\uff13\uff10\uff10\uff10\uff10", "a TCP port number from 1 to 65535"),
    ("KIMI_SGLANG_PORT", "\u0663\u0660\u0660\u0660\u0660", "a TCP port number from 1 to 65535"),
    ("KIMI_SGLANG_PORT", "\u00b2", "a TCP port number from 1 to 65535"),
    ("KIMI_SGLANG_PORT", "0", "a TCP port number from 1 to 65535"),
    ("KIMI_SGLANG_COMPUTE_CAP", "\uff11\uff12.\uff10", "a comma list of compute capabilities"),
    ("KIMI_SGLANG_COMPUTE_CAP", ",".join(["12.0"] * 65), "at most 64"),
])
def test_bad_setting_is_one_sentence_naming_it(name, value, words):
    env = {"KIMI_SGLANG_COMPUTE_CAP": "9.0", name: value}
    with pytest.raises(SystemExit) as e:
        ep.make_context(env)
    msg = str(e.value.code)
    assert msg.startswith(f"kimi-sglang: {name} must be ") and words in msg, msg
    assert repr(value) in msg or name == "KIMI_SGLANG_COMPUTE_CAP"
    assert "\n" not in msg


def test_ascii_settings_still_work_and_port_is_normalised():
    ctx = ep.make_context({"KIMI_SGLANG_COMPUTE_CAP": "9.0", "KIMI_SGLANG_GPU_COUNT": " 64 ",
                           "KIMI_SGLANG_PORT": "030000"})
    assert (ctx.gpu_count, ctx.port) == (64, "30000")
    assert ep.make_context({"KIMI_SGLANG_COMPUTE_CAP": "10.0,10.0", "KIMI_SGLANG_PORT": "65535"}).port == "65535"


def test_cuda_visible_devices_with_non_ascii_digits_keeps_the_count():
    # '\u00b2'.isdigit() is True but int('\u00b2') raises: such ids are not indices.
    ctx = ep.make_context({"CUDA_VISIBLE_DEVICES": "\u00b2,\u0663"}, runner=lambda cmd: "12.0\n9.0\n9.0\n")
    assert ctx.compute_caps == ("12.0", "9.0") and ctx.gpu_count == 2


# ---- the dump directory the entrypoint makes or is given (issue 36, item 6) ----

def exec_main(tmp_path, dump, umask=0o022):
    """Run ep.main in a child (its exec goes to a fake python that records its argv)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    out = tmp_path / "argv"
    fake = bin_dir / "fakepy"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {out}\n')
    fake.chmod(0o755)
    code = (
        f"import os, sys; os.umask({umask}); from sglang_ext.tools import entrypoint as ep; "
        f"orig = ep.build_launch; ep.build_launch = lambda a: orig(a, python={str(fake)!r}); "
        "sys.exit(ep.main(sys.argv[1:]))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KIMI_SGLANG_", "NCCL_"))}
    env["KIMI_SGLANG_COMPUTE_CAP"] = "9.0"
    r = subprocess.run([sys.executable, "-c", code, "--dump-hidden-states-dir", str(dump)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    return r, out


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o000])
def test_dump_dir_is_made_0700(tmp_path, umask):
    dump = tmp_path / "deep" / "hs"
    r, out = exec_main(tmp_path, dump, umask)
    assert r.returncode == 0, r.stderr
    assert oct(dump.stat().st_mode & 0o7777) == oct(0o700)
    assert out.read_text().splitlines()[:2] == ["-m", "sglang.launch_server"]


@pytest.mark.parametrize("mode, ok", [(0o777, False), (0o775, False), (0o1777, True), (0o755, True)])
def test_existing_dump_dir_writable_by_others_is_refused(tmp_path, mode, ok):
    dump = tmp_path / "hs"
    dump.mkdir()
    dump.chmod(mode)
    r, out = exec_main(tmp_path, dump)
    if ok:
        assert r.returncode == 0, r.stderr
        assert out.exists()
        return
    assert r.returncode == 2 and not out.exists()
    err = r.stderr.strip().splitlines()
    assert err[-1] == (f"kimi-sglang: --dump-hidden-states-dir: {str(dump)!r} is writable by group or "
                       f"others (mode {mode:04o}) without the sticky bit, so they could replace its "
                       f"dumps; chmod go-w {dump} (or chmod +t for a shared directory)"), r.stderr
    assert "Traceback" not in r.stderr


def test_existing_dump_dir_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root (CI runs the tests as root)")
    dump = tmp_path / "hs"
    dump.mkdir(mode=0o700)
    os.chown(dump, 65534, 65534)
    r, out = exec_main(tmp_path, dump)
    assert r.returncode == 2 and not out.exists()
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"kimi-sglang: --dump-hidden-states-dir: {str(dump)!r} is owned by uid 65534, not by this "
        f"server's user (uid 0)"), r.stderr
    assert "Traceback" not in r.stderr


def test_a_store_address_is_no_directory_and_a_bad_one_is_one_sentence(tmp_path, monkeypatch, capsys):
    """mooncake://... (the store sink) is parsed, never made or chmod-ed; a bad one is one
    sentence and exit status 2."""
    monkeypatch.chdir(tmp_path)
    assert ep.prepare_dump_dir("mooncake://127.0.0.1:50051?protocol=tcp&global_segment_size=1GiB") == 0
    assert list(tmp_path.iterdir()) == []
    assert ep.prepare_dump_dir("mooncake://127.0.0.1:50051?colour=red") == 2
    err = capsys.readouterr().err
    assert err.startswith("kimi-sglang: --dump-hidden-states-dir: unknown mooncake setting 'colour'")
    assert err.count("\n") == 1 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("pad", [" {}", "{} ", "{}\n", "\t{}"], ids=["lead", "trail", "newline", "tab"])
@pytest.mark.parametrize("target", ["dir", "store"])
def test_a_whitespace_padded_dump_dir_is_refused_and_nothing_made(tmp_path, monkeypatch, capsys, pad, target):
    """' /data/hs' (a quoting slip in a compose file or a shell variable) named a relative
    directory ' ' under the working directory: the entrypoint made ./ /data/hs and the
    server dumped into the container's own file system; ' mooncake://...' too. Now one
    sentence, exit status 2, nothing made; the server's own check says the same."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    value = pad.format(str(tmp_path / "hs") if target == "dir" else "mooncake://127.0.0.1:50051")

    def unmade_then_made():  # the entrypoint made no /hs either; the server is given one
        assert not (tmp_path / "hs").exists()
        (tmp_path / "hs").mkdir(mode=0o700)

    _refused_by_entrypoint_and_server_alike(
        value, work, capsys, "check_directory",
        f"--dump-hidden-states-dir: {value!r} begins or ends with whitespace, which names another "
        f"directory than meant; remove it", before_server=unmade_then_made)


def _refused_by_entrypoint_and_server_alike(value, work, capsys, server_check, sentence, before_server=None):
    """``prepare_dump_dir(value)`` is exit status 2 with ``kimi-sglang: <sentence>`` alone on
    stderr and makes nothing (``work``, the working directory, stays empty); the server's
    own check (``config.<server_check>``, after
    ``before_server``) raises ``DumpConfigError`` with the same sentence."""
    from sglang_ext import config

    assert ep.prepare_dump_dir(value) == 2
    err = capsys.readouterr().err
    assert err == f"kimi-sglang: {sentence}\n"
    assert list(work.iterdir()) == []
    if before_server is not None:
        before_server()
    with pytest.raises(config.DumpConfigError) as e:
        getattr(config, server_check)(value)
    assert f"kimi-sglang: {e.value}\n" == err


SGLANG_PARSE = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
argv = ConfigArgumentMerger(parser).merge_config_with_args(sys.argv[1:])  # as prepare_server_args
ns = parser.parse_known_args(argv)[0]
print(json.dumps({k: getattr(ns, k) for k in ("model_path", "tp_size", "port", "trust_remote_code", "host")}))
"""


def test_settings_in_the_users_config_file_win_over_the_profiles_defaults(tmp_path):
    """`--config server.yaml` (SGLang's YAML of server flags): SGLang puts the file's flags
    before the command line's, so the command line wins; the profiles' defaults are on the
    command line, so they replaced the user's own model, TP size, port and
    trust-remote-code: false. A key of the file (any spelling) is a flag the user gave.
    Checked with SGLang's own merger and parser on the command built."""
    cfg = tmp_path / "server.yaml"
    cfg.write_text("model: /models/other\ntensor-parallel-size: 4\nport: 8000\ntrust_remote_code: false\n")
    launch = build(["--config", str(cfg)], caps=SM90x8)
    r = subprocess.run([sys.executable, "-c", SGLANG_PARSE, *launch.argv[3:]],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"model_path": "/models/other", "tp_size": 4, "port": 8000, "trust_remote_code": False,
                   "host": "0.0.0.0"}, (launch.argv, got)
    # the command line still wins over the file, and the file's dump directory is made
    launch = build(["--port", "9000", "--config", str(cfg)], caps=SM90x8)
    assert opt(launch.argv, "--port") == ["9000"] and "--tp-size" not in launch.argv
    cfg.write_text(f"dump-hidden-states-dir: {tmp_path / 'hs'}\n")
    assert build(["--config", str(cfg)]).dump_dir == str(tmp_path / "hs")
    assert build(["--config", str(cfg), "--dump-hidden-states-dir", "/x"]).dump_dir == "/x"


def test_a_dangling_symlink_dump_dir_is_named_as_one_and_its_target_not_made(tmp_path, capsys, monkeypatch):
    """A dump directory that is a symbolic link to where nothing is (an NFS mount not
    mounted yet): the sentence said 'it is a file'. It names the link and its target now,
    and makes neither (making the target would put the dumps on the local disk)."""
    monkeypatch.setenv("KIMI_SGLANG_COMPUTE_CAP", "9.0")
    target = tmp_path / "mnt" / "nfs" / "hs"
    link = tmp_path / "hs"
    link.symlink_to(target)
    assert ep.main(["--dump-hidden-states-dir", str(link)]) == 2
    err = capsys.readouterr().err
    assert err == (f"kimi-sglang: --dump-hidden-states-dir {link}: cannot make the directory (it is a "
                   f"symbolic link to {target}, which does not exist: mount or make that first)\n")
    assert not (tmp_path / "mnt").exists() and link.is_symlink()


def test_a_port_flag_the_healthcheck_does_not_probe_is_warned_of():
    """The image's HEALTHCHECK probes $KIMI_SGLANG_PORT; `--port 8000` alone left it
    probing 30000, so the container turned unhealthy after its start period with no word
    why. One warning line now names both ports and the fix; none when they agree."""
    want = ("kimi-sglang: WARNING: --port 8000 is not KIMI_SGLANG_PORT (30000), the port the image's "
            "HEALTHCHECK probes, so the container will be reported unhealthy; give -e KIMI_SGLANG_PORT=8000 "
            "instead of --port")
    assert build(["--port", "8000"]).warnings == [want]
    assert build(["--port=8000"]).warnings == [want]
    assert build(["--port", "30000"]).warnings == []
    assert build(["--port", "8000"], env={"KIMI_SGLANG_PORT": "8000"}).warnings == []
    assert build([]).warnings == []


def test_a_blank_or_padded_model_path_is_refused_or_defaulted():
    """KIMI_SGLANG_MODEL as the port and GPU count: blank is unset (the default), where
    '  ' went to SGLang as the model path; padded (' /models/x', a quoting slip) is one
    sentence, where it went on as a path no one has. Spaces inside a path stay."""
    assert ep.make_context({"KIMI_SGLANG_MODEL": "   "}, ()).model == ep.DEFAULT_MODEL
    assert ep.make_context({"KIMI_SGLANG_MODEL": "/models/My Model"}, ()).model == "/models/My Model"
    for bad in (" /models/x", "/models/x\n"):
        with pytest.raises(SystemExit) as e:
            ep.make_context({"KIMI_SGLANG_MODEL": bad}, ())
        assert str(e.value.code) == (f"kimi-sglang: KIMI_SGLANG_MODEL must be a model path or name without "
                                     f"whitespace around it, got {bad!r}")


@pytest.mark.parametrize("value", ["~/hs", "~", "~root/hs"])
def test_an_unexpanded_home_in_the_dump_dir_is_refused_and_nothing_made(tmp_path, monkeypatch, capsys, value):
    """'~/hs' where no shell expands it (a compose file's command, a Kubernetes args list,
    a --config file): the entrypoint made ./~/hs under the working directory, the
    container's own file system. One sentence, exit status 2, nothing made; the server's
    own check says the same."""
    monkeypatch.chdir(tmp_path)
    _refused_by_entrypoint_and_server_alike(
        value, tmp_path, capsys, "check_directory",
        f"--dump-hidden-states-dir: {value!r} starts with '~', which only a shell expands (none did): "
        f"give the full path")


@pytest.mark.parametrize("value", ["moonckae://127.0.0.1:50051", "file:///data/hs", "s3://bucket/hs",
                                   "redis://10.0.0.1:6379"])
def test_a_url_of_another_scheme_is_no_directory(tmp_path, monkeypatch, capsys, value):
    """Only mooncake:// selects a sink other than a directory; 'moonckae://h:1' (a typo) or
    'file:///data/hs' made ./moonckae:/h:1 or ./file:/data/hs under the working directory
    and the server dumped there. One sentence, exit status 2, nothing made; the server's
    own check says the same."""
    monkeypatch.chdir(tmp_path)
    scheme = value.split(":", 1)[0]
    _refused_by_entrypoint_and_server_alike(
        value, tmp_path, capsys, "store_target",
        f"--dump-hidden-states-dir: {value!r} is a {scheme}:// URL, which names neither a directory nor "
        f"a store (mooncake://HOST:PORT)")


def test_a_config_file_given_as_one_word_is_read(tmp_path):
    """`--config=FILE`: SGLang merges a config file only for the two words `--config FILE`
    (prepare_server_args: '"--config" in argv'); its parser then took `--config=FILE` and
    dropped the file without a word (port 30000 where the file said 8000). The entrypoint
    passes it on as two words, so the file is read, and its flags win over the profiles'."""
    cfg = tmp_path / "server.yaml"
    cfg.write_text("port: 8000\nmodel-path: /models/other\n")
    launch = build([f"--config={cfg}"], caps=SM90x8, env={"KIMI_SGLANG_PORT": "8000"})
    assert opt(launch.argv, "--config") == [str(cfg)] and "--model-path" not in launch.argv
    r = subprocess.run([sys.executable, "-c", SGLANG_PARSE, *launch.argv[3:]],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert (got["port"], got["model_path"]) == (8000, "/models/other"), (launch.argv, got)
