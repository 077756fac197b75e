"""tests/gpu/stack_pieces.py, the piece logic of tests/gpu/stage-stack.sh (issues 18, 23):
fake wheels cut into small pieces, put in a shuffled order (twice, and damaged), installed
by the real pip into temporary targets; the trimmed wheels and the stacks' PYTHONPATH."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import random
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu"))
import stack_pieces as sp  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "stage-stack.sh")


def make_wheel(d, name, version, files):
    """A minimal valid wheel: ``files`` {path in the wheel: bytes} plus its dist-info."""
    info = f"{name}-{version}.dist-info"
    members = dict(files)
    members[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    members[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, data in members.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    members[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = os.path.join(d, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for p, data in members.items():
            z.writestr(zipfile.ZipInfo(p, (2026, 1, 1, 0, 0, 0)), data)
    return path


def incompressible(n, seed):
    return random.Random(seed).randbytes(n)


@pytest.fixture
def staged(tmp_path):
    """Two sets chained (like sglang + vllm) and one optional set, cut in 4 KiB pieces:
    a wheel of ~10 KiB (three pieces), two wheels sharing the nvidia/ namespace in one
    target, a tar in the chained set's group."""
    src = tmp_path / "src"
    src.mkdir()
    big = make_wheel(str(src), "bigpkg", "1.0", {"bigpkg/__init__.py": b"X = 1\n",
                                                 "bigpkg/blob.bin": incompressible(10_000, 1)})
    nv1 = make_wheel(str(src), "nvidia_one", "2.0", {"nvidia/one/__init__.py": b"",
                                                    "nvidia/one/lib.bin": incompressible(3000, 2)})
    nv2 = make_wheel(str(src), "nvidia_two", "3.0", {"nvidia/two/__init__.py": b""})
    tarpath = str(src / "addon.tar.gz")
    with tarfile.open(tarpath, "w:gz") as tar:
        data = incompressible(2000, 3)
        ti = tarfile.TarInfo("bigpkg/addon.bin")
        ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data))
    opt = make_wheel(str(src), "optpkg", "0.1", {"optpkg/__init__.py": b"Y = 2\n"})
    spec = tmp_path / "spec.txt"
    spec.write_text(f"main nv wheel {nv1}\nmain nv wheel {nv2}\nmain site wheel {big}\n"
                    f"# a comment\nextra site tar {tarpath}\nopt-x opt wheel {opt}\n")
    out = tmp_path / "out"
    out.mkdir()
    parts = sp.pack(str(out), str(spec), 4096, chain=("main", "extra"))
    return {"out": out, "parts": parts, "files": {os.path.basename(p): p for p in (big, nv1, nv2, tarpath, opt)},
            "store": sp.Store(str(tmp_path / "store"), str(tmp_path / "root"), sys.executable),
            "root": tmp_path / "root", "tmp": tmp_path}


def test_pack_cuts_streams_at_the_piece_size_and_the_manifest_names_every_part(staged):
    parts, out, files = staged["parts"], staged["out"], staged["files"]
    chained = sum(os.path.getsize(f) for n, f in files.items() if not n.startswith("optpkg"))
    pieces = sorted({p.piece for p in parts})
    n_chain = -(-chained // 4096)
    assert pieces == [f"p{i:02d}" for i in range(1, n_chain + 2)]  # the chain, then opt-x alone
    assert {p.piece for p in parts if p.set == "opt-x"} == {pieces[-1]}
    for piece in pieces:
        size = sum(os.path.getsize(out / piece / f) for f in os.listdir(out / piece) if f != "MANIFEST.tsv")
        assert size <= 4096
        assert (out / piece / "MANIFEST.tsv").read_text() == (out / "MANIFEST.tsv").read_text()
    assert sp.read_manifest(str(out / "MANIFEST.tsv")) == parts
    # every file is the concatenation of its parts, in order
    for name, path in files.items():
        mine = sorted((p for p in parts if p.file == name), key=lambda p: p.index)
        assert [p.index for p in mine] == list(range(1, len(mine) + 1)) and mine[0].count == len(mine)
        data = b"".join((out / p.piece / p.part).read_bytes() for p in mine)
        assert data == open(path, "rb").read()
        assert mine[0].file_sha256 == hashlib.sha256(data).hexdigest()
    assert "main: 3 files" in sp.summary(parts)


def put_copy(staged, piece, log=None):
    """Put a copy of OUT/piece (put moves the parts away, as on the device)."""
    dst = staged["tmp"] / "carried" / piece
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(staged["out"] / piece, dst)
    return staged["store"].put(str(dst), log=log or (lambda *_: None))


def test_put_in_any_order_installs_each_file_once_its_parts_are_there(staged):
    store, parts, root = staged["store"], staged["parts"], staged["root"]
    pieces = sorted({p.piece for p in parts})
    order = pieces[:]
    random.Random(7).shuffle(order)
    installed = []
    for i, piece in enumerate(order):
        installed += put_copy(staged, piece)
        have = set(order[: i + 1])
        complete = {f for f, ps in sp.files_of(parts).items() if {p.piece for p in ps} <= have}
        assert set(installed) == complete  # installed exactly when complete, each once
        status = store.status()
        missing = sorted({p.piece for p in parts} - have)
        assert sorted({m for _, _, ms in status.values() for m in ms}) == missing
    assert sorted(installed) == sorted(staged["files"])
    # the reassembled files were the originals: markers hold their sha256, contents arrived
    for name, path in staged["files"].items():
        assert (root.parent / "store" / "done" / name).read_text().strip() == sp.sha256_file(path)
    with zipfile.ZipFile(staged["files"]["bigpkg-1.0-py3-none-any.whl"]) as z:
        assert (root / "stack-site" / "bigpkg" / "blob.bin").read_bytes() == z.read("bigpkg/blob.bin")
    assert (root / "stack-site" / "bigpkg" / "addon.bin").read_bytes() == incompressible(2000, 3)
    # two wheels sharing the nvidia/ namespace in one target keep both members
    assert (root / "stack-nv" / "nvidia" / "one" / "lib.bin").is_file()
    assert (root / "stack-nv" / "nvidia" / "two" / "__init__.py").is_file()
    assert (root / "stack-opt" / "optpkg" / "__init__.py").read_text() == "Y = 2\n"
    assert not os.listdir(root.parent / "store" / "parts")  # parts are dropped once installed
    assert "complete" in store.status_text() and "missing" not in store.status_text()
    r = subprocess.run([sys.executable, "-c", "import bigpkg, optpkg, nvidia.one, nvidia.two; print(bigpkg.X)"],
                       env={**os.environ, "PYTHONPATH": f"{root}/stack-site:{root}/stack-opt:{root}/stack-nv"},
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr


def test_put_twice_is_harmless(staged):
    store, parts = staged["store"], staged["parts"]
    first = parts[0].piece
    put_copy(staged, first)
    held = sorted(os.listdir(store.parts_dir))
    assert held and put_copy(staged, first) == [] and sorted(os.listdir(store.parts_dir)) == held
    for piece in sorted({p.piece for p in parts}):
        put_copy(staged, piece)
    done = {f: os.path.getmtime(os.path.join(store.done_dir, f)) for f in staged["files"]}
    for piece in sorted({p.piece for p in parts}):
        assert put_copy(staged, piece) == []  # nothing installed again
    assert done == {f: os.path.getmtime(os.path.join(store.done_dir, f)) for f in staged["files"]}
    assert store.install_ready() == []


def test_put_refuses_a_damaged_part_and_a_piece_of_another_pack(staged, tmp_path):
    store, parts = staged["store"], staged["parts"]
    piece = parts[0].piece
    bad = tmp_path / "bad" / piece
    shutil.copytree(staged["out"] / piece, bad)
    part = bad / parts[0].part
    part.write_bytes(b"\0" + part.read_bytes()[1:])
    with pytest.raises(sp.StackError, match="damaged"):
        store.put(str(bad))
    assert not os.listdir(store.parts_dir)
    put_copy(staged, piece)  # the good copy goes in
    other = tmp_path / "other" / parts[-1].piece
    shutil.copytree(staged["out"] / parts[-1].piece, other)
    (other / "MANIFEST.tsv").write_text((other / "MANIFEST.tsv").read_text().replace("opt-x", "opt-y"))
    with pytest.raises(sp.StackError, match="another pack"):
        store.put(str(other))
    with pytest.raises(sp.StackError, match="no MANIFEST"):
        store.put(str(tmp_path / "nowhere" / "p99"))


def test_cli_put_exits_nonzero_on_an_error_and_prints_what_is_missing(staged, tmp_path):
    env = {**os.environ, "KIMI_STACK_STORE": str(tmp_path / "cli-store"), "KIMI_STACK_ROOT": str(tmp_path / "cli-root")}
    first = staged["parts"][0].piece
    dst = tmp_path / "cli" / first
    shutil.copytree(staged["out"] / first, dst)
    r = subprocess.run(["bash", SCRIPT, "put", str(dst)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"put {first}" in r.stdout and "main: " in r.stdout and "missing pieces: p02" in r.stdout
    r = subprocess.run(["bash", SCRIPT, "put", str(tmp_path / "cli" / "p77")], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "ERROR" in r.stderr and "missing pieces" in r.stdout
    r = subprocess.run(["bash", SCRIPT, "status"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "opt-x (optional): 0/1 files installed" in r.stdout


def test_trim_drops_members_and_their_record_lines_and_take_is_reproducible(tmp_path):
    w = make_wheel(str(tmp_path), "pkg", "1.0", {"pkg/__init__.py": b"", "pkg/big.so": b"x" * 100,
                                                "pkg/sub/a.py": b"a", "pkg/sub/b.py": b"b"})
    out = str(tmp_path / "trimmed" / os.path.basename(w))
    os.makedirs(os.path.dirname(out))
    removed = sp.trim_wheel(w, out, ["pkg/big.so", "pkg/sub/*"])
    assert sorted(removed) == ["pkg/big.so", "pkg/sub/a.py", "pkg/sub/b.py"]
    with zipfile.ZipFile(out) as z:
        names = z.namelist()
        record = z.read("pkg-1.0.dist-info/RECORD").decode()
    assert "pkg/big.so" not in names and "pkg/__init__.py" in names
    assert "big.so" not in record and "sub/" not in record and "pkg/__init__.py" in record
    target = tmp_path / "t"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                        str(target), out], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(n for n in os.listdir(target / "pkg") if n != "__pycache__") == ["__init__.py"]
    sp.trim_wheel(w, out + ".again", ["pkg/big.so", "pkg/sub/*"])
    assert sp.sha256_file(out) == sp.sha256_file(out + ".again")
    sp.take_members(w, str(tmp_path / "a.tar.gz"), ["pkg/sub/*"])
    sp.take_members(w, str(tmp_path / "b.tar.gz"), ["pkg/sub/*"])
    assert sp.sha256_file(str(tmp_path / "a.tar.gz")) == sp.sha256_file(str(tmp_path / "b.tar.gz"))
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["pkg/sub/a.py", "pkg/sub/b.py"]
    with pytest.raises(SystemExit, match="nothing"):
        sp.trim_wheel(w, out + ".none", ["nothing/*"])


def test_env_puts_nccl_then_torch_first_and_vllm_before_the_sglang_site(tmp_path):
    lines = sp.env_lines("sglang", str(tmp_path))
    assert lines[0] == f'export PYTHONPATH="{tmp_path}/stack-nccl:{tmp_path}/stack-torch:{tmp_path}/stack-sgl' \
        '${PYTHONPATH:+:$PYTHONPATH}"'
    assert lines[1].startswith(f'export LD_LIBRARY_PATH="{tmp_path}/stack-nccl/nvidia/nccl/lib')
    vllm = sp.env_lines("vllm", str(tmp_path))
    assert f"{tmp_path}/stack-torch:{tmp_path}/stack-vllm:{tmp_path}/stack-sgl$" in vllm[0]
    assert "export VLLM_USE_FLASHINFER_SAMPLER=0" in vllm  # FlashInfer staged without JIT sources
    os.makedirs(tmp_path / "stack-vllm" / "flashinfer" / "data" / "csrc")
    os.makedirs(tmp_path / "stack-triton")
    vllm = sp.env_lines("vllm", str(tmp_path))
    assert "export VLLM_USE_FLASHINFER_SAMPLER=0" not in vllm
    assert f"{tmp_path}/stack-torch:{tmp_path}/stack-triton:{tmp_path}/stack-vllm" in vllm[0]
    r = subprocess.run(["bash", "-c", f'eval "$(bash {SCRIPT} env sglang)"; echo "$PYTHONPATH"'],
                       env={**os.environ, "KIMI_STACK_ROOT": str(tmp_path), "PYTHONPATH": "/x"},
                       capture_output=True, text=True)
    assert r.stdout.strip() == f"{tmp_path}/stack-nccl:{tmp_path}/stack-torch:{tmp_path}/stack-triton:" \
        f"{tmp_path}/stack-sgl:/x"


def test_env_adds_what_a_sites_pth_files_add(tmp_path):
    """pip --target leaves .pth files unprocessed: the env lists what they add, as the
    cutlass DSL's (an `import` line that inserts its dsl_packages folder) does under Python."""
    sgl = tmp_path / "stack-sgl"
    (sgl / "fakedsl" / "dsl_packages" / "fakecute").mkdir(parents=True)
    (sgl / "fakedsl" / "__init__.py").write_text("")
    (sgl / "fakedsl" / "dsl_packages" / "fakecute" / "__init__.py").write_text("X = 7\n")
    (sgl / "fakedsl.pth").write_text("import sys, os, fakedsl; sys.path.insert(0, os.path.join("
                                     "fakedsl.__path__[0], 'dsl_packages'))")
    (sgl / "plain.pth").write_text("# a comment\nextra_dir\n")
    (sgl / "extra_dir").mkdir()
    assert sorted(sp.pth_dirs(str(sgl))) == [str(sgl / "extra_dir"), str(sgl / "fakedsl" / "dsl_packages")]
    assert sp.pth_dirs(str(tmp_path / "stack-torch")) == []
    r = subprocess.run(["bash", "-c", f'eval "$(bash {SCRIPT} env sglang)"; '
                        f'{sys.executable} -c "import fakecute; print(fakecute.X)"'],
                       env={**os.environ, "KIMI_STACK_ROOT": str(tmp_path), "PYTHONPATH": ""},
                       capture_output=True, text=True)
    assert r.stdout.strip() == "7", r.stderr
    (sgl / "broken.pth").write_text("import no_such_module_here\n")
    with pytest.raises(sp.StackError, match="broken|no_such_module_here"):
        sp.pth_dirs(str(sgl))


def test_prepare_run_picks_the_stack_only_for_the_series_of_its_release(tmp_path):
    """stage.sh's prepare_run takes the stack's path when KIMI_SGLANG_SERIES names the
    series whose base release the staged stack holds; its helpers, sourced as run_e2e.sh does."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    versions = {}
    for series in sorted(os.listdir(os.path.join(repo, "patches"))):
        if os.path.isfile(os.path.join(repo, "patches", series, "base.toml")):
            r = subprocess.run(["bash", "-c", f"source tests/gpu/stage.sh; series_release {series}"],
                               cwd=repo, capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            versions[series] = r.stdout.strip()
    assert len(set(versions.values())) == len(versions) >= 2
    env = {**os.environ, "KIMI_STACK_ROOT": str(tmp_path)}
    run = ["bash", "-c", "source tests/gpu/stage.sh; stack_release"]
    assert subprocess.run(run, cwd=repo, env=env, capture_output=True, text=True).stdout == ""
    newest = sorted(versions.items(), key=lambda kv: tuple(map(int, kv[1].split("."))))[-1]
    os.makedirs(tmp_path / "stack-sgl" / f"sglang-{newest[1]}.dist-info")
    assert subprocess.run(run, cwd=repo, env=env, capture_output=True, text=True).stdout.strip() == newest[1]


def _cc(out, src, *flags):
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), "-x", "c", "-", *map(str, flags)],
                   input=src, text=True, check=True)


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("ldd") is None, reason="needs gcc and ldd")
def test_install_store_copies_only_the_missing_libraries_and_store_env_finds_them(tmp_path):
    """stage.sh's install_store with a wheel whose ``mooncake/_store.so`` needs a library
    the system lacks (``libkdep.so.1``, which needs ``libkdep2.so.1``), both in the staged
    Debian tree: both are copied (the second found once the first is), libc is not, the
    module loads under store_env and not without it; a second install is a no-op; a
    library missing from the staged tree fails the install, naming it."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    build, deb = tmp_path / "build", tmp_path / "deb" / "usr" / "lib" / "x86_64-linux-gnu"
    build.mkdir()
    deb.mkdir(parents=True)
    _cc(deb / "libkdep2.so.1", "int two(void) { return 2; }", "-Wl,-soname,libkdep2.so.1")
    _cc(deb / "libkdep.so.1", "int two(void); int one(void) { return two() - 1; }",
        "-Wl,-soname,libkdep.so.1", f"-L{deb}", "-l:libkdep2.so.1")
    _cc(build / "store.so", "int one(void); int store_probe(void) { return one() + 40; }",
        f"-L{deb}", "-l:libkdep.so.1")
    src = tmp_path / "m"
    src.mkdir()
    make_wheel(str(src), "mooncake_fake", "0.1", {"mooncake/__init__.py": b"",
                                                  "mooncake/_store.so": (build / "store.so").read_bytes()})
    with tarfile.open(src / "mooncake-libs.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "deb", arcname=".")
    dest = tmp_path / "site-m"
    probe = (f"import ctypes; print(ctypes.CDLL('{dest}/mooncake/_store.so').store_probe())")

    def sh(script):
        return subprocess.run(["bash", "-c", f"source tests/gpu/stage.sh; {script}"], cwd=repo,
                              capture_output=True, text=True)

    r = sh(f"install_store {src} {dest}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "copied 2 into" in r.stdout and "every library resolves" in r.stdout
    assert sorted(os.listdir(dest / "lib")) == ["libkdep.so.1", "libkdep2.so.1"]
    assert sh(f"install_store {src} {dest}").stdout.strip() == "site-m already installed"
    r = sh(f"store_env {dest}; {sys.executable} -c \"{probe}\"; echo \"$PYTHONPATH\"")
    assert r.returncode == 0 and r.stdout.split()[0] == "41", r.stderr
    assert r.stdout.split()[1].endswith(f":{dest}") or r.stdout.split()[1] == str(dest)
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode != 0

    (src / "mooncake-libs.tar.gz").unlink()
    os.remove(deb / "libkdep2.so.1")
    with tarfile.open(src / "mooncake-libs.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "deb", arcname=".")
    r = sh(f"install_store {src} {tmp_path / 'site-m2'}")
    assert r.returncode != 0 and "still missing" in r.stderr and "libkdep2.so.1" in r.stderr
    assert not (tmp_path / "site-m2" / ".kimi-installed").exists()
