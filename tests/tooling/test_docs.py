"""The docs' concrete claims that can be checked against the code mechanically: every
relative link resolves (its #anchor too), every flag docs/client.md's `extract` table names
is one of `extract --help`'s with the default the table gives, the exit codes its tables
give are extract's and convert's, every variable of docs/server.md's table is read with the
default it gives, and every `kimi_sglang:` metric the docs name is one metrics.py registers.

The references are the docs' own text (parsed here) and the code's parsers and constants,
not a copy of either: a doc line or a default changed alone fails one of these.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sglang_ext import __main__ as cli
from sglang_ext import config, metrics
from sglang_ext.client import extract
from sglang_ext.format import files as fmt_files

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "tests/gpu/README.md"]


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def table(doc: str, first_header: str) -> list[list[str]]:
    """The rows (cells stripped, header and rule dropped) of the table in ``doc`` whose
    first header cell is ``first_header``."""
    lines = (REPO / doc).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*" + re.escape(first_header) + r"\s*\|", line))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc):
    broken = []
    for target, frag in re.findall(r"\]\(([^)#\s]*)(#[^)\s]*)?\)", doc.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif frag and path.suffix == ".md":
            heads = {anchor(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}
            if frag[1:] not in heads:
                broken.append(f"{target}{frag}: no such heading in {path.name}")
    assert not broken, f"{doc.relative_to(REPO)}: {broken}"


def _options(command: str) -> dict:
    parser = cli.build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {s: a for a in sub._actions for s in a.option_strings}


def test_client_md_extract_table_names_extract_flags_and_their_defaults():
    options = _options("extract")
    rows = table("docs/client.md", "flag")
    assert len(rows) >= 8, rows
    for flag_cell, default, _ in rows:
        flags = re.findall(r"--[a-z][a-z-]*", flag_cell)
        defaults = [d.strip() for d in default.split(",")]
        for i, flag in enumerate(flags):
            assert flag in options, f"docs/client.md names {flag}, which extract --help does not have"
            given = defaults[i] if len(defaults) == len(flags) else default
            actual = options[flag].default
            if re.fullmatch(r"[0-9.]+", given):
                assert float(actual) == float(given), f"{flag}: docs/client.md says {given}, extract's default is {actual}"
            elif given in ("off", "none"):
                assert actual in (False, None, []), f"{flag}: docs/client.md says {given}, extract's default is {actual}"
    # and the flags named in its prose: `--store-timeout` (120 s), `--generate` ...
    text = (REPO / "docs/client.md").read_text()
    extract_text = text[:text.index("## SpecForge")]
    unknown = sorted({f for f in re.findall(r"(?<![\w-])--[a-z][a-z-]+", extract_text)} - set(options)
                     - {"--dump-hidden-states-dir", "--endpoint", "--preprocessed-data", "--output",
                        "--concurrency", "--validate-outputs", "--to"})  # the server's, speculators', convert's
    assert not unknown, f"docs/client.md names extract flags that do not exist: {unknown}"
    assert options["--store-timeout"].default == float(re.search(r"`--store-timeout` \((\d+) s\)", text).group(1))


def test_client_md_convert_flags_exist():
    options = _options("convert")
    text = (REPO / "docs/client.md").read_text()
    section = text[text.index("## SpecForge"):]
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", section))
    assert {"--to", "--model", "--norm-key", "--no-final-norm", "--loss-mask-from", "--image-token-id"} <= named
    unknown = named - set(options) - {"--generate"}  # a file of extract --generate
    assert not unknown, f"docs/client.md names convert flags that do not exist: {unknown}"


def test_client_md_exit_codes_are_extracts():
    codes = {int(c) for row in table("docs/client.md", "exit") for c in re.findall(r"\d+", row[0])}
    constants = {v for k, v in vars(extract).items() if k.startswith("EXIT_")}
    assert codes == constants, f"docs/client.md's exit table {sorted(codes)}, extract's EXIT_* {sorted(constants)}"


def test_server_md_variables_are_read_with_the_defaults_it_gives(monkeypatch):
    rows = {re.sub(r"`", "", r[0]): r[1].strip("`") for r in table("docs/server.md", "variable")}
    source = "\n".join(p.read_text() for p in (REPO / "sglang_ext").rglob("*.py"))
    for name in rows:
        assert f'"{name}"' in source or f"'{name}'" in source, f"{name} (docs/server.md) is read nowhere"
        monkeypatch.delenv(name, raising=False)
    settings = config.env_settings()
    sampling = config.sampling_settings(1)
    read = {
        "KIMI_SGLANG_WRITER_THREADS": settings["writer_threads"],
        "KIMI_SGLANG_WRITER_SPARES": settings["writer_spares"],
        "KIMI_SGLANG_DRAIN_TIMEOUT_S": settings["drain_timeout_s"],
        "KIMI_SGLANG_STATS_INTERVAL_S": settings["stats_interval_s"],
        "KIMI_SGLANG_WATCHDOG_S": settings["watchdog_s"],
        "KIMI_SGLANG_FILE_MODE": fmt_files.file_mode(),
    }
    for name, value in read.items():
        doc = rows[name]
        assert (int(doc, 8) if name.endswith("FILE_MODE") else float(doc)) == value, \
            f"{name}: docs/server.md says {doc}, the code's default is {value}"
    assert float(rows["KIMI_SGLANG_SAMPLE_RATE"]) == sampling["sample_rate"]
    assert rows["KIMI_SGLANG_DUMP_BUDGET_GB"] == "unset" and sampling["budget_bytes"] is None
    assert rows["KIMI_SGLANG_MIN_FREE_GB"] == "unset" and sampling["min_free_bytes"] is None


def test_every_metric_the_docs_name_is_registered():
    source = (REPO / "sglang_ext/metrics.py").read_text()
    registered = {metrics.PREFIX + n + ("_total" if kind == "counter" else "")
                  for kind, n in re.findall(r'\b(counter|gauge)\(\s*"(dump_[a-z_]+)"', source)}
    registered |= {metrics.PREFIX + n + "_total" for n in re.findall(r'Counter\(PREFIX \+ "(dump_[a-z_]+)"', source)}
    named = {m for doc in DOCS for m in re.findall(r"kimi_sglang:dump_[a-z_]+", doc.read_text())}
    assert named, "no metric named in the docs"
    assert not named - registered, f"the docs name metrics metrics.py does not register: {named - registered}"
