"""``kimi-sglang``: the container's entrypoint.

Builds ``python -m sglang.launch_server <args>`` plus its environment from
*profiles* (named bundles of default flags and env vars, below) and the
user's own arguments, then ``exec``s it. The user always wins:

* a flag the user gives (under any of its spellings, e.g. ``--tp``,
  ``--tp-size``, ``--tensor-parallel-size``), on the command line or in the
  ``--config FILE`` it gives, replaces the profile's default;
* an env var already set in the environment (``docker run -e``) is never
  overwritten by a profile;
* ``--no-profile NAME`` (repeatable, or ``KIMI_SGLANG_NO_PROFILE=a,b``) turns a
  whole profile off, ``--no-default FLAG`` (repeatable) drops one default.

Entrypoint-only options (consumed here, never passed to SGLang):
``--print-command``, ``--no-profile NAME``, ``--no-default FLAG`` (FLAG must be one of
the profiles' defaults), ``--help`` (ours: these options, the defaults, the dump flags,
the environment; SGLang's 2,000-line help is ``--help-sglang``).

If the first argument is an executable on PATH (``python``, ``bash``, ...)
it is exec'd as given, so ``docker run IMAGE python -m sglang.launch_server
...`` behaves as in upstream's image.

Environment knobs: ``KIMI_SGLANG_MODEL`` (model path, default
``/models/Kimi-K2.5``), ``KIMI_SGLANG_PORT`` (1-65535, default 30000, also read by the
image's HEALTHCHECK), ``KIMI_SGLANG_COMPUTE_CAP`` (comma list of compute
capabilities, one per GPU; replaces ``nvidia-smi`` detection),
``KIMI_SGLANG_GPU_COUNT`` (1-64, replaces the detected GPU count used for ``--tp``),
``KIMI_SGLANG_NO_PROFILE``. Numbers are ASCII digits; a bad value is one sentence
naming the variable and exit status 1.

``--dump-hidden-states-dir DIR``: made here (``mkdir -p``, DIR itself 0700) when
missing, and refused (one sentence, exit status 2) when it is not this user's or is
writable by group or others without the sticky bit, as the patched server would
refuse it (``config.check_directory``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

LAUNCH_MODULE = "sglang.launch_server"
DEFAULT_MODEL = "/models/Kimi-K2.5"
DEFAULT_PORT = "30000"
# The most GPUs one host's --tp-size may name (KIMI_SGLANG_GPU_COUNT, KIMI_SGLANG_COMPUTE_CAP):
# the count is of the GPUs this host sees, and the largest single hosts have 16 (HGX-2,
# DGX-2); 64 leaves room while refusing a typo such as 80 for 8.
MAX_GPUS = 64

# Attention backends that must not run on SM120 (see the sm120 profile's sources).
SM120_BAD_ATTENTION = {
    "trtllm_mla": "trtllm_mla's MLA prefill kernels exist only for SM100/SM103 and fail "
    "with 'Unsupported architecture' on SM120 (sgl-project/sglang#24633; SGLang 0.5.17 "
    "still lets it through its Blackwell check)",
    "fa3": "FlashAttention-3 supports SM80-SM90 only (sgl-project/sglang#12178)",
}
ATTENTION_FLAGS = ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")


@dataclass(frozen=True)
class Opt:
    """One default server flag.

    ``names[0]`` is the spelling we emit; every spelling in ``names`` counts as
    "the user gave this flag". ``value`` is None for a switch (store_true);
    otherwise a ``str.format`` template over the context (``{model}``,
    ``{gpu_count}``, ``{port}``). A template whose field is unknown (None) is
    skipped, so e.g. ``--tp-size`` is left to SGLang when no GPU was counted.
    """

    names: tuple[str, ...]
    value: str | None = None
    why: str = ""

    @property
    def flag(self) -> str:
        return self.names[0]


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    sources: tuple[str, ...]
    opts: tuple[Opt, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    # Decides from the context whether the profile applies.
    applies: Callable[["Context"], bool] = lambda ctx: True


@dataclass(frozen=True)
class Context:
    compute_caps: tuple[str, ...]  # one per visible GPU, e.g. ("12.0", ...)
    gpu_count: int | None
    model: str
    port: str

    @property
    def is_sm120(self) -> bool:
        return bool(self.compute_caps) and all(c.strip().split(".")[0] == "12" for c in self.compute_caps)

    def fields(self) -> dict[str, object]:
        return {"model": self.model, "gpu_count": self.gpu_count, "port": self.port}


# ---------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------

SM120 = Profile(
    name="sm120",
    description="RTX PRO 6000 Blackwell and other SM120 (compute capability 12.x) GPUs, "
    "PCIe-only (no NVLink) boxes.",
    sources=(
        # Attention: triton. Public reports: trtllm_mla MLA prefill fails on SM120
        # (sglang#24633, fix proposed in sglang PR #28837, open); fa3 is SM80-90
        # only (sglang#12178); the team's own reports (shared/ANCHORS.md) saw
        # FlashInfer attention hang in CUDA-graph capture on SM120 while triton
        # attention with CUDA graphs served Kimi-K2.5 at TP=8. Related, not the
        # same model: sglang PR #29580 (comment 2026-06-29, 8x RTX PRO 6000):
        # full decode-graph capture of flashinfer_sparse_mla hangs, tc_piecewise
        # and eager work.
        "https://github.com/sgl-project/sglang/issues/24633",
        "https://github.com/sgl-project/sglang/pull/28837",
        "https://github.com/sgl-project/sglang/issues/12178",
        "https://github.com/sgl-project/sglang/pull/29580",
        # Custom all-reduce on PCIe / SM12x under CUDA-graph capture.
        "https://github.com/sgl-project/sglang/issues/25649",
        "https://github.com/vllm-project/vllm/pull/47751",
        # NCCL P2P hangs on PCIe RTX PRO 6000 boxes.
        "https://github.com/local-inference-lab/rtx6kpro/issues/15",
        "https://github.com/NVIDIA/nccl/issues/1999",
    ),
    opts=(
        Opt(
            ("--attention-backend",),
            "triton",
            "flashinfer reported to hang in CUDA-graph capture on SM120 (team report, lead); "
            "trtllm_mla (sglang#24633) and fa3 (sglang#12178) unsupported on SM120",
        ),
        Opt(
            ("--disable-custom-all-reduce",),
            None,
            "custom all-reduce fails under CUDA-graph capture without NVLink (sglang#25649) "
            "and on SM12x (vllm PR #47751); NCCL is used instead",
        ),
    ),
    env={
        # rtx6kpro#15 (NCCL 2.30.4, 2x RTX PRO 6000, PCIe): first all_reduce hangs
        # unless P2P is off; NVIDIA/nccl#1999 reports the same on dual RTX Pro 6000.
        # Traffic then goes through shared memory (needs --ipc=host / big --shm-size).
        "NCCL_P2P_DISABLE": "1",
        # Set together with NCCL_P2P_DISABLE in the rtx6kpro#15 report (lead: not
        # shown to be needed on their own).
        "NCCL_CUMEM_ENABLE": "0",
        "NCCL_CUMEM_HOST_ENABLE": "0",
    },
    applies=lambda ctx: ctx.is_sm120,
)

KIMI_K25 = Profile(
    name="kimi-k25",
    description="Serve Kimi-K2.5 (DeepseekV3 architecture, MLA) from /models on all visible GPUs.",
    sources=(
        # Parser names as registered in SGLang 0.5.17:
        # srt/function_call/function_call_parser.py ToolCallParserEnum "kimi_k2",
        # srt/parser/reasoning_parser.py DetectorMap "kimi_k2" (<think>...</think>).
        "sglang 0.5.17 python/sglang/srt/function_call/function_call_parser.py",
        "sglang 0.5.17 python/sglang/srt/parser/reasoning_parser.py",
        # SGLang 0.5.23 serves the INT4 experts through fused_marlin_moe, whose two GEMMs it
        # JIT-compiles at the first start, one single-threaded nvcc each (14 min on an H100
        # host; docs/verification.md). nvcc reads NVCC_APPEND_FLAGS itself; --split-compile=8
        # spreads each compile over 8 threads (120 s per GEMM there:
        # tests/gpu/results-2026-12-05-h100-v0.5.23-s7-kimi-slice-prebuild.log). Bounded,
        # not 0 (= every host CPU, which nvcc counts past a container's quota), so that
        # the compiles' memory stays bounded on a 200-CPU node.
        "https://docs.nvidia.com/cuda/cuda-compiler-driver-nvcc/#split-compile-number-split-compile",
    ),
    opts=(
        Opt(("--model-path", "--model"), "{model}", "KIMI_SGLANG_MODEL, default /models/Kimi-K2.5"),
        Opt(("--tp-size", "--tp", "--tensor-parallel-size"), "{gpu_count}", "one TP rank per visible GPU"),
        Opt(("--trust-remote-code",), None, "Kimi ships custom modeling code"),
        Opt(("--tool-call-parser",), "kimi_k2"),
        Opt(("--reasoning-parser",), "kimi_k2"),
        Opt(("--host",), "0.0.0.0", "reachable from outside the container"),
        Opt(("--port",), "{port}", "KIMI_SGLANG_PORT, default 30000 (HEALTHCHECK reads it too)"),
    ),
    env={"NVCC_APPEND_FLAGS": "--split-compile=8"},  # the first start's Marlin MoE JIT in parallel
)

# Order matters only for the order flags appear in the command.
PROFILES: tuple[Profile, ...] = (KIMI_K25, SM120)


# ---------------------------------------------------------------------------
# Detection
# ---------------------------------------------------------------------------

Runner = Callable[[Sequence[str]], str]
_CAP = re.compile(r"[0-9]{1,3}\.[0-9]{1,3}", re.ASCII)  # nvidia-smi's compute_cap, e.g. "12.0"
_UINT = re.compile(r"[0-9]{1,9}", re.ASCII)  # int() and str.isdigit() take other scripts' digits too


def _run_nvidia_smi(cmd: Sequence[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30).stdout


def detect_compute_caps(environ: Mapping[str, str], runner: Runner | None = None) -> tuple[str, ...]:
    """Compute capabilities of the visible GPUs (``()`` when unknown).

    ``KIMI_SGLANG_COMPUTE_CAP`` (comma list of ``MAJOR.MINOR`` in ASCII digits, at most
    ``MAX_GPUS``) wins; otherwise ``nvidia-smi --query-gpu=compute_cap
    --format=csv,noheader``, narrowed to ``CUDA_VISIBLE_DEVICES`` when that lists numeric
    (ASCII) indices. Raises ``SystemExit`` with one sentence for a bad
    ``KIMI_SGLANG_COMPUTE_CAP``.
    """
    forced = environ.get("KIMI_SGLANG_COMPUTE_CAP", "").strip()
    if forced:
        caps = tuple(c.strip() for c in forced.split(",") if c.strip())
        bad = [c for c in caps if not _CAP.fullmatch(c)]
        if bad or not caps:
            raise SystemExit(f"kimi-sglang: KIMI_SGLANG_COMPUTE_CAP must be a comma list of "
                             f"compute capabilities, one per GPU (e.g. 12.0,12.0), got {forced!r}")
        if len(caps) > MAX_GPUS:
            raise SystemExit(f"kimi-sglang: KIMI_SGLANG_COMPUTE_CAP must be a list of at most "
                             f"{MAX_GPUS} compute capabilities (one host's GPUs), got {len(caps)}")
        return caps
    if runner is None:
        if shutil.which("nvidia-smi") is None:
            return ()
        runner = _run_nvidia_smi
    try:
        out = runner(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"])
    except (OSError, subprocess.SubprocessError):
        return ()
    caps = [line.strip() for line in out.splitlines() if line.strip()]
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() not in ("", "all"):
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if all(_UINT.fullmatch(i) for i in ids):
            caps = [caps[int(i)] for i in ids if int(i) < len(caps)]
        else:  # UUIDs / MIG ids: keep the count only
            caps = caps[: len(ids)]
    return tuple(caps)


def make_context(environ: Mapping[str, str], compute_caps: Sequence[str] | None = None, runner: Runner | None = None) -> Context:
    """The facts the profiles decide on: compute capabilities, GPU count, model, port.

    ``KIMI_SGLANG_GPU_COUNT`` (1 to ``MAX_GPUS``) replaces the detected count,
    ``KIMI_SGLANG_PORT`` (1 to 65535; passed on as a plain decimal) the default port,
    ``KIMI_SGLANG_MODEL`` (blank: the default; no whitespace around it) the model path.
    Both take ASCII digits only: ``str.isdigit`` and ``int`` also take other scripts'
    digits, which would reach SGLang as given or raise. Raises ``SystemExit`` with one
    sentence naming the variable."""
    caps = tuple(compute_caps) if compute_caps is not None else detect_compute_caps(environ, runner)
    count: int | None = len(caps) or None
    raw = (environ.get("KIMI_SGLANG_GPU_COUNT") or "").strip()
    if raw:
        if not (_UINT.fullmatch(raw) and 1 <= int(raw) <= MAX_GPUS):
            raise SystemExit(f"kimi-sglang: KIMI_SGLANG_GPU_COUNT must be a whole number of GPUs "
                             f"from 1 to {MAX_GPUS} (this host's), got {raw!r}")
        count = int(raw)
    port = (environ.get("KIMI_SGLANG_PORT") or "").strip()
    if port:
        if not (_UINT.fullmatch(port) and 1 <= int(port) <= 65535):
            raise SystemExit(f"kimi-sglang: KIMI_SGLANG_PORT must be a TCP port number from 1 to "
                             f"65535, got {port!r}")
        port = str(int(port))
    model = environ.get("KIMI_SGLANG_MODEL") or ""
    if model.strip() and model != model.strip():
        raise SystemExit(f"kimi-sglang: KIMI_SGLANG_MODEL must be a model path or name without whitespace "
                         f"around it, got {model!r}")
    return Context(
        compute_caps=caps,
        gpu_count=count,
        model=model.strip() or DEFAULT_MODEL,
        port=port or DEFAULT_PORT,
    )


# ---------------------------------------------------------------------------
# Command building
# ---------------------------------------------------------------------------


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]  # the full environment to exec with
    profile_env: dict[str, str]  # the effective values of the keys profiles touch
    applied: list[str]
    warnings: list[str]
    print_command: bool = False
    dump_dir: str | None = None

    def render(self) -> str:
        head = ["env", *(f"{k}={v}" for k, v in sorted(self.profile_env.items()))] if self.profile_env else []
        return shlex.join(head + self.argv)


def _flag_name(token: str) -> str | None:
    if token.startswith("--"):
        return token.split("=", 1)[0]
    return None


def _looks_like_option(token: str) -> bool:
    """Whether argparse takes ``token`` for an option, not a value: it starts with ``-``
    and is neither ``-`` alone nor a negative number (``argparse._parse_optional``)."""
    return len(token) > 1 and token.startswith("-") and not re.fullmatch(r"-[0-9]+|-[0-9]*\.[0-9]+", token)


def _option_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    """Last value the user gave for a flag (``--f v`` or ``--f=v``); as argparse, a next
    word that looks like an option (``--f --port``) is no value."""
    value = None
    for i, tok in enumerate(args):
        name = _flag_name(tok)
        if name in names:
            if "=" in tok:
                value = tok.split("=", 1)[1]
            elif i + 1 < len(args) and not _looks_like_option(args[i + 1]):
                value = args[i + 1]
    return value


def config_file_flags(args: Sequence[str]) -> dict[str, object]:
    """The flags set in the user's ``--config FILE`` (SGLang's YAML of server flags,
    ``server_args_config_parser.ConfigArgumentMerger``), as ``{"--flag-name": value}``;
    ``{}`` without one. SGLang places the file's flags before the command line's, so a
    profile default on the command line would replace the file's setting: each key counts
    as a flag the user gave. As SGLang, only ``--config PATH`` (two words) is a config
    file; an unreadable or malformed one gives ``{}`` and is left to SGLang to refuse."""
    args = list(args)
    if "--config" not in args or args.index("--config") + 1 >= len(args):
        return {}
    try:
        import yaml  # SGLang's own dependency, as its config reader

        with open(args[args.index("--config") + 1], encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except Exception:  # noqa: BLE001 - SGLang reads the file again and says what is wrong
        return {}
    if not isinstance(data, dict):
        return {}
    return {"--" + str(k).replace("_", "-"): v for k, v in data.items()}


def split_own_options(argv: Sequence[str]) -> tuple[list[str], set[str], set[str], bool]:
    """Take the entrypoint's own options out of argv."""
    rest: list[str] = []
    no_profile: set[str] = set()
    no_default: set[str] = set()
    print_command = False
    i = 0
    while i < len(argv):
        tok = argv[i]
        name = _flag_name(tok)
        if name in ("--no-profile", "--no-default"):
            if "=" in tok:
                val = tok.split("=", 1)[1]
            else:
                if i + 1 >= len(argv):
                    raise SystemExit(f"kimi-sglang: {name} needs a value")
                i += 1
                val = argv[i]
            (no_profile if name == "--no-profile" else no_default).update(v for v in val.split(",") if v)
        elif tok == "--print-command":
            print_command = True
        else:
            rest.append(tok)
        i += 1
    return rest, no_profile, no_default, print_command


def build_launch(
    argv: Sequence[str],
    environ: Mapping[str, str] | None = None,
    compute_caps: Sequence[str] | None = None,
    runner: Runner | None = None,
    profiles: Sequence[Profile] = PROFILES,
    python: str | None = None,
) -> Launch:
    environ = dict(os.environ if environ is None else environ)
    user_args, no_profile, no_default, print_command = split_own_options(argv)
    # SGLang reads a config file only for the two words `--config FILE`; its parser takes
    # `--config=FILE` too and drops the file without a word
    user_args = [w for a in user_args
                 for w in (["--config", a.split("=", 1)[1]] if a.startswith("--config=") else [a])]
    no_profile |= {p.strip() for p in environ.get("KIMI_SGLANG_NO_PROFILE", "").split(",") if p.strip()}
    known = {p.name for p in profiles}
    unknown = no_profile - known
    if unknown:
        raise SystemExit(f"kimi-sglang: unknown profile(s) {sorted(unknown)}; known: {sorted(known)}")

    spellings = {n for p in profiles for o in p.opts for n in o.names}
    not_defaults = no_default - spellings
    if not_defaults:
        raise SystemExit(f"kimi-sglang: --no-default {', '.join(sorted(not_defaults))}: not a "
                         f"default flag of any profile (they are: "
                         f"{', '.join(sorted(o.flag for p in profiles for o in p.opts))}); "
                         f"`kimi-sglang --help` lists them")

    ctx = make_context(environ, compute_caps, runner)
    from_file = config_file_flags(user_args)
    user_flags = {n for n in map(_flag_name, user_args) if n} | set(from_file)

    defaults: list[str] = []
    profile_env: dict[str, str] = {}
    applied: list[str] = []
    warnings: list[str] = []
    for prof in profiles:
        if prof.name in no_profile or not prof.applies(ctx):
            continue
        applied.append(prof.name)
        for opt in prof.opts:
            if user_flags & set(opt.names) or set(opt.names) & no_default:
                continue
            if opt.value is None:
                defaults.append(opt.flag)
                continue
            fields = ctx.fields()
            if any("{" + k + "}" in opt.value and v is None for k, v in fields.items()):
                continue  # e.g. no GPU counted: leave --tp-size to SGLang
            defaults += [opt.flag, opt.value.format(**fields)]
        for key, value in prof.env.items():
            profile_env[key] = environ.get(key, value)  # the user's env wins

    if ctx.is_sm120:
        for flag in ATTENTION_FLAGS:
            val = _option_value(user_args, (flag,))
            val = str(from_file.get(flag)) if val is None and flag in from_file else val
            if val in SM120_BAD_ATTENTION:
                warnings.append(
                    f"kimi-sglang: WARNING: {flag} {val} on SM120 GPUs: {SM120_BAD_ATTENTION[val]}. "
                    "Passing it through as asked."
                )
    port = _option_value(user_args, ("--port",))
    port = str(from_file["--port"]) if port is None and from_file.get("--port") is not None else port
    if port is not None and (str(int(port)) if _UINT.fullmatch(port) else port) != ctx.port:
        warnings.append(
            f"kimi-sglang: WARNING: --port {port} is not KIMI_SGLANG_PORT ({ctx.port}), the port the "
            f"image's HEALTHCHECK probes, so the container will be reported unhealthy; give "
            f"-e KIMI_SGLANG_PORT={port} instead of --port"
        )
    if not ctx.compute_caps:
        warnings.append(
            "kimi-sglang: note: no GPU compute capability found (nvidia-smi missing or failed; "
            "set KIMI_SGLANG_COMPUTE_CAP to force one); the sm120 profile is off and --tp-size is left to SGLang."
        )

    dump_dir = _option_value(user_args, ("--dump-hidden-states-dir",))
    if dump_dir is None and from_file.get("--dump-hidden-states-dir") is not None:
        dump_dir = str(from_file["--dump-hidden-states-dir"])
    env = dict(environ)
    env.update(profile_env)
    argv_out = [python or sys.executable or "python3", "-m", LAUNCH_MODULE, *defaults, *user_args]
    return Launch(
        argv=argv_out,
        env=env,
        profile_env=profile_env,
        applied=applied,
        warnings=warnings,
        print_command=print_command,
        dump_dir=dump_dir,
    )


# The server flags patch 0001 adds (SGLang's --help lists them too, among 2,000 lines).
DUMP_FLAGS = (
    ("--dump-hidden-states-dir DIR", "turn dumping on: one safetensors file per request in DIR "
     "(made 0700 if missing; must be yours, writable by others only if sticky; "
     "/dev/shm/... keeps it in RAM); mooncake://HOST:PORT?... puts each request into "
     "Mooncake Store instead (docs/store.md)"),
    ("--dump-hidden-states-layers IDS", "comma list of layer ids, default 2,N/2,N-3,N"),
    ("--dump-hidden-states-max-host-mb MB", "host memory for rows waiting to be written "
     "(default 4096); when full, prefill waits for the writer"),
    ("--dump-hidden-states-dtype D", "auto (the model's, default), bf16 or fp8 (float8_e4m3fn "
     "plus float32 scales per token and layer: half the bytes)"),
)
ENV_VARS = (
    ("KIMI_SGLANG_MODEL", f"model path (default {DEFAULT_MODEL})"),
    ("KIMI_SGLANG_PORT", f"server port (default {DEFAULT_PORT}; the HEALTHCHECK reads it too)"),
    ("KIMI_SGLANG_GPU_COUNT", "GPU count for --tp-size (default: counted by nvidia-smi)"),
    ("KIMI_SGLANG_COMPUTE_CAP", "comma list of compute capabilities, one per GPU, e.g. "
     "12.0,12.0 (default: nvidia-smi)"),
    ("KIMI_SGLANG_NO_PROFILE", "comma list of profiles to turn off, as --no-profile"),
)


def help_text(profiles: Sequence[Profile] = PROFILES) -> str:
    """``kimi-sglang --help``: our options, the profiles' defaults, the dump flags, the
    environment; SGLang's own help is one command away."""
    w = 38

    def row(name: str, text: str) -> str:
        line = f"  {name:<{w}} {text}" if len(name) < w else f"  {name}\n  {'':<{w}} {text}"
        return line.rstrip()

    lines = [
        "usage: kimi-sglang [OPTIONS] [SGLANG SERVER FLAGS ...]",
        "       kimi-sglang COMMAND [ARGS ...]   (an executable, e.g. python or bash, runs as given)",
        "",
        "Starts `python -m sglang.launch_server` with the defaults of the profiles that apply",
        "(below) and your flags; a flag you give (in a --config file too) replaces a profile's default.",
        "",
        "kimi-sglang options (not passed to SGLang):",
        row("--print-command", "print the final command and environment, start nothing"),
        row("--no-profile NAME", "turn a profile off (repeatable, or a comma list)"),
        row("--no-default FLAG", "drop one default flag (repeatable, or a comma list)"),
        row("--help-sglang", "SGLang's own server flags (python -m sglang.launch_server --help)"),
        "",
        "Hidden-state dump flags (SGLang server flags added by the kimi-sglang patch):",
        *(row(n, t) for n, t in DUMP_FLAGS),
        "",
        "Profiles and their defaults:",
    ]
    for prof in profiles:
        lines.append(f"  {prof.name}: {prof.description}")
        for opt in prof.opts:
            value = (opt.value or "").format(model="$KIMI_SGLANG_MODEL", port="$KIMI_SGLANG_PORT",
                                             gpu_count="<GPU count>")
            lines.append(row(f"  {opt.flag} {value}".rstrip(), opt.why.split(";")[0].split(" (")[0]))
        for key, value in prof.env.items():
            lines.append(row(f"  env {key}={value}", "unless set already"))
    lines += ["", "Environment:", *(row(n, t) for n, t in ENV_VARS),
              "", "SGLang's own flags: kimi-sglang --help-sglang (or python -m sglang.launch_server --help)"]
    return "\n".join(lines) + "\n"


def prepare_dump_dir(path: str) -> int:
    """Make the dump directory if missing (``mkdir -p``; the last level 0700, the umask
    applying as to any ``mkdir``) and refuse one the patched server would refuse: not
    owned by this user, writable by group or others without the sticky bit, or not
    writable (``config.check_directory``, OpenSSH's ``StrictModes`` rules). Returns 0, or
    2 after one sentence on stderr. A ``mooncake://`` address (the store sink,
    docs/store.md) is no directory: nothing is made, the address is only parsed
    (``config.store_target``); the server checks that its master answers."""
    from sglang_ext.config import DumpConfigError, check_directory, store_target

    try:
        if store_target(path) is not None:
            return 0
    except DumpConfigError as exc:
        print(f"kimi-sglang: {exc}", file=sys.stderr)
        return 2

    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        if os.path.islink(path) and not os.path.exists(path):  # made neither: an NFS mount not there yet
            why = f"it is a symbolic link to {os.readlink(path)}, which does not exist: mount or make that first"
        elif isinstance(exc, FileExistsError):
            why = "it is a file"
        else:
            why = exc.strerror or str(exc)
        print(f"kimi-sglang: --dump-hidden-states-dir {path}: cannot make the "
              f"directory ({why})", file=sys.stderr)
        return 2
    try:
        check_directory(path)
    except DumpConfigError as exc:
        print(f"kimi-sglang: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    # Pass-through: `kimi-sglang python -m ...`, `kimi-sglang bash`, ...
    if argv and not argv[0].startswith("-") and shutil.which(argv[0]):
        os.execvp(argv[0], argv)
    if "--help-sglang" in argv:
        os.execvp(sys.executable, [sys.executable, "-m", LAUNCH_MODULE, "--help"])
    if "-h" in argv or "--help" in argv:
        sys.stdout.write(help_text())
        return 0

    launch = build_launch(argv)
    for w in launch.warnings:
        print(w, file=sys.stderr)
    if launch.print_command:
        print(f"# kimi-sglang: profiles applied: {', '.join(launch.applied) or '(none)'}")
        print(launch.render())
        return 0
    if launch.dump_dir:
        code = prepare_dump_dir(launch.dump_dir)
        if code:
            return code
    print(f"kimi-sglang: profiles: {', '.join(launch.applied) or '(none)'}; exec: {launch.render()}", file=sys.stderr, flush=True)
    os.execvpe(launch.argv[0], launch.argv, launch.env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
