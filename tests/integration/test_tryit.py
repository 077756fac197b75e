"""The README's "Try it without a GPU" commands, run verbatim as a new user runs them.

The fenced bash block of that section is taken out of README.md and run line by line,
unchanged, in a copy of this working tree, with a fresh venv (from PyPI, as a user's
``pip install -e '.[client]'``: about 20 s here; skipped only when PyPI is unreachable) first
on PATH and nothing of the test venv visible (no PYTHONPATH, no torch). The ``pip`` lines run
first; the rest (the stand-in on SGLang's port 30000) runs in a network namespace of its
own where this user may make one (root, as CI), so a server on this host's port 30000 cannot
answer in its place; elsewhere that port must be free.

Then the ``hs_<i>.safetensors`` it made are read byte by byte (the header parsed here, the
bf16 bits widened here) and compared with the stand-in's documented values recomputed in
plain Python ints (``reference``, from ``sglang_ext.tools.standin.values``' docstring), and
the dump directory's ``index.jsonl`` and names with the README's file contract.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OFFLINE_HINTS = ("NewConnectionError", "Network is unreachable", "Temporary failure in name resolution",
                 "Name or service not known", "ConnectTimeout", "Max retries exceeded", "ProxyError")
META_KEYS = {"format", "rid", "layer_ids", "num_layers", "model_path", "sglang_version",
             "sglang_ext_version", "series"}
LAYERS, HIDDEN = [2, 4, 5, 8], 64  # the stand-in's defaults: N = 8, [2, N//2, N-3, N]
M32 = 0xFFFFFFFF


def tryit_lines() -> list:
    """The commands of README.md's ``## Try it without a GPU`` fenced bash block."""
    text = (REPO / "README.md").read_text()
    assert "\n## Try it without a GPU\n" in text, "README.md has no '## Try it without a GPU' section"
    section = text.split("\n## Try it without a GPU\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the 'Try it without a GPU' section has no ```bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def reference(token_ids, layer_id, t, h) -> float:
    """The stand-in's documented value of token ``t`` (id ``token_ids[t]``), layer id
    ``layer_id``, channel ``h``: key -> lowbias32 -> ((x >> 24) - 128) / 64."""
    x = (token_ids[t] * 0x9E3779B1 + t * 0x85EBCA77 + layer_id * 0xC2B2AE3D + h) & M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return ((x >> 24) - 128) / 64


def read_safetensors(path: Path):
    """``(metadata, {name: (dtype, shape, bytes)}, data_start)``, parsed here by hand."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    start = 8 + n
    tensors = {k: (v["dtype"], v["shape"], raw[start + v["data_offsets"][0]:start + v["data_offsets"][1]])
               for k, v in header.items() if k != "__metadata__"}
    return header.get("__metadata__", {}), tensors, start


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked files, not the ignored ones)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, names):
        src = REPO / os.fsdecode(name)
        if src.is_file():
            (dest / src.relative_to(REPO)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / src.relative_to(REPO))


def private_network() -> list:
    """A prefix that runs a command in a network namespace of its own with loopback up,
    or [] where this user cannot make one."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return []
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True)
    return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"] if probe.returncode == 0 else []


@pytest.mark.network
def test_readme_tryit_commands_verbatim(tmp_path):
    lines = tryit_lines()
    installs = [line for line in lines if line.startswith("pip install")]
    rest = [line for line in lines if not line.startswith("pip install")]
    assert installs == ["pip install -e '.[client]'"], installs
    clone = tmp_path / "clone"
    copy_tree(clone)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv))

    for line in installs:
        done = subprocess.run(["bash", "-c", line], cwd=clone, env=env, capture_output=True, text=True,
                              timeout=600)
        if done.returncode and any(h in done.stdout + done.stderr for h in OFFLINE_HINTS):
            pytest.skip(f"PyPI unreachable: {done.stderr[-300:]}")
        assert done.returncode == 0, f"{line!r} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    no_torch = subprocess.run([str(venv / "bin" / "python"), "-c",
                               "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"])
    assert no_torch.returncode == 0, "the [client] install brought torch in"

    (clone / "tryit.sh").write_text("\n".join(rest) + "\n")
    prefix = private_network()
    if not prefix:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", 30000)) != 0, (
                "port 30000 is taken here and no private network namespace can be made: the README's "
                "commands need it free")
    proc = subprocess.Popen(prefix + ["bash", "-e", "tryit.sh"], cwd=clone, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the stand-in, should `kill %1` have missed it
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"the README's commands failed ({proc.returncode}):\n{out}\n{err}"
    assert "Traceback" not in err, err
    assert out.strip().splitlines()[-1] == f"{LAYERS} [4, {len(LAYERS)}, {HIDDEN}]", out

    dump = clone / "dump"
    index = [json.loads(line) for line in (dump / "index.jsonl").read_text().splitlines()]
    assert sorted(p.name for p in dump.iterdir()) == ["index.jsonl"], "the dump directory kept more"
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    for i, ids in enumerate(prompts):
        path = clone / "out" / f"hs_{i}.safetensors"
        meta, tensors, start = read_safetensors(path)
        assert set(meta) == META_KEYS, meta
        assert (meta["format"], meta["model_path"], meta["num_layers"]) == ("kimi-sglang/1", "kimi-sglang standin", "8")
        assert json.loads(meta["layer_ids"]) == LAYERS
        assert start % 4096 == 0, f"tensor data starts at {start}, not on a page as the server lays it out"
        dtype, shape, hs = tensors["hidden_states"]
        assert (dtype, shape) == ("BF16", [len(ids), len(LAYERS), HIDDEN])
        assert tensors["token_ids"][:2] == ("I64", [len(ids)])
        assert list(struct.unpack(f"<{len(ids)}q", tensors["token_ids"][2])) == ids
        bits = struct.unpack(f"<{len(ids) * len(LAYERS) * HIDDEN}H", hs)
        got = [struct.unpack("<f", struct.pack("<I", b << 16))[0] for b in bits]
        want = [reference(ids, layer, t, h) for t in range(len(ids)) for layer in LAYERS for h in range(HIDDEN)]
        diff = [k for k, (a, b) in enumerate(zip(got, want)) if a != b]
        assert not diff, f"hs_{i}: {len(diff)} values differ, first at flat index {diff[0]}: {got[diff[0]]} != {want[diff[0]]}"
        assert len(set(want)) > 50, "the reference is not pseudo-random"
        rid = meta["rid"]
        record = next(r for r in index if r["rid"] == rid)
        name = f"{rid}-{hashlib.sha256(rid.encode()).hexdigest()[:8]}.safetensors"  # rid is [A-Za-z0-9-]
        assert record == {"rid": rid, "file": name, "num_tokens": len(ids), "bytes": path.stat().st_size,
                          "layer_ids": json.dumps(LAYERS)}, record
    assert len(index) == len(prompts)
