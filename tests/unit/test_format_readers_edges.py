"""format's readers given hostile input a user may hand them: an index.jsonl line nested
deeper than Python's recursion limit is a ValueError naming the part and line, as any
line that is not JSON is, never a RecursionError."""

from __future__ import annotations

import pytest

from sglang_ext import format as fmt


def test_a_deeply_nested_index_line_is_a_value_error_naming_the_line(tmp_path):
    good = '{"rid": "r", "file": "r.safetensors", "num_tokens": 3}\n'
    (tmp_path / fmt.INDEX_NAME).write_text(good + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError) as e:
        fmt.read_index(str(tmp_path))
    assert str(e.value) == (f"{tmp_path / fmt.INDEX_NAME} line 2 is not JSON: "
                            f"{(b'[' * 80)!r}")
