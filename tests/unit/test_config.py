"""Option parsing and defaults: layer ids, directory checks."""

import builtins

import pytest

from sglang_ext.config import (
    DumpConfigError,
    check_directory,
    default_layer_ids,
    parse_layer_ids,
    resolve_layer_ids,
)


@pytest.mark.parametrize(
    "n, want",
    [
        (61, (2, 30, 58, 61)),  # Kimi-K2.5 / DeepSeek-V3: 61 layers
        (32, (2, 16, 29, 32)),  # Llama-3-8B
        (8, (2, 4, 5, 8)),
        (4, (1, 2, 4)),  # N//2 == 2 collides with 2
    ],
)
def test_default_layer_ids_are_eagle3_plus_last(n, want):
    # EAGLE-3: [2, N//2, N-3] (SGLang set_eagle3_layers_to_capture), plus N.
    assert default_layer_ids(n) == want


def test_parse_sorts_and_resolve_checks_range():
    assert parse_layer_ids(" 29, 2 ,16") == (2, 16, 29)
    assert parse_layer_ids("") is None and parse_layer_ids(None) is None
    assert resolve_layer_ids((2, 16, 32), 32) == (2, 16, 32)
    with pytest.raises(DumpConfigError, match=r"ids \[33\] exceed the model's 32 layers"):
        resolve_layer_ids((2, 33), 32)


def test_check_directory(tmp_path, monkeypatch):
    assert check_directory(str(tmp_path)) == str(tmp_path.resolve())
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(DumpConfigError, match="is not a directory"):
        check_directory(str(f))
    real_open = builtins.open

    def read_only(path, *a, **k):
        if ".kimi-sglang-probe" in str(path):
            raise PermissionError(30, "Read-only file system")
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", read_only)
    with pytest.raises(DumpConfigError, match="cannot write in .*Read-only file system"):
        check_directory(str(tmp_path))


# ---- settings that must fail at start-up with one sentence naming them (issue 36, item 10) ----

import os  # noqa: E402
import stat  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from sglang_ext import config  # noqa: E402
from sglang_ext.config import DumpConfig, env_settings  # noqa: E402

ENV_SETTINGS = ("KIMI_SGLANG_WRITER_THREADS", "KIMI_SGLANG_WRITER_SPARES", "KIMI_SGLANG_WRITER_CPUS", "KIMI_SGLANG_DRAIN_TIMEOUT_S",
                "KIMI_SGLANG_STATS_INTERVAL_S", "KIMI_SGLANG_WATCHDOG_S", "KIMI_SGLANG_FILE_MODE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in ENV_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def server_args(directory, max_mb=64, dp_size=1):
    return SimpleNamespace(dump_hidden_states_dir=str(directory), dump_hidden_states_max_host_mb=max_mb,
                           dump_hidden_states_layers=None, dump_hidden_states_dtype=None, dp_size=dp_size)


def physical_mib():
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1 << 20)


def test_max_host_mb_above_physical_memory_is_refused(tmp_path, clean_env):
    mib = physical_mib()
    too_big = mib + 1
    with pytest.raises(DumpConfigError) as e:
        DumpConfig.from_server_args(server_args(tmp_path, too_big))
    msg = str(e.value)
    assert msg.startswith(f"--dump-hidden-states-max-host-mb: {too_big} MiB is more than this "
                          f"host's physical memory ({mib} MiB)"), msg
    assert "\n" not in msg
    # the cap at exactly the physical memory is still the user's call
    assert DumpConfig.from_server_args(server_args(tmp_path, 64)).max_host_bytes == 64 << 20


@pytest.mark.parametrize("name, value, words", [
    ("KIMI_SGLANG_STATS_INTERVAL_S", "-1", "must be >= 0 seconds"),
    ("KIMI_SGLANG_STATS_INTERVAL_S", "1e300", "at most 86400 seconds"),
    ("KIMI_SGLANG_DRAIN_TIMEOUT_S", "1e300", "at most 86400 seconds"),
    ("KIMI_SGLANG_DRAIN_TIMEOUT_S", "\u0663", "must be a finite number of seconds"),  # Arabic-Indic 3
    ("KIMI_SGLANG_DRAIN_TIMEOUT_S", "1_0", "must be a finite number of seconds"),
    ("KIMI_SGLANG_WRITER_THREADS", "\uff13", "must be a finite number of threads"),  # fullwidth 3
    ("KIMI_SGLANG_WRITER_THREADS", "nan", "must be a finite number of threads"),
    ("KIMI_SGLANG_WATCHDOG_S", "0", "must be >= 1 seconds"),
    ("KIMI_SGLANG_WATCHDOG_S", "1e-9", "must be >= 1 seconds"),
    ("KIMI_SGLANG_WATCHDOG_S", "-5", "must be >= 1 seconds"),
    ("KIMI_SGLANG_WATCHDOG_S", "inf", "must be a finite number of seconds"),
    ("KIMI_SGLANG_WATCHDOG_S", "nan", "must be a finite number of seconds"),
    ("KIMI_SGLANG_WATCHDOG_S", "\u0666\u0660", "must be a finite number of seconds"),
    ("KIMI_SGLANG_WATCHDOG_S", "1e9", "at most 86400 seconds"),
    ("KIMI_SGLANG_FILE_MODE", "0400", "owner read and write (0600)"),
    ("KIMI_SGLANG_FILE_MODE", "200", "owner read and write (0600)"),
    ("KIMI_SGLANG_FILE_MODE", "1600", "nothing beyond 0777"),
    ("KIMI_SGLANG_FILE_MODE", "4700", "nothing beyond 0777"),
    ("KIMI_SGLANG_FILE_MODE", "0o600", "of 3 or 4 digits"),
    ("KIMI_SGLANG_FILE_MODE", "680", "of 3 or 4 digits"),
    ("KIMI_SGLANG_FILE_MODE", "00600", "of 3 or 4 digits"),
    ("KIMI_SGLANG_FILE_MODE", "\u0666\u0660\u0660", "of 3 or 4 digits"),
    ("KIMI_SGLANG_FILE_MODE", "-600", "of 3 or 4 digits"),
])
def test_bad_env_setting_is_one_sentence_naming_it(clean_env, name, value, words):
    clean_env.setenv(name, value)
    with pytest.raises(DumpConfigError) as e:
        env_settings()
    msg = str(e.value)
    assert msg.startswith(f"{name} "), msg
    assert words in msg and repr(value) in msg and "\n" not in msg, msg


def test_env_settings_defaults_and_accepted_values(clean_env):
    got = env_settings()
    assert got["watchdog_s"] == config.DEFAULT_WATCHDOG_S == 60.0
    assert got["file_mode"] == 0o600
    assert got["stats_interval_s"] == 60.0
    clean_env.setenv("KIMI_SGLANG_WATCHDOG_S", "2.5")
    clean_env.setenv("KIMI_SGLANG_FILE_MODE", "640")
    clean_env.setenv("KIMI_SGLANG_STATS_INTERVAL_S", "0")  # 0: only at shutdown
    clean_env.setenv("KIMI_SGLANG_DRAIN_TIMEOUT_S", " 86400 ")
    got = env_settings()
    assert (got["watchdog_s"], got["file_mode"], got["stats_interval_s"], got["drain_timeout_s"]) == (
        2.5, 0o640, 0.0, 86400.0)
    clean_env.setenv("KIMI_SGLANG_FILE_MODE", "0660")
    assert env_settings()["file_mode"] == 0o660


def test_dump_config_carries_watchdog_and_file_mode(tmp_path, clean_env):
    clean_env.setenv("KIMI_SGLANG_WATCHDOG_S", "7")
    clean_env.setenv("KIMI_SGLANG_FILE_MODE", "0640")
    cfg = DumpConfig.from_server_args(server_args(tmp_path))
    assert (cfg.watchdog_s, cfg.file_mode) == (7.0, 0o640)
    plain = DumpConfig(directory=str(tmp_path), layer_ids=None, max_host_bytes=1 << 20)
    assert (plain.watchdog_s, plain.file_mode) == (60.0, 0o600)


# ---- the dump directory: ours, and not writable by others without the sticky bit (item 6) ----

def test_directory_writable_by_others_is_refused(tmp_path):
    d = tmp_path / "hs"
    d.mkdir()
    for mode in (0o777, 0o770, 0o757):
        d.chmod(mode)
        with pytest.raises(DumpConfigError) as e:
            check_directory(str(d))
        msg = str(e.value)
        assert msg.startswith(f"--dump-hidden-states-dir: {str(d)!r} is writable by group or others "
                              f"(mode {mode:04o}) without the sticky bit"), msg
        assert "\n" not in msg


@pytest.mark.parametrize("mode", [0o700, 0o755, 0o1777, 0o1770])
def test_directory_of_ours_is_accepted(tmp_path, mode):
    # 0755: the README's `mkdir -p /dev/shm/hs` under umask 022, the server run as the same user;
    # 1777/1770: sticky, as /tmp and /dev/shm (others cannot rename or remove our files).
    d = tmp_path / "hs"
    d.mkdir()
    d.chmod(mode)
    assert check_directory(str(d)) == str(d.resolve())
    assert stat.S_IMODE(os.stat(d).st_mode) == mode


def test_directory_owned_by_another_user_is_refused_even_for_root(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root (CI runs the tests as root)")
    d = tmp_path / "hs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    link = tmp_path / "link"
    link.symlink_to(d)
    for path in (d, link):
        with pytest.raises(DumpConfigError) as e:
            check_directory(str(path))
        msg = str(e.value)
        assert msg.startswith(f"--dump-hidden-states-dir: {str(path)!r} is owned by uid 65534, "
                              f"not by this server's user (uid 0)"), msg
        assert "\n" not in msg
    assert list(d.iterdir()) == []  # refused before the write probe


@pytest.mark.parametrize("text", ["\u0663", "2,\uff11\uff16", "1_6", "+2", "2,16,29,32\u0663"])
def test_layer_ids_take_ascii_digits_only(text):
    # int() takes other scripts' digits, underscores and a sign: a layer id is plain 0-9.
    with pytest.raises(DumpConfigError, match=r"^--dump-hidden-states-layers: .* is not an integer layer id"):
        parse_layer_ids(text)


def test_a_store_address_selects_the_store_sink_and_checks_no_directory(clean_env):
    cfg = DumpConfig.from_server_args(server_args("mooncake://10.0.0.7:50051?protocol=rdma&device=mlx5_0"))
    assert cfg.sink == "store" and cfg.directory == "mooncake://10.0.0.7:50051?protocol=rdma&device=mlx5_0"
    assert (cfg.store.master_server_address, cfg.store.protocol, cfg.store.device_name) == (
        "10.0.0.7:50051", "rdma", "mlx5_0")
    assert DumpConfig(directory="/x", layer_ids=None, max_host_bytes=1 << 20).sink == "file"


@pytest.mark.parametrize("url, words", [
    ("mooncake://10.0.0.7", "is not a mooncake://HOST:PORT address"),
    ("mooncake://h:1?global_segment_size=lots", "global_segment_size='lots' is not a size"),
])
def test_a_bad_store_address_is_one_sentence_naming_the_flag(clean_env, url, words):
    with pytest.raises(config.DumpConfigError) as e:
        DumpConfig.from_server_args(server_args(url))
    assert str(e.value).startswith("--dump-hidden-states-dir: ") and words in str(e.value)
    assert "\n" not in str(e.value)
