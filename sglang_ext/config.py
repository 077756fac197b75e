"""What to dump: the dump directory, the layer ids, the host-memory cap, the file dtype,
the writer's environment settings (``KIMI_SGLANG_*``, ``env_settings``) and the sampling
of live traffic (``sampling_settings``). Validated
here, at start-up: a bad value is a ``DumpConfigError``, one sentence naming the flag or
variable. Numbers are ASCII digits only (``int``/``float`` also take other scripts'
digits and underscores).

Layer ids follow SGLang's aux-capture convention (``layers_to_capture`` in
``python/sglang/srt/models/llama.py`` and ``deepseek_v2.py``): id ``k`` is the residual
stream *entering* decoder layer ``k``, i.e. HF transformers' ``output_hidden_states[k]``.
Id ``N`` (= ``num_hidden_layers``) is the stream after the last decoder layer, *before*
the final norm (patch 0002). Id 0 (the embedding output) is refused: SGLang's Llama
aux path cannot capture it (the residual is still ``None`` there).

Note the other convention in the field: EAGLE-3 draft configs'
``eagle_aux_hidden_state_layer_ids`` name a layer's *output*, so SGLang adds 1 to them
in ``set_eagle3_layers_to_capture``. Ours are the ids after that +1.
"""

from __future__ import annotations

import math
import os
import re
import stat
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

DEFAULT_MAX_HOST_MB = 4096
DEFAULT_WRITER_THREADS = 8  # as vLLM's hidden-states connector
MAX_WRITER_SPARES = 8  # spare files made ahead (writer_process.Spares), each one file's size
# the most kept ready: as many as files begin at once (a prefill batch's requests), learnt
# by writer_process.Spares within its byte budget; 1 keeps one for the next file only
DEFAULT_WRITER_SPARES = 8
MAX_WRITER_THREADS = 256  # /dev/shm saturates at ~8 (bench ceilings); more only costs memory
MAX_CPUS = 1 << 16  # CPU numbers parse_cpu_list accepts when not checked against this host
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # SGLang kills schedulers 15 s after its shutdown request
DEFAULT_STATS_INTERVAL_S = 60.0
DEFAULT_WATCHDOG_S = 60.0  # a writer process without progress this long is declared stuck
# Below a second the watchdog would poll the writer's counters many times a second and take
# any one op (a chunk's write, a rename) for a stop.
MIN_WATCHDOG_S = 1.0
# The most any seconds setting takes: one day. Longer is a typo (milliseconds for seconds),
# and past threading.TIMEOUT_MAX (~292 years) Python's waits raise OverflowError at shutdown.
MAX_SECONDS = 86400.0
# The most any GiB setting takes: 2**63 bytes (8 EiB), the largest file offset (off_t); past
# it GiB * 2**30 is no byte count a file system has (and past ~1.7e299 not even a finite float).
MAX_GIB = float(1 << 33)
DEFAULT_FILE_MODE = 0o600  # dump files: the server's user only (KIMI_SGLANG_FILE_MODE)
# A number as a person types it: ASCII digits, an optional sign, fraction and exponent.
# float() alone also takes other scripts' digits ('\u0663' is 3.0) and underscores ('1_0').
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?:inf|nan)",
                     re.ASCII | re.IGNORECASE)
# --dump-hidden-states-dtype: auto = the model's dtype; bf16 = cast on the device;
# fp8 = float8_e4m3fn plus float32 scales per token and layer (sglang_ext.quant).
DTYPE_CHOICES = ("auto", "bf16", "fp8")


class DumpConfigError(ValueError):
    """A --dump-hidden-states-* value is unusable; the message names the flag."""


def parse_layer_ids(text: Optional[str]) -> Optional[Tuple[int, ...]]:
    """Parse ``--dump-hidden-states-layers`` (``"2,16,29,32"``) into sorted unique ids.

    ``None`` or ``""`` means "the default" (``default_layer_ids``, once N is known).
    Raises ``DumpConfigError`` for anything but ASCII decimal integers, negative or zero
    ids and duplicates.
    The range check against N happens in ``resolve_layer_ids``.
    """
    if text is None or str(text).strip() == "":
        return None
    ids = []
    for part in str(text).split(","):
        part = part.strip()
        try:  # int() alone also takes other scripts' digits, '_' and '+': plain 0-9 only
            if not re.fullmatch(r"-?[0-9]+", part, flags=re.ASCII):
                raise ValueError(part)
            value = int(part)
        except ValueError:
            raise DumpConfigError(
                f"--dump-hidden-states-layers: {part!r} is not an integer layer id "
                f"(expected e.g. 2,16,29,32)"
            ) from None
        if value < 1:
            raise DumpConfigError(
                f"--dump-hidden-states-layers: layer id {value} is out of range; ids start "
                f"at 1 (id k = the stream entering decoder layer k; 0, the embedding "
                f"output, cannot be captured)"
            )
        ids.append(value)
    dupes = sorted({k for k in ids if ids.count(k) > 1})
    if dupes:
        raise DumpConfigError(f"--dump-hidden-states-layers: duplicate layer ids {dupes}")
    return tuple(sorted(ids))


def parse_dtype(value: Optional[str]) -> str:
    """Validate ``--dump-hidden-states-dtype``: one of ``DTYPE_CHOICES`` (``None`` or
    ``""`` = ``"auto"``). Raises ``DumpConfigError`` naming the flag otherwise."""
    if value is None or str(value).strip() == "":
        return "auto"
    text = str(value).strip().lower()
    if text not in DTYPE_CHOICES:
        raise DumpConfigError(
            f"--dump-hidden-states-dtype: {value!r} is not one of {', '.join(DTYPE_CHOICES)}"
        )
    return text


def default_layer_ids(num_layers: int) -> Tuple[int, ...]:
    """EAGLE-3's default ``[2, N//2, N-3]`` (SGLang's ``set_eagle3_layers_to_capture``,
    speculators' default) plus ``N``, the last layer before the final norm; sorted and
    de-duplicated (tiny models make them collide: N=4 gives (1, 2, 4))."""
    n = int(num_layers)
    if n < 1:
        raise DumpConfigError(f"model has {n} layers")
    ids = {k for k in (2, n // 2, n - 3, n) if 1 <= k <= n}
    return tuple(sorted(ids))


def resolve_layer_ids(ids: Optional[Sequence[int]], num_layers: int) -> Tuple[int, ...]:
    """The ids to capture for a model of ``num_layers`` decoder layers.

    Raises ``DumpConfigError`` if any id is above N.
    """
    if ids is None:
        return default_layer_ids(num_layers)
    too_big = [k for k in ids if k > num_layers]
    if too_big:
        raise DumpConfigError(
            f"--dump-hidden-states-layers: ids {too_big} exceed the model's "
            f"{num_layers} layers (valid: 1..{num_layers}; {num_layers} = last layer "
            f"before the final norm)"
        )
    return tuple(sorted(ids))


def check_as_typed(value: Optional[str]) -> None:
    """Refuse a ``--dump-hidden-states-dir`` that begins or ends with whitespace (a quoting
    slip: ``" /data/hs"`` is the relative directory ``" "/data/hs`` under the working
    directory, ``"/data/hs "`` another directory than ``/data/hs``, ``" mooncake://..."``
    a directory too) or starts with ``~`` (``~/hs`` where no shell expanded it: a compose
    file's command, a Kubernetes args list, a ``--config`` file; ``./~/hs`` under the
    working directory). Raises ``DumpConfigError``, one sentence naming the flag."""
    text = str(value or "")
    if text != text.strip():
        raise DumpConfigError(f"--dump-hidden-states-dir: {text!r} begins or ends with whitespace, "
                              f"which names another directory than meant; remove it")
    if text.startswith("~"):
        raise DumpConfigError(f"--dump-hidden-states-dir: {text!r} starts with '~', which only a shell "
                              f"expands (none did): give the full path")


def store_target(value: Optional[str]):
    """The ``store.StoreConfig`` of a ``--dump-hidden-states-dir`` that is a Mooncake
    Store address (``mooncake://HOST:PORT?key=value&...``, docs/store.md), or ``None``
    for a directory. Raises ``DumpConfigError``, one sentence naming the flag, for a
    ``mooncake://`` value that is not a valid address or names an unknown setting, and
    for a value padded with whitespace or starting with ``~`` (``check_as_typed``), and for
    a URL of another scheme (``file://``, a ``moonckae://`` typo: made as a directory
    ``./file:/...`` under the working directory, they took the dumps there)."""
    text = str(value or "")
    check_as_typed(text)
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", text, flags=re.ASCII)
    if scheme and scheme.group(1).lower() != "mooncake":
        raise DumpConfigError(f"--dump-hidden-states-dir: {text!r} is a {scheme.group(1)}:// URL, which "
                              f"names neither a directory nor a store (mooncake://HOST:PORT)")
    if not text.lower().startswith("mooncake:"):
        return None
    from sglang_ext import store

    try:
        return store.StoreConfig.from_url(text)
    except ValueError as e:
        raise DumpConfigError(f"--dump-hidden-states-dir: {e}") from None


def check_store_reachable(config, timeout_s: float = 5.0) -> None:
    """At start-up, for the store sink: ``mooncake.store`` imports (the package and the
    shared libraries its extension loads: libibverbs, librdmacm, libnuma), the segment
    and buffer fit this host's memory (``StoreConfig.memory_problem``), and Mooncake's
    own client set-up against the master (``config.master_server_address``, a
    ``store.StoreConfig``) completes, in a subprocess, within
    ``store_client.HANDSHAKE_S`` (``store_client.handshake``: its TCP port is probed
    first, within ``timeout_s``; a ``metadata_server`` URL's too). Raises
    ``DumpConfigError``, one sentence naming the flag, else. (A typo, a hung master or
    its metrics port must not cost Mooncake's ~90 s of retries nor freeze the writer;
    a master that goes away later fails requests, not the server.)"""
    from sglang_ext import store_client

    why = store_client.mooncake_import_error()
    if why is not None:
        raise DumpConfigError(f"--dump-hidden-states-dir: the Mooncake store sink {why}")
    why = config.memory_problem()
    if why is not None:
        raise DumpConfigError(f"--dump-hidden-states-dir: {why}")
    why = store_client.master_unreachable(config, timeout_s)
    if why is not None:
        raise DumpConfigError(f"--dump-hidden-states-dir: {why}; is mooncake_master running there?")
    why = store_client.handshake(config, probe_s=timeout_s)
    if why is not None:
        raise DumpConfigError(f"--dump-hidden-states-dir: {why}")


def check_directory(path: Optional[str]) -> str:
    """Validate ``--dump-hidden-states-dir``; returns its real path (symlinks resolved).

    Raises ``DumpConfigError``, one sentence naming the flag and the path, if it is
    missing, padded with whitespace or starting with ``~`` (``check_as_typed``), not a
    directory, not owned by this server's user (``os.geteuid()``; a directory of another
    user is refused even for root), writable by group or others
    without the sticky bit, or not writable (tested by creating and removing a file,
    which also catches read-only mounts). The ownership and mode rules are OpenSSH's
    ``StrictModes`` for its own files: whoever may rename or replace files in the
    directory can swap a finished dump for their own or read what lands there, so the
    directory must be the server user's, and a shared one (``/tmp``, ``/dev/shm``: mode
    1777) only with the sticky bit, which stops others renaming or removing our files.
    Only the directory itself is checked, not its parents: the server opens it once at
    start-up and works through that descriptor. ``mkdir -p DIR`` under umask 022 (0755)
    and ``mkdir -m 700 DIR`` pass; under umask 002 (0775) it is refused (chmod g-w).
    """
    if not path:
        raise DumpConfigError("--dump-hidden-states-dir: empty path")
    check_as_typed(path)
    if not os.path.exists(path):
        raise DumpConfigError(
            f"--dump-hidden-states-dir: {path!r} does not exist; create it first "
            f"(mkdir -m 700 -p {path})"
        )
    if not os.path.isdir(path):
        raise DumpConfigError(f"--dump-hidden-states-dir: {path!r} is not a directory")
    real = os.path.realpath(path)
    check_directory_owner(real, path)
    probe = os.path.join(real, f".kimi-sglang-probe-{os.getpid()}")
    try:
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise DumpConfigError(
            f"--dump-hidden-states-dir: cannot write in {path!r}: {e.strerror}"
        ) from None
    return real


def check_directory_owner(real: str, shown: Optional[str] = None) -> None:
    """Refuse a dump directory (``real``, resolved) that is not owned by this process's
    effective user or is writable by group or others without the sticky bit
    (``check_directory`` says why). Raises ``DumpConfigError`` naming the flag and
    ``shown`` (default ``real``), the path as the user wrote it."""
    shown = real if shown is None else shown
    try:
        st = os.stat(real)
    except OSError as e:
        raise DumpConfigError(f"--dump-hidden-states-dir: cannot stat {shown!r}: {e.strerror}") from None
    me = os.geteuid()
    if st.st_uid != me:
        raise DumpConfigError(
            f"--dump-hidden-states-dir: {shown!r} is owned by uid {st.st_uid}, not by this "
            f"server's user (uid {me}), who could then have its dumps replaced or read; use a "
            f"directory of your own (mkdir -m 700 DIR)"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        raise DumpConfigError(
            f"--dump-hidden-states-dir: {shown!r} is writable by group or others (mode "
            f"{mode:04o}) without the sticky bit, so they could replace its dumps; "
            f"chmod go-w {shown} (or chmod +t for a shared directory)"
        )


def writer_ranks(server_args) -> int:
    """How many processes of one server write dump files: ``--dp-size``. Each DP rank is a
    scheduler of its own whose attention-TP rank 0 writes the requests that DP rank served:
    under ``--enable-dp-attention`` one attention group per DP rank, without it one full TP
    group per DP rank (SGLang's ``data_parallel_controller.launch_dp_schedulers``; the
    rank layout is ``dp_attention.compute_dp_attention_world_info``)."""
    return max(1, int(getattr(server_args, "dp_size", 1) or 1))


def env_number(name: str, default: float, unit: str = "seconds", minimum: Optional[float] = None,
               maximum: Optional[float] = None, above: Optional[float] = None) -> float:
    """``float`` of environment variable ``name`` (``default`` when unset or blank).

    Raises ``DumpConfigError``, one sentence naming the variable and ``unit``, for
    anything that is not a finite number written in ASCII (other scripts' digits and
    ``1_000`` are refused, though ``float`` takes them), or that is below ``minimum``,
    not above ``above`` or above ``maximum``."""
    value = os.environ.get(name, "")
    if not value.strip():
        return default
    number = float(value) if _NUMBER.fullmatch(value.strip()) else math.nan
    if not math.isfinite(number):
        raise DumpConfigError(f"{name} must be a finite number of {unit}, got {value!r}")
    if minimum is not None and number < minimum:
        raise DumpConfigError(f"{name} must be >= {minimum:g} {unit}, got {value!r}")
    if above is not None and number <= above:
        raise DumpConfigError(f"{name} must be > {above:g} {unit}, got {value!r}")
    if maximum is not None and number > maximum:
        raise DumpConfigError(f"{name} must be at most {_plain(maximum)} {unit}, got {value!r}")
    return number


def _plain(number: float) -> str:
    """``number`` as a person writes it: ``8589934592``, not ``8.58993e+09``."""
    return str(int(number)) if number == int(number) else f"{number:g}"


def env_file_mode() -> int:
    """``KIMI_SGLANG_FILE_MODE`` checked at start-up (``format.file_mode`` owns its
    meaning: the permission bits of every file the dump creates, default 0600, the umask
    applied); raises ``DumpConfigError``, one sentence naming the variable."""
    from sglang_ext import format as fmt

    try:
        return fmt.file_mode()
    except ValueError as e:
        raise DumpConfigError(str(e)) from None


def parse_cpu_list(text: str, name: str, this_host: bool = True) -> Tuple[int, ...]:
    """A CPU list in ``taskset -c`` / cpuset syntax (``"8-15,20"``) as sorted unique CPU
    numbers ``(8, ..., 15, 20)``. Raises ``DumpConfigError`` naming ``name`` for bad
    syntax, an empty list, a reversed range, or (``this_host``) a CPU this host does not
    have (at or above ``os.cpu_count()``)."""
    have = os.cpu_count() or 1
    limit = have if this_host else MAX_CPUS
    cpus = set()
    for part in (p.strip() for p in str(text).split(",")):
        m = re.fullmatch(r"([0-9]{1,9})(?:-([0-9]{1,9}))?", part, flags=re.ASCII)
        if not m:
            raise DumpConfigError(f"{name}: {part!r} is not a CPU number or range "
                                  f"(expected a taskset -c list, e.g. 8-15 or 0,2,4)")
        first, last = int(m.group(1)), int(m.group(2) or m.group(1))
        if last < first:
            raise DumpConfigError(f"{name}: {part!r} is not a CPU range (expected e.g. 8-15)")
        if last >= limit:  # checked before expanding: a typo must not build a huge set
            raise DumpConfigError(f"{name}: {part!r} names CPUs beyond "
                                  + (f"this host's 0-{have - 1}" if this_host else f"{MAX_CPUS - 1}"))
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def env_settings(this_host: bool = True) -> dict:
    """The writer's environment settings, validated: ``writer_threads``
    (``KIMI_SGLANG_WRITER_THREADS``, threads of the writer process, 1 to
    ``MAX_WRITER_THREADS``), ``drain_timeout_s`` (``KIMI_SGLANG_DRAIN_TIMEOUT_S``, how long
    shutdown waits for queued writes, >= 0), ``stats_interval_s``
    (``KIMI_SGLANG_STATS_INTERVAL_S``, seconds between counter log lines, >= 0; 0 logs
    only at shutdown), ``watchdog_s`` (``KIMI_SGLANG_WATCHDOG_S``, seconds without
    progress before a writer process is declared stuck, > 0), ``file_mode``
    (``KIMI_SGLANG_FILE_MODE``, permission bits of the files the dump creates, the umask
    still applies; ``env_file_mode``) and ``writer_cpus`` (``KIMI_SGLANG_WRITER_CPUS``,
    the CPUs the writer process runs on, a ``taskset -c`` list; None: the scheduler's;
    ``writer_spares`` (``KIMI_SGLANG_WRITER_SPARES``, the most files of the last file's
    size the writer keeps allocated and mapped ahead, 0 to ``MAX_WRITER_SPARES``, default
    ``DEFAULT_WRITER_SPARES``; as many are kept as files begin at once, within 1 GiB,
    ``writer_process.Spares``: a file's rows then go by parallel stores instead of one
    thread's ``pwrite`` into pages allocated on the way, docs/performance.md; 0 turns
    them off);
    ``this_host``: checked against this host's CPUs, which a plan made for another host
    skips). Seconds are at most ``MAX_SECONDS``. Raises ``DumpConfigError``, one sentence
    naming the variable."""
    threads = env_number("KIMI_SGLANG_WRITER_THREADS", DEFAULT_WRITER_THREADS, "threads", 1)
    if threads != int(threads) or threads > MAX_WRITER_THREADS:
        raise DumpConfigError(f"KIMI_SGLANG_WRITER_THREADS must be a whole number of threads "
                              f"from 1 to {MAX_WRITER_THREADS}, got {threads:g}")
    spares = env_number("KIMI_SGLANG_WRITER_SPARES", DEFAULT_WRITER_SPARES, "files", 0)
    if spares != int(spares) or spares > MAX_WRITER_SPARES:
        raise DumpConfigError(f"KIMI_SGLANG_WRITER_SPARES must be a whole number of files "
                              f"from 0 to {MAX_WRITER_SPARES}, got {spares:g}")
    cpus = os.environ.get("KIMI_SGLANG_WRITER_CPUS", "").strip()
    return {
        "writer_spares": int(spares),
        "writer_cpus": parse_cpu_list(cpus, "KIMI_SGLANG_WRITER_CPUS", this_host) if cpus else None,
        "writer_threads": int(threads),
        "drain_timeout_s": env_number("KIMI_SGLANG_DRAIN_TIMEOUT_S", DEFAULT_DRAIN_TIMEOUT_S,
                                      minimum=0, maximum=MAX_SECONDS),
        "stats_interval_s": env_number("KIMI_SGLANG_STATS_INTERVAL_S", DEFAULT_STATS_INTERVAL_S,
                                       minimum=0, maximum=MAX_SECONDS),
        "watchdog_s": env_number("KIMI_SGLANG_WATCHDOG_S", DEFAULT_WATCHDOG_S,
                                 minimum=MIN_WATCHDOG_S, maximum=MAX_SECONDS),
        "file_mode": env_file_mode(),
    }


def sampling_settings(writers: int = 1) -> dict:
    """The sampling settings (``sampling.DumpPolicy``), validated: ``sample_rate``
    (``KIMI_SGLANG_SAMPLE_RATE``, the share of requests dumped, 0 to 1, default 1),
    ``budget_bytes`` (``KIMI_SGLANG_DUMP_BUDGET_GB``, GiB of rows the server may write (headers not counted),
    0 to ``MAX_GIB``, shared equally by the ``writers`` writing ranks as the host cap is; None when
    unset) and ``min_free_bytes`` (``KIMI_SGLANG_MIN_FREE_GB``, GiB that must stay free
    in the dump directory's file system, 0 to ``MAX_GIB``; None when unset). Raises
    ``DumpConfigError``, one sentence naming the variable."""
    from sglang_ext.sampling import GIB

    name = "KIMI_SGLANG_SAMPLE_RATE"
    value = os.environ.get(name, "")
    rate = 1.0
    if value.strip():
        rate = float(value) if _NUMBER.fullmatch(value.strip()) else math.nan
        if not 0 <= rate <= 1:  # nan too
            raise DumpConfigError(f"{name} must be the share of requests to dump, a number from "
                                  f"0 to 1 (e.g. 0.05), got {value!r}")
        rate += 0.0  # -0.0 is 0.0 (the start line said 'rate -0')
    budget = env_number("KIMI_SGLANG_DUMP_BUDGET_GB", None, "GiB", minimum=0, maximum=MAX_GIB)
    floor = env_number("KIMI_SGLANG_MIN_FREE_GB", None, "GiB", minimum=0, maximum=MAX_GIB)
    return {
        "sample_rate": rate,
        "budget_bytes": None if budget is None else int(budget * GIB) // max(1, writers),
        "min_free_bytes": None if floor is None else int(floor * GIB),
    }


def check_floor(directory: str, min_free_bytes: int) -> None:
    """Refuse a free-space floor (``KIMI_SGLANG_MIN_FREE_GB``, ``min_free_bytes``) at or
    above the size of ``directory``'s file system (``statvfs``: ``f_blocks * f_frsize``):
    no file could ever be dumped there. Raises ``DumpConfigError``, one sentence naming the
    variable; nothing where the size cannot be read."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return
    size = st.f_blocks * st.f_frsize
    if size and min_free_bytes >= size:
        raise DumpConfigError(
            f"KIMI_SGLANG_MIN_FREE_GB {os.environ.get('KIMI_SGLANG_MIN_FREE_GB', '')!r} is not below "
            f"the size of the dump directory's file system ({size} bytes), so no request would "
            f"ever be dumped; give a floor below it (GiB)")


def physical_memory_bytes() -> Optional[int]:
    """This host's physical memory in bytes (``sysconf``), or None where it cannot say."""
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    return pages * page if pages > 0 and page > 0 else None


@dataclass(frozen=True)
class DumpConfig:
    """Validated dump options. ``layer_ids`` is ``None`` until the model's N is known.

    ``max_host_bytes`` is the size of one writing rank's arena (``arena.py``: shared
    memory between its scheduler and its writer process, pinned, allocated at start-up):
    ``--dump-hidden-states-max-host-mb`` (the server's cap, MiB) divided by
    ``writer_ranks``, so that the arenas together stay under the cap. Rows stream through
    it chunk by chunk, so a prompt larger than the arena still goes through.
    ``hidden_states_dtype``: ``--dump-hidden-states-dtype`` (``parse_dtype``). The rest
    come from the environment (``env_settings``). ``store``: the Mooncake Store address
    (``store.StoreConfig``) when ``--dump-hidden-states-dir`` is a ``mooncake://`` URL
    (the store sink, docs/store.md; ``directory`` then holds the URL as given), else None.
    ``sample_rate``, ``budget_bytes`` (this writing rank's share) and ``min_free_bytes``:
    which requests are dumped (``sampling_settings``). ``incremental_stream``: SGLang's
    ``--incremental-streaming-output`` (a streamed request's keys are then held from its
    first output, ``responses.hold_info``).
    """

    directory: str
    layer_ids: Optional[Tuple[int, ...]]
    max_host_bytes: int
    writer_threads: int = DEFAULT_WRITER_THREADS
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    stats_interval_s: float = DEFAULT_STATS_INTERVAL_S
    hidden_states_dtype: str = "auto"
    writer_cpus: Optional[Tuple[int, ...]] = None
    writer_spares: int = DEFAULT_WRITER_SPARES
    watchdog_s: float = DEFAULT_WATCHDOG_S
    file_mode: int = DEFAULT_FILE_MODE
    store: Optional["StoreConfig"] = None  # noqa: F821 - sglang_ext.store.StoreConfig
    sample_rate: float = 1.0
    budget_bytes: Optional[int] = None
    min_free_bytes: Optional[int] = None
    incremental_stream: bool = False

    @property
    def sink(self) -> str:
        """``"store"`` when ``--dump-hidden-states-dir`` is a ``mooncake://`` address, else
        ``"file"``."""
        return "file" if self.store is None else "store"

    @classmethod
    def from_server_args(cls, server_args) -> "DumpConfig":
        """Build from SGLang's ``ServerArgs`` and the environment (``env_settings``);
        raises ``DumpConfigError`` (also when the cap leaves a writer rank less than 1 MiB,
        or is more than this host's physical memory: the arenas are allocated and pinned
        at start-up, and a cap past the memory would fail there as a bare ENOMEM; and for a
        free-space floor the dump directory's file system cannot meet, ``check_floor``)."""
        store = store_target(server_args.dump_hidden_states_dir)
        directory = (str(server_args.dump_hidden_states_dir) if store is not None
                     else check_directory(server_args.dump_hidden_states_dir))
        layer_ids = parse_layer_ids(getattr(server_args, "dump_hidden_states_layers", None))
        dtype = parse_dtype(getattr(server_args, "dump_hidden_states_dtype", None))
        max_mb = getattr(server_args, "dump_hidden_states_max_host_mb", DEFAULT_MAX_HOST_MB)
        if not isinstance(max_mb, int) or isinstance(max_mb, bool) or max_mb < 1:
            raise DumpConfigError(
                f"--dump-hidden-states-max-host-mb: must be a positive integer, got {max_mb!r}"
            )
        physical = physical_memory_bytes()
        if physical is not None and max_mb > physical >> 20:
            raise DumpConfigError(
                f"--dump-hidden-states-max-host-mb: {max_mb} MiB is more than this host's "
                f"physical memory ({physical >> 20} MiB); the arena is allocated and pinned "
                f"at start-up, so give at most that (default {DEFAULT_MAX_HOST_MB})"
            )
        writers = writer_ranks(server_args)
        sampling = sampling_settings(writers)
        if store is None and sampling["min_free_bytes"] is not None:
            check_floor(directory, sampling["min_free_bytes"])
        if max_mb < writers:
            raise DumpConfigError(
                f"--dump-hidden-states-max-host-mb: {max_mb} MiB shared by {writers} writer "
                f"ranks (--dp-size) leaves less than 1 MiB each"
            )
        return cls(
            directory=directory,
            layer_ids=layer_ids,
            max_host_bytes=max_mb * (1 << 20) // writers,
            hidden_states_dtype=dtype,
            store=store,
            incremental_stream=bool(getattr(server_args, "incremental_streaming_output", False)),
            **env_settings(),
            **sampling,
        )
