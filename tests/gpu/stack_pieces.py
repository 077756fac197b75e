"""Stage a Python stack for the offline device host in pieces of at most 58 MiB (one
carried folder per device call), then reassemble and install it there.

Used by tests/gpu/stage-stack.sh (which says what is staged and why); standard library
only, Python 3.10+ (the device has 3.12). Subcommands:

  here (a machine with the files):
    trim SRC.whl DST.whl GLOB...     copy a wheel without the members matching any GLOB
                                     (RECORD rewritten to match)
    take SRC.whl DST.tar.gz GLOB...  the members matching a GLOB, as a reproducible tar.gz
    pack OUT SPEC [MAX_BYTES] [--chain SET,SET...]
                                     cut the files SPEC names into OUT/pNN/ folders
  there (the device host):
    put PIECE_DIR...                 move a piece's parts into the store, install every
                                     file whose parts are all there; idempotent
    status                           what is installed, which pieces are still missing
    env sglang|vllm                  shell lines to eval: PYTHONPATH etc. for that stack

SPEC: one file per line, `SET GROUP KIND PATH`: SET names a part of a stack, GROUP the
install target (ROOT/stack-GROUP), KIND `wheel` (pip install --no-deps --no-index
--target) or `tar` (extracted there). The files of a set are laid end to end in the order
given and cut every MAX_BYTES, so a set takes ceil(its bytes / MAX_BYTES) pieces and each
file installs as soon as the piece holding its last byte arrives. Pieces never mix sets
(one can be skipped), except the sets named by --chain: they form one stream, each set
completing in the piece where the next begins (one piece fewer than apart, mostly).

Each piece folder carries MANIFEST.tsv (the same for all pieces of one pack): one line per
part with its piece, sha256 and the file it belongs to (with the file's sha256). The
store (KIMI_STACK_STORE, default /tmp/stack-pieces) keeps parts until their file is
installed, then only a marker; install targets are KIMI_STACK_ROOT/stack-GROUP (default
/tmp).
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass

MAX_BYTES = 58 << 20
HEADER = ["piece", "part", "index", "count", "part_bytes", "part_sha256", "set", "group",
          "kind", "file", "file_bytes", "file_sha256"]
CHUNK = 1 << 20


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                return h.hexdigest()
            h.update(b)


# --- here: making the files and the pieces -------------------------------------------------

def trim_wheel(src, dst, drop):
    """Copy wheel ``src`` to ``dst`` without the members matching a glob of ``drop``; the
    RECORD loses their lines. Member order and timestamps are kept (a reproducible file)."""
    def dropped(name):
        return any(fnmatch.fnmatch(name, g) for g in drop)

    removed = []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst + ".tmp", "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if dropped(info.filename):
                removed.append(info.filename)
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(ln for ln in lines if not dropped(ln.split(",", 1)[0])).encode()
            out = zipfile.ZipInfo(info.filename, info.date_time)
            out.external_attr = info.external_attr
            out.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(out, data, compresslevel=6)
    if not removed:
        os.unlink(dst + ".tmp")
        raise SystemExit(f"trim: nothing in {src} matches {drop}")
    os.replace(dst + ".tmp", dst)
    return removed


def take_members(src, dst, take):
    """The members of wheel ``src`` matching a glob of ``take``, as a tar.gz at ``dst``
    (paths as in the wheel; mtime and owners fixed, so the same input gives the same file)."""
    n = 0
    with zipfile.ZipFile(src) as zin, open(dst + ".tmp", "wb") as raw, \
            gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0, compresslevel=6) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info in zin.infolist():
            if info.is_dir() or not any(fnmatch.fnmatch(info.filename, g) for g in take):
                continue
            data = zin.read(info)
            ti = tarfile.TarInfo(info.filename)
            ti.size = len(data)
            ti.mode = 0o755 if (info.external_attr >> 16) & 0o111 else 0o644
            ti.mtime = 0
            tar.addfile(ti, io.BytesIO(data))
            n += 1
    if not n:
        os.unlink(dst + ".tmp")
        raise SystemExit(f"take: nothing in {src} matches {take}")
    os.replace(dst + ".tmp", dst)
    return n


@dataclass
class Part:
    piece: str
    part: str
    index: int
    count: int
    part_bytes: int
    part_sha256: str
    set: str
    group: str
    kind: str
    file: str
    file_bytes: int
    file_sha256: str

    def row(self):
        return "\t".join(str(getattr(self, k)) for k in HEADER)


def read_spec(path):
    entries = []
    for ln in open(path):
        ln = ln.split("#", 1)[0].strip()
        if not ln:
            continue
        st, group, kind, fpath = ln.split()
        if kind not in ("wheel", "tar"):
            raise SystemExit(f"spec: kind must be wheel or tar: {ln}")
        entries.append((st, group, kind, fpath))
    return entries


def plan(entries, max_bytes=MAX_BYTES, chain=()):
    """Lay the files of each stream end to end and cut every ``max_bytes``. A stream is one
    set, or the sets named in ``chain`` together (in spec order: a set of the chain then
    completes in the piece where the next one begins). Returns [part, path, offset into
    the file] in piece order; pieces are numbered p01, p02, ... across streams."""
    streams = []
    for e in entries:
        key = "chain" if e[0] in chain else e[0]
        if key not in streams:
            streams.append(key)
    names = [os.path.basename(e[3]) for e in entries]
    if len(set(names)) != len(names):
        raise SystemExit("pack: two files with one name")
    out, piece_no = [], 0
    for stream in streams:
        piece_no += 1
        room = max_bytes
        for st, group, kind, fpath in entries:
            if ("chain" if st in chain else st) != stream:
                continue
            size = os.path.getsize(fpath)
            fsha = sha256_file(fpath)
            cuts, off = [], 0
            while True:
                if room == 0:
                    piece_no += 1
                    room = max_bytes
                n = min(room, size - off)
                cuts.append((piece_no, off, n))
                off += n
                room -= n
                if off >= size:
                    break
            name = os.path.basename(fpath)
            for i, (pn, off, n) in enumerate(cuts, 1):
                out.append([Part(f"p{pn:02d}", f"{name}.part{i:02d}", i, len(cuts), n, "", st, group,
                                 kind, name, size, fsha), fpath, off])
    return out


def pack(out_dir, spec, max_bytes=MAX_BYTES, chain=()):
    """Write OUT/pNN/<file>.partKK and OUT/pNN/MANIFEST.tsv (+ OUT/MANIFEST.tsv); return
    the parts. An earlier OUT/p* is removed first."""
    entries = read_spec(spec)
    parts = plan(entries, max_bytes, chain)
    for d in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        if d.startswith("p") and d[1:].isdigit():
            shutil.rmtree(os.path.join(out_dir, d))
    for p, fpath, off in parts:
        pdir = os.path.join(out_dir, p.piece)
        os.makedirs(pdir, exist_ok=True)
        h = hashlib.sha256()
        with open(fpath, "rb") as fi, open(os.path.join(pdir, p.part), "wb") as fo:
            fi.seek(off)
            left = p.part_bytes
            while left:
                b = fi.read(min(CHUNK, left))
                if not b:
                    raise SystemExit(f"pack: {fpath} shorter than expected")
                h.update(b)
                fo.write(b)
                left -= len(b)
        p.part_sha256 = h.hexdigest()
    text = "\t".join(HEADER) + "\n" + "".join(p.row() + "\n" for p, _, _ in parts)
    for piece in sorted({p.piece for p, _, _ in parts}):
        with open(os.path.join(out_dir, piece, "MANIFEST.tsv"), "w") as f:
            f.write(text)
    with open(os.path.join(out_dir, "MANIFEST.tsv"), "w") as f:
        f.write(text)
    return [p for p, _, _ in parts]


def summary(parts):
    """Per set: bytes, pieces and their range; per piece: its bytes."""
    lines = []
    for st in dict.fromkeys(p.set for p in parts):
        ps = [p for p in parts if p.set == st]
        pieces = list(dict.fromkeys(p.piece for p in ps))
        files = list(dict.fromkeys(p.file for p in ps))
        total = sum(p.part_bytes for p in ps)
        lines.append(f"{st}: {len(files)} files, {total} bytes ({total / 2**20:.1f} MiB), "
                     f"{len(pieces)} pieces {pieces[0]}..{pieces[-1]}")
    for piece in dict.fromkeys(p.piece for p in parts):
        b = sum(p.part_bytes for p in parts if p.piece == piece)
        lines.append(f"  {piece}: {b / 2**20:.1f} MiB")
    return "\n".join(lines)


# --- there: putting pieces, installing ---------------------------------------------------

def read_manifest(path):
    with open(path) as f:
        rows = [ln.rstrip("\n").split("\t") for ln in f if ln.strip()]
    if rows[0] != HEADER:
        raise SystemExit(f"{path}: not a stack manifest")
    parts = []
    for r in rows[1:]:
        d = dict(zip(HEADER, r))
        for k in ("index", "count", "part_bytes", "file_bytes"):
            d[k] = int(d[k])
        parts.append(Part(**d))
    return parts


class Store:
    def __init__(self, store=None, root=None, python=None):
        self.dir = store or os.environ.get("KIMI_STACK_STORE", "/tmp/stack-pieces")
        self.root = root or os.environ.get("KIMI_STACK_ROOT", "/tmp")
        self.python = python or sys.executable
        self.parts_dir = os.path.join(self.dir, "parts")
        self.done_dir = os.path.join(self.dir, "done")
        self.manifest_path = os.path.join(self.dir, "MANIFEST.tsv")

    def target(self, group):
        return os.path.join(self.root, f"stack-{group}")

    def manifest(self):
        return read_manifest(self.manifest_path) if os.path.exists(self.manifest_path) else None

    def is_done(self, p):
        m = os.path.join(self.done_dir, p.file)
        return os.path.exists(m) and open(m).read().strip() == p.file_sha256

    def have_part(self, p):
        return os.path.exists(os.path.join(self.parts_dir, p.part))

    # -- put --
    def put(self, piece_dir, log=print):
        """Move the parts of ``piece_dir`` into the store (each checked against its sha256),
        then install every file that is complete. Returns the files installed now."""
        mpath = os.path.join(piece_dir, "MANIFEST.tsv")
        if not os.path.isfile(mpath):
            raise StackError(f"{piece_dir}: no MANIFEST.tsv (not a piece folder, or not carried)")
        new = open(mpath).read()
        os.makedirs(self.parts_dir, exist_ok=True)
        os.makedirs(self.done_dir, exist_ok=True)
        if os.path.exists(self.manifest_path):
            if open(self.manifest_path).read() != new:
                raise StackError(
                    f"{piece_dir} is from another pack than the pieces already in {self.dir}: "
                    f"start over with rm -rf {self.dir} {self.root}/stack-*, or put the matching pieces")
        else:
            with open(self.manifest_path + ".tmp", "w") as f:
                f.write(new)
            os.replace(self.manifest_path + ".tmp", self.manifest_path)
        parts = read_manifest(self.manifest_path)
        piece = os.path.basename(os.path.normpath(piece_dir))
        mine = [p for p in parts if p.piece == piece]
        if not mine:
            raise StackError(f"{piece_dir}: the manifest lists no part for piece {piece}")
        for p in mine:
            src = os.path.join(piece_dir, p.part)
            if self.is_done(p) or self.have_part(p):
                if os.path.exists(src):
                    os.unlink(src)
                continue
            if not os.path.exists(src):
                raise StackError(f"{piece}: {p.part} missing from the piece folder")
            got = sha256_file(src)
            if got != p.part_sha256 or os.path.getsize(src) != p.part_bytes:
                raise StackError(f"{piece}: {p.part} is damaged (sha256 {got}, manifest {p.part_sha256})")
            tmp = os.path.join(self.parts_dir, p.part + ".tmp")
            shutil.move(src, tmp)
            os.replace(tmp, os.path.join(self.parts_dir, p.part))
        log(f"put {piece}: {len(mine)} part(s)")
        return self.install_ready(parts, log)

    def install_ready(self, parts=None, log=print):
        parts = parts if parts is not None else (self.manifest() or [])
        installed = []
        for f, ps in files_of(parts).items():
            if self.is_done(ps[0]) or not all(self.have_part(p) for p in ps):
                continue
            self.install(ps, log)
            installed.append(f)
        return installed

    def install(self, ps, log=print):
        first = ps[0]
        work = os.path.join(self.dir, "work")
        os.makedirs(work, exist_ok=True)
        whole = os.path.join(work, first.file)
        h = hashlib.sha256()
        with open(whole, "wb") as fo:
            for p in sorted(ps, key=lambda p: p.index):
                with open(os.path.join(self.parts_dir, p.part), "rb") as fi:
                    while True:
                        b = fi.read(CHUNK)
                        if not b:
                            break
                        h.update(b)
                        fo.write(b)
        if h.hexdigest() != first.file_sha256 or os.path.getsize(whole) != first.file_bytes:
            os.unlink(whole)
            raise StackError(f"{first.file}: reassembled sha256 {h.hexdigest()} != {first.file_sha256}")
        tmp = os.path.join(work, "t-" + first.file)
        shutil.rmtree(tmp, ignore_errors=True)
        if first.kind == "wheel":
            r = subprocess.run([self.python, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                                "--no-compile", "--no-cache-dir", "--disable-pip-version-check",
                                "--target", tmp, whole], capture_output=True, text=True)
            if r.returncode != 0:
                raise StackError(f"{first.file}: pip install failed\n{r.stdout}{r.stderr}")
        else:
            os.makedirs(tmp)
            with tarfile.open(whole) as tar:
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(tmp, filter="data")
                else:  # pragma: no cover - Python without the extraction filters
                    tar.extractall(tmp)
        target = self.target(first.group)
        merge_tree(tmp, target)
        shutil.rmtree(tmp, ignore_errors=True)
        os.unlink(whole)
        with open(os.path.join(self.done_dir, first.file), "w") as f:
            f.write(first.file_sha256 + "\n")
        for p in ps:
            os.unlink(os.path.join(self.parts_dir, p.part))
        log(f"installed {first.file} -> {target}")

    # -- status --
    def status(self):
        """{set: (installed files, all files, missing pieces)} for the stored manifest."""
        parts = self.manifest()
        if parts is None:
            return {}
        out = {}
        for st in dict.fromkeys(p.set for p in parts):
            files = files_of([p for p in parts if p.set == st])
            done = [f for f, ps in files.items() if self.is_done(ps[0])]
            missing = sorted({p.piece for ps in files.values() if not self.is_done(ps[0])
                              for p in ps if not self.have_part(p)})
            out[st] = (done, list(files), missing)
        return out

    def status_text(self):
        st = self.status()
        if not st:
            return f"no piece put yet (store {self.dir})"
        lines = []
        for name, (done, files, missing) in st.items():
            state = "complete" if len(done) == len(files) else \
                f"missing pieces: {' '.join(missing) or '(none; a file failed to install)'}"
            opt = " (optional)" if name.startswith("opt-") else ""
            lines.append(f"{name}{opt}: {len(done)}/{len(files)} files installed; {state}")
        return "\n".join(lines)


class StackError(Exception):
    pass


def files_of(parts):
    out = {}
    for p in parts:
        out.setdefault(p.file, []).append(p)
    return out


def merge_tree(src, dst):
    """Move everything under ``src`` into ``dst``: directories present in both are merged
    (namespace packages such as nvidia/ keep their other members), anything else replaces."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if os.path.isdir(s) and not os.path.islink(s) and os.path.isdir(d) and not os.path.islink(d):
            merge_tree(s, d)
            continue
        if os.path.islink(d) or os.path.isfile(d):
            os.unlink(d)
        elif os.path.isdir(d):
            shutil.rmtree(d)
        shutil.move(s, d)


# --- there: the environment of a stack ------------------------------------------------------

def pth_dirs(site_dir):
    """The folders that ``site_dir``'s .pth files would add to sys.path. ``pip install
    --target`` leaves .pth files unprocessed (only site-packages folders are scanned at
    start-up, PYTHONPATH entries are not), so the environment lists them itself: e.g.
    nvidia-cutlass-dsl's ``import nvidia_cutlass_dsl; sys.path.insert(0, .../dsl_packages)``,
    without which ``import cutlass.cute`` fails. Runs the .pth lines as Python does
    (``site.addsitedir``), in a child process so this one's sys.path stays as it was."""
    if not os.path.isdir(site_dir) or not any(n.endswith(".pth") for n in os.listdir(site_dir)):
        return []
    code = ("import sys, site; before = list(sys.path); site.addsitedir(sys.argv[1]); "
            "print('\\n'.join(p for p in sys.path if p not in before and p != sys.argv[1]))")
    r = subprocess.run([sys.executable, "-c", code, site_dir], capture_output=True, text=True)
    if r.returncode != 0 or "Error processing line" in r.stderr:  # site reports, never raises
        raise StackError(f"{site_dir}: its .pth files failed: {r.stderr.strip()}")
    return [line for line in r.stdout.splitlines() if line]


def env_lines(stack, root=None):
    """Shell lines that put a staged stack first: NCCL's site, torch's, then the stack's
    own (vLLM's before SGLang's site, whose shared dependencies it reuses)."""
    root = root or os.environ.get("KIMI_STACK_ROOT", "/tmp")
    t = {g: os.path.join(root, f"stack-{g}") for g in ("nccl", "torch", "triton", "sgl", "vllm")}
    path = [t["nccl"], t["torch"]]
    if os.path.isdir(t["triton"]):
        path.append(t["triton"])  # the optional triton 3.8 set, when it was put
    if stack == "sglang":
        path += [t["sgl"]]
    elif stack == "vllm":
        path += [t["vllm"], t["sgl"]]
    else:
        raise SystemExit("env: sglang or vllm")
    path += [d for site in list(path) for d in pth_dirs(site)]
    lines = [f'export PYTHONPATH="{":".join(path)}${{PYTHONPATH:+:$PYTHONPATH}}"',
             f'export LD_LIBRARY_PATH="{t["nccl"]}/nvidia/nccl/lib${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"',
             f'export PATH="{path[-1]}/bin:$PATH"' if stack == "sglang" else
             f'export PATH="{t["vllm"]}/bin:{t["sgl"]}/bin:$PATH"']
    if stack == "vllm" and not os.path.isdir(os.path.join(t["vllm"], "flashinfer", "data", "csrc")):
        # FlashInfer is staged without its JIT sources: vLLM's default top-k/top-p sampler
        # would compile from them at start-up; PyTorch's sampler instead.
        lines.append("export VLLM_USE_FLASHINFER_SAMPLER=0")
    return lines


def main(argv):
    if not argv:
        print(__doc__)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "trim":
        removed = trim_wheel(args[0], args[1], args[2:])
        print(f"trim {os.path.basename(args[0])}: {len(removed)} member(s) dropped")
    elif cmd == "take":
        n = take_members(args[0], args[1], args[2:])
        print(f"take {os.path.basename(args[0])}: {n} member(s)")
    elif cmd == "pack":
        chain = ()
        if "--chain" in args:
            i = args.index("--chain")
            chain = tuple(args[i + 1].split(","))
            args = args[:i] + args[i + 2:]
        parts = pack(args[0], args[1], int(args[2]) if len(args) > 2 else MAX_BYTES, chain)
        print(summary(parts))
    elif cmd == "put":
        store = Store()
        rc = 0
        for d in args:
            try:
                store.put(d)
            except StackError as e:
                print(f"ERROR: {e}", file=sys.stderr)
                rc = 1
        if not args:
            try:
                store.install_ready()
            except StackError as e:
                print(f"ERROR: {e}", file=sys.stderr)
                rc = 1
        print(store.status_text())
        return rc
    elif cmd == "status":
        print(Store().status_text())
    elif cmd == "env":
        print("\n".join(env_lines(args[0] if args else "sglang")))
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
