"""The servers' dump directories as this machine sees them, and taking a file out of one.

The server's answer is not trusted: extract takes only regular files directly in one of the
run's dump directories whose name is the server's name for that request, by name relative
to a descriptor of the directory, never through a symlink (``lstat``, ``O_NOFOLLOW``,
``fstat``). ``move_into_place`` moves such a file to ``OUT/hs_<i>.safetensors`` through a
checked temporary file (``files.Staged``). Behind a router (docs/fleet.md) every server
writes to a directory of a filesystem shared with the client: one for all, or one each
(``DumpDirs``), which also tells which server wrote a sample.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Dict, List, Optional, Tuple

from sglang_ext import format as fmt
from sglang_ext.client.checks import CheckError, NotRegularError, check_file, check_header
from sglang_ext.client.files import Staged, kind_of
from sglang_ext.client.http import FatalError
from sglang_ext.client.manifest import final_name
from sglang_ext.client.pending import server_name_ok


def _not_the_servers_name(rid: str, path: str) -> FatalError:
    return FatalError(f"hidden_states_path {path} is not the server's name for request {rid} "
                      f"({fmt.safe_stem(rid)}[-n]{fmt.SUFFIX}): not taken; a server that names "
                      f"its files otherwise (another version of the dump patches?) would fail "
                      f"every request alike")


class DumpDir:
    """The server's dump directory as this machine sees it, pinned for the run.

    ``path`` as given (``--dump-dir``) or the directory of the run's first answer; ``fd``
    an open descriptor of it: every file is taken by its bare name relative to ``fd``
    (``rename``/``open``/``unlink`` ``*at``), so no symlink on the way redirects a move or
    a delete. An answer belongs to it when its directory is the same directory (device
    and inode) and its name is the server's name for the request (``server_name_of``).
    Raises ``OSError`` when ``path`` is not a directory."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        st = os.fstat(self.fd)
        self.identity = (st.st_dev, st.st_ino)
        # name -> rid of the files found here by name for an answer naming the server's own
        # path, not visible here (DumpDirs.take): taken only when their metadata says rid
        self.translated: Dict[str, str] = {}

    def holds(self, name: str) -> bool:
        """Whether ``name`` or its ``.lock`` (an early answer's file not written yet) is here;
        ``name`` is looked at again after the lock, which goes once the file is in place."""
        return any(fmt.lexists_at(self.fd, n) for n in (name, name + fmt.LOCK_SUFFIX, name))

    def close(self) -> None:
        os.close(self.fd)

    def server_name_of(self, rid: str, path: str) -> str:
        """The bare name of ``rid``'s file from the server's ``path``. Raises ``CheckError``
        (this row's error) when ``path`` is not in this directory, ``FatalError`` when its
        name is not one the server gives ``rid`` (``<safe_stem(rid)>[-n].safetensors``:
        ``DumpDirs`` says why the run stops)."""
        directory, name = os.path.split(path)
        try:
            st = os.stat(directory or ".")
            inside = (st.st_dev, st.st_ino) == self.identity
        except OSError:
            inside = False
        if not inside:
            raise CheckError(f"hidden_states_path {path} is not in the dump directory "
                             f"{self.path}: not taken")
        if not server_name_ok(rid, name):
            raise _not_the_servers_name(rid, path)
        return name

    def require_waitable(self, name: str) -> None:
        """Raise ``NotRegularError`` when ``<name>.lock`` or ``<name>.error`` holds something
        else than a regular file: a FIFO there would block the wait for the file."""
        for suffix in (fmt.LOCK_SUFFIX, fmt.ERROR_SUFFIX):
            try:
                mode = os.stat(name + suffix, dir_fd=self.fd, follow_symlinks=False).st_mode
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(mode):
                raise NotRegularError(f"{os.path.join(self.path, name)}{suffix} is not a regular "
                                      f"file ({kind_of(mode)}): not waited on")


MAX_DUMP_DIRS = 256  # adopted from answers (no --dump-dir): each holds a descriptor open


class DumpDirs:
    """The run's dump directories: those given (``--dump-dir``, repeatable: one per server
    of a fleet), else each directory an answer names, adopted when this machine sees it.

    ``take(rid, path)`` returns ``(DumpDir, bare name)`` for an answer: its name must be
    the server's name for ``rid`` and its directory one of the run's (by device and inode).
    Raises ``FatalError`` (the run stops: every answer of that server would fail alike)
    when the directory does not exist on this machine (the directory sink needs a
    filesystem shared with every server), when the name is not the server's name for
    ``rid`` (the patched server names every file so, ``format.safe_stem``: a server that
    does not is of another series or not to be trusted, and retries would only leave more
    of its files behind), when ``--dump-dir`` was given, does not name the directory and
    holds no file of that name (a server's directory left out), or when more than
    ``MAX_DUMP_DIRS`` were named. Nothing is taken or deleted then. Raises ``OSError`` from
    ``__init__`` for a given path that is not a directory.

    A ``--dump-dir`` may show the server's directory under another path (a bind mount, a
    network filesystem mounted elsewhere): an answer whose directory is none of the run's
    here (absent, or another directory at that path) is looked up by its bare name in the
    ``--dump-dir`` that holds it, and that file is taken only if its metadata names the
    request's rid (``move_into_place``)."""

    def __init__(self, paths: List[str]):
        self.fixed = bool(paths)
        self.dirs: List[DumpDir] = []
        try:
            for p in paths:
                if not any(d.path == os.path.abspath(p) for d in self.dirs):
                    self.dirs.append(DumpDir(p))
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        for d in self.dirs:
            d.close()
        self.dirs = []

    def adopt(self, path: str) -> bool:
        """Take ``path`` (the server's own word for its dump directory, ``http.server_dump_dir``)
        as one of the run's before any answer, as an answer's directory would be; True when
        it was. Nothing happens when ``--dump-dir`` was given, for a store URL, for a
        relative path (the server's flag as given, relative to the server's working
        directory, not this one's) or for a path that is not a directory here (an answer
        then says so: ``take``)."""
        if self.fixed or "://" in path or not os.path.isabs(path) or not os.path.isdir(path):
            return False
        if not any(d.path == os.path.abspath(path) for d in self.dirs):
            try:
                self.dirs.append(DumpDir(path))
            except OSError:
                return False
        return True

    def take(self, rid: str, path: str, on_new=None) -> Tuple[DumpDir, str]:
        """See the class doc; ``on_new(path)`` is called for a directory adopted now."""
        directory, name = os.path.split(path)
        try:
            st = os.stat(directory or ".")
        except OSError:
            st = None
        is_dir = st is not None and stat.S_ISDIR(st.st_mode)
        for d in self.dirs:
            if is_dir and (st.st_dev, st.st_ino) == d.identity:
                return d, d.server_name_of(rid, path)
        if self.fixed:
            if server_name_ok(rid, name):  # the server's directory under another path here?
                for d in self.dirs:
                    if d.holds(name):
                        d.translated[name] = rid
                        return d, name
            # a server's directory left out: every answer of it would fail alike
            fix = (f"add --dump-dir {directory}" if is_dir else
                   "pass each server's --dump-hidden-states-dir as this machine sees it with --dump-dir")
            raise FatalError(f"the server wrote {path} into {directory}, which no --dump-dir "
                             f"names ({', '.join(d.path for d in self.dirs)}), and none of them "
                             f"holds {name}: {fix} (one per server behind a router)")
        if not is_dir:
            raise FatalError(f"the server writes to {directory}, which does not exist on this "
                             f"machine: the directory sink needs a filesystem shared with every "
                             f"server; pass --dump-dir DIR, its --dump-hidden-states-dir as this "
                             f"machine sees it (or use the store sink, --store)")
        if not server_name_ok(rid, name):  # before a directory is adopted for it
            raise _not_the_servers_name(rid, path)
        if len(self.dirs) >= MAX_DUMP_DIRS:
            raise FatalError(f"the servers named more than {MAX_DUMP_DIRS} dump directories: "
                             f"pass each server's --dump-hidden-states-dir with --dump-dir")
        d = DumpDir(directory)
        self.dirs.append(d)
        if on_new is not None:
            on_new(d.path)
        return d, d.server_name_of(rid, path)


def open_regular(name: str, dir_fd: int, shown: str) -> int:
    """``format.open_regular(name, O_RDONLY)`` in the directory ``dir_fd``: a regular file's
    descriptor, never through a symlink, never blocking on a FIFO. Raises
    ``NotRegularError`` "``shown`` is not a regular file (a symbolic link)" for anything
    else, ``FileNotFoundError`` when it is gone."""
    try:
        return fmt.open_regular(name, os.O_RDONLY, dir_fd=dir_fd)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            raise e from None
        if stat.S_ISREG(mode):
            raise
        raise NotRegularError(f"{shown} is not a regular file ({kind_of(mode)})") from None


def check_before_taking(fd: int, input_ids: Optional[List[int]], shown: str,
                        rid: Optional[str] = None) -> int:
    """``checks.check_header`` on the server's open file ``fd`` before anything is moved
    or copied into OUT (its shapes, its tokens, its size bound; with ``rid``, its
    metadata's ``rid``); returns its size. Raises ``CheckError``."""
    from safetensors import safe_open

    size = os.fstat(fd).st_size
    try:
        with safe_open(f"/proc/self/fd/{fd}", framework="numpy") as f:
            if fmt.KEY_HIDDEN_STATES not in set(f.keys()):
                raise CheckError(f"{shown}: missing keys ['{fmt.KEY_HIDDEN_STATES}']")
            check_header(f, size, None if input_ids is None else len(input_ids), shown)
            got = (f.metadata() or {}).get("rid")
            if rid is not None and got != rid:
                raise CheckError(f"{shown} is not request {fmt.brief_rid(rid)}'s (its metadata "
                                 f"says rid {got!r}): not taken; is --dump-dir the server's "
                                 f"--dump-hidden-states-dir?")
    except CheckError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise CheckError(f"{shown}: unreadable: {e}") from None
    return size


def _copy_fd(src_fd: int, staged: Staged, mode: int, limit: int) -> str:
    """Copy an open file, ``limit`` bytes at most (its checked size), into a new temporary
    file of ``staged`` (created ``O_EXCL|O_NOFOLLOW`` with ``mode``), flushed to disk;
    returns its name. A file that grew past ``limit`` is cut there (the check in OUT then
    refuses it)."""
    tmp, dst = staged.create(mode)
    try:
        offset = 0
        while offset < limit:
            chunk = os.pread(src_fd, min(1 << 20, limit - offset), offset)
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                view = view[os.write(dst, view):]
            offset += len(chunk)
        os.fsync(dst)
    finally:
        os.close(dst)
    return tmp


def move_into_place(dump: DumpDir, name: str, out_dir: str, index: int, input_ids: List[int],
                    full: bool, mode: int = fmt.DEFAULT_FILE_MODE) -> int:
    """Move the server's file ``name`` (in ``dump``) to ``out_dir/hs_<index>.safetensors``;
    returns its size.

    Only a regular file is taken (a symlink, FIFO, ... raises ``NotRegularError`` and is
    left where it is), and only one whose header passes ``check_before_taking`` (shapes,
    tokens, ``checks.check_header``'s size bound: else ``CheckError``, left where it is,
    nothing copied). It goes to a temporary name in ``out_dir`` first (rename, or across
    filesystems a copy through a descriptor opened ``O_NOFOLLOW`` and then the unlink of
    that same file), is made a regular file of this user with ``mode`` (copied when another
    name links it or another user owns it), is checked there, and only then renamed onto
    the final name: the final name never holds a partial, unchecked or linked file. On a
    failed check the temporary file is removed and ``CheckError`` raised. A file found by
    name for an answer naming another path (``DumpDir.translated``) must also name its rid.
    """
    shown = f"the server's file {os.path.join(dump.path, name)}"
    with Staged(out_dir, final_name(index)) as staged:
        st_mode = os.stat(name, dir_fd=dump.fd, follow_symlinks=False).st_mode
        if not stat.S_ISREG(st_mode):
            raise NotRegularError(f"{shown} is not a regular file ({kind_of(st_mode)}): "
                                  f"left where it is")
        fd = open_regular(name, dump.fd, shown)
        try:
            checked = check_before_taking(fd, input_ids, shown, dump.translated.pop(name, None))
        finally:
            os.close(fd)
        tmp = staged.name()
        try:
            os.rename(name, tmp, src_dir_fd=dump.fd, dst_dir_fd=staged.fd)
            moved = True
        except OSError as e:
            if e.errno != errno.EXDEV:  # another filesystem
                raise
            moved = False
        if moved:
            # What was renamed is checked in OUT, where nobody else swaps it any more.
            fd = open_regular(tmp, staged.fd, shown)
            try:
                st = os.fstat(fd)
                if st.st_nlink != 1 or st.st_uid != os.geteuid():
                    # Another name links it (a hard link elsewhere) or another user owns it:
                    # whoever holds that could change it after the check, and a chmod would
                    # reach through the link. Keep a copy of our own instead.
                    kept = _copy_fd(fd, staged, mode, checked)
                    os.unlink(tmp, dir_fd=staged.fd)
                    tmp = kept
                else:
                    os.fchmod(fd, mode)
            finally:
                os.close(fd)
        else:
            fd = open_regular(name, dump.fd, shown)
            try:
                tmp = _copy_fd(fd, staged, mode, checked)
                st = os.fstat(fd)
                now = os.stat(name, dir_fd=dump.fd, follow_symlinks=False)
                if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):  # the file copied, not a swap
                    os.unlink(name, dir_fd=dump.fd)
            finally:
                os.close(fd)
        check_file(os.path.join(out_dir, tmp), input_ids, full)
        size = os.stat(tmp, dir_fd=staged.fd, follow_symlinks=False).st_size
        staged.publish(tmp)
    return size
