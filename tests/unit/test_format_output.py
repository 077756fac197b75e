"""``format.output``: the contract of a file with the generated tokens' rows, checked on
hand-built token ids and metadata (the request: prompt [5, 6, 7], generated [40, 41, 42])."""

from __future__ import annotations

import pytest

from sglang_ext import format as fmt

PROMPT, OUT = [5, 6, 7], [40, 41, 42]
IDS = [5, 6, 7, 40, 41]  # the prompt, then every generated id but the last
META = {"num_prompt_tokens": "3", "last_token_id": "42", "format": "kimi-sglang/1"}


def test_the_keys_and_the_fed_ids_are_the_contracts():
    assert (fmt.OUTPUT_PARAM, fmt.VLLM_OUTPUT_PARAM) == ("hidden_states_output", "include_output_tokens")
    assert fmt.output_metadata(3, 42) == {"num_prompt_tokens": "3", "last_token_id": "42"}
    assert fmt.fed_token_ids(PROMPT, OUT) == IDS
    assert fmt.fed_token_ids(PROMPT, [9]) == PROMPT  # one token generated: nothing fed back


def test_a_file_that_follows_the_contract_gives_prompt_length_and_every_generated_id():
    got = fmt.check_output_rows(IDS, META, PROMPT, OUT)
    assert (got.num_prompt_tokens, got.output_ids) == (3, OUT)
    assert fmt.check_output_rows(IDS, META).output_ids == OUT  # from the file alone
    assert fmt.output_rows([1, 2], {"format": "kimi-sglang/1"}) is None  # a prompt-only file


@pytest.mark.parametrize("ids, meta, prompt, out, says", [
    (IDS, {"format": "x"}, PROMPT, OUT, "no metadata num_prompt_tokens"),
    (IDS, {"num_prompt_tokens": "3"}, PROMPT, OUT, "last_token_id is missing"),
    (IDS, {**META, "num_prompt_tokens": "-3"}, PROMPT, OUT, "is not a non-negative decimal"),
    (IDS, {**META, "num_prompt_tokens": "6"}, PROMPT, OUT, "not within the file's 1..5 tokens"),
    (IDS, {**META, "num_prompt_tokens": "2"}, PROMPT, OUT, "is 2, the prompt sent has 3"),
    ([5, 9, 7, 40, 41], META, PROMPT, OUT, "differ from the prompt's at position 1"),
    (IDS + [42], META, PROMPT, OUT, "6 rows, not the 3 prompt + 3 generated - 1 = 5"),
    ([5, 6, 7, 40, 49], META, PROMPT, OUT, "generated token 1 is token id 49 at position 4"),
    (IDS, {**META, "last_token_id": "43"}, PROMPT, OUT, "generated token 2 is last_token_id 43"),
    (IDS, META, PROMPT, [], "names no generated token"),
])
def test_each_break_of_the_contract_is_one_sentence(ids, meta, prompt, out, says):
    with pytest.raises(fmt.DumpFormatError) as e:
        fmt.check_output_rows(ids, meta, prompt, out, "f.safetensors")
    assert says in str(e.value) and str(e.value).startswith("f.safetensors: "), str(e.value)
    assert "\n" not in str(e.value)
