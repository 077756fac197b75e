"""OUT, extract's output directory: ``hs_<i>.safetensors``, ``manifest.jsonl`` and resume.

``manifest.jsonl`` holds one JSON line per sample (``record``), appended whole or not at
all (``files.append_line``: lines never interleave, a full disk leaves no torn line); the
last line of an index wins and a torn last line (a killed run) is ignored. A row with images also gets ``images`` and
``request_sha256`` (``runner.chat_record``), which a rerun checks before keeping its file. A rerun keeps every ``hs_<i>`` that is a regular
file and passes ``checks.check_file`` (``existing``), and removes the temporary files a
killed run left (``clean_tmp``).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from sglang_ext import format as fmt
from sglang_ext.client.checks import CheckError, check_file
from sglang_ext.client.files import append_line, regular_or_why

MANIFEST_NAME = "manifest.jsonl"
# files.Staged's temporary names for hs_<i> (unique: a random suffix)
_TMP = re.compile(r"\.hs_\d+\.safetensors\.tmp(\.[0-9a-f]+)?")


def final_name(index: int) -> str:
    """Row ``index``'s file in OUT: ``hs_<index>.safetensors`` (speculators' layout)."""
    return f"hs_{index}.safetensors"


def record(index: int, num_tokens: int, source: Optional[str], size: int) -> Dict[str, Any]:
    """A manifest line: ``source`` is the server's path the file came from (None: a file a
    killed run had already put in place), ``size`` its bytes."""
    return {"index": index, "num_tokens": num_tokens, "source": source,
            "file": final_name(index), "bytes": size}


class Manifest:
    """``OUT/manifest.jsonl``: ``records`` (index -> its last record) read at start,
    ``add`` appends. A new manifest is created with ``mode`` (umask applied)."""

    def __init__(self, out_dir: str, mode: int = fmt.DEFAULT_FILE_MODE):
        self.path = os.path.join(out_dir, MANIFEST_NAME)
        self.mode = mode
        self.records: Dict[int, Dict[str, Any]] = {}
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except (ValueError, RecursionError):  # a torn or hostile line
                        continue
                    if isinstance(rec, dict) and isinstance(rec.get("index"), int):
                        self.records[rec["index"]] = rec

    def __contains__(self, index: int) -> bool:
        return index in self.records

    def add(self, rec: Dict[str, Any]) -> None:
        """Append ``rec``'s line whole or not at all (``files.append_line``). Raises
        ``OSError`` (a full disk: ``ENOSPC``), the file as it was before."""
        append_line(self.path, (json.dumps(rec, separators=(",", ":")) + "\n").encode("utf-8"),
                    self.mode)
        self.records[rec["index"]] = rec


def add_missing_lines(out_dir: str, taken, known: Dict[int, Dict[str, Any]],
                      mode: int = fmt.DEFAULT_FILE_MODE) -> int:
    """Append the line of each row in ``taken`` (its ``hs_<i>`` put into OUT by this run)
    that the manifest lacks: a row cancelled (Ctrl-C, SIGTERM) while its file was being
    moved in, or before its line was written. Tokens and bytes come from the file as it is
    (one that is gone or fails ``check_file`` gets no line: the next run extracts it
    again), ``known[i]`` adds what only the run knew (``source``, a chat row's
    ``images`` and ``request_sha256``). Returns how many lines; raises ``OSError``."""
    manifest = Manifest(out_dir, mode)
    n = 0
    for index in sorted(set(taken) - set(manifest.records)):
        path = os.path.join(out_dir, final_name(index))
        try:
            tokens = check_file(path, None, False)
            size = os.stat(path).st_size
        except (CheckError, FileNotFoundError):
            continue
        manifest.add({**record(index, tokens, None, size), **known.get(index, {})})
        n += 1
    return n


def existing(out_dir: str, index: int, input_ids: Optional[List[int]], full: bool,
             digest: Optional[str] = None, rec: Optional[Dict[str, Any]] = None
             ) -> Tuple[Optional[int], Optional[str]]:
    """What a rerun finds at ``OUT/hs_<index>``: ``(tokens, None)`` a regular file that
    passes ``check_file`` (kept); ``(None, why)`` something to extract again (a file that
    fails the check, or no regular file: a FIFO, a symlink, never opened); ``(None, None)``
    nothing.

    A row with images (``digest``: its ``ChatPrompt.digest``) is kept only when its
    manifest record ``rec`` names the same request (``request_sha256``) and as many tokens
    as the file holds: token ids alone do not tell one image from another of its size, and
    a file renamed into place just before a kill, without its line, is extracted again."""
    target = os.path.join(out_dir, final_name(index))
    try:
        not_regular = regular_or_why(target)
    except FileNotFoundError:
        return None, None
    if not_regular:
        return None, f"it is not a regular file ({not_regular})"
    if digest is not None and (rec is None or rec.get("request_sha256") != digest):
        return None, (f"{MANIFEST_NAME} does not record it as the answer to this row's chat "
                      f"request (request_sha256)")
    try:
        n = check_file(target, input_ids, full)
    except CheckError as e:
        return None, str(e)
    if digest is not None and rec.get("num_tokens") != n:
        return None, f"it holds {n} tokens, its {MANIFEST_NAME} line says {rec.get('num_tokens')}"
    return n, None


def clean_tmp(out_dir: str) -> int:
    """Remove ``.hs_<i>.safetensors.tmp*`` left by a killed run; returns how many."""
    n = 0
    for name in os.listdir(out_dir):
        if _TMP.fullmatch(name):
            try:
                os.unlink(os.path.join(out_dir, name))
                n += 1
            except FileNotFoundError:
                pass
    return n
