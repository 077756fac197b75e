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
