"""SGLang's own start-up warm-up request (``_execute_server_warmup`` in
``http_server.py``, which calls ``hooks.warmup_request`` in the patched file) leaves no
file and no index line in the dump directory; a user's request beside it is dumped."""

import copy
import os
import re
import types

import pytest
from standins import Req, finish, idle, make_runner, run_extend

from sglang_ext import format as fmt
from sglang_ext import hooks

PREFIX = "kimi-sglang-warmup-"  # session.WARMUP_RID_PREFIX, spelled out: it is a promise
RID = re.compile(re.escape(PREFIX) + "[0-9a-f]{32}")
SAMPLING = {"temperature": 0, "max_new_tokens": 8}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Describe the image."}]}],
    "max_tokens": 8,
    "stream": False,
    "temperature": 0.0,
}

# The bodies _execute_server_warmup builds (0.5.17 and 0.5.23), and how many rids each gets
# (None: one str rid).
BODIES = [
    ({"sampling_params": SAMPLING, "text": "The capital city of France is"}, None),
    ({"sampling_params": SAMPLING, "text": ["The capital city of France is"] * 2}, 2),
    ({"sampling_params": SAMPLING, "input_ids": [10, 11, 12]}, None),
    ({"sampling_params": SAMPLING, "input_ids": [[10, 11, 12] for _ in range(4)]}, 4),
    (CHAT, None),
]


def server_args(directory):
    return types.SimpleNamespace(dump_hidden_states_dir=None if directory is None else str(directory))


@pytest.mark.parametrize("body,count", BODIES)
def test_warmup_body_gets_rids_of_the_prefix_only_when_dumping(tmp_path, body, count):
    sent = hooks.warmup_request(server_args(tmp_path), copy.deepcopy(body))
    rid = sent.pop("rid")
    assert sent == body  # nothing else changed
    if count is None:
        assert isinstance(rid, str) and RID.fullmatch(rid)
    else:
        assert isinstance(rid, list) and len(rid) == count and len(set(rid)) == count
        assert all(RID.fullmatch(r) for r in rid)
    assert hooks.warmup_request(server_args(None), copy.deepcopy(body)) == body
    assert hooks.warmup_request(types.SimpleNamespace(), copy.deepcopy(body)) == body


def test_a_body_without_a_prompt_is_left_alone(tmp_path):
    body = {"model": "warmup", "state": "The capital city of France is Paris.", "questions": {}}
    assert hooks.warmup_request(server_args(tmp_path), copy.deepcopy(body)) == body


def test_warmup_request_leaves_no_file_and_no_index_line_beside_a_dumped_one(dump, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4"))
    body = hooks.warmup_request(server_args(dump), {"text": ["a", "b"]})
    warm = [Req(rid, 5, 1 + i) for i, rid in enumerate(body["rid"])]
    user = Req("user-1", 6, 7)
    run_extend(sess, [(warm[0], 0, 5), (user, 0, 6), (warm[1], 0, 5)], [2, 4])
    assert finish(warm[0]) == {} and finish(warm[1]) == {}
    meta = finish(user)
    assert idle(sess)["files_written"] == 1
    names = sorted(os.listdir(dump))
    assert names == sorted([os.path.basename(meta[fmt.PATH_KEY]), fmt.INDEX_NAME])
    assert [r["rid"] for r in fmt.read_index(dump)] == ["user-1"]


def test_a_client_rid_with_the_warmup_prefix_is_not_dumped(dump, sessions):
    """Documented in docs/faults.md: the prefix is SGLang's; a client that uses it gets no file."""
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req(PREFIX + "mine", 3, 2)
    run_extend(sess, [(req, 0, 3)], [2, 4])
    assert finish(req) == {}
    assert os.listdir(dump) == []


