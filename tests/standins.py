"""Stand-ins for SGLang's scheduler objects, driven through the hooks as the patched
scheduler drives them (tests/unit/test_hooks.py, tests/unit/test_warmup.py,
tests/integration/test_faults.py, tests/integration/test_edges.py).

They carry only the attributes the hooks read (Req: rid, origin_input_ids, is_retracted,
customized_info, finished(); ScheduleBatch: reqs, forward_mode, decoding_reqs,
prefix_lens). The reference for every dumped file is a tensor computed from (request,
token position, layer slot, channel) by a formula (``reference``), independent of how the
rows were batched, chunked or copied. ``RIDS``: hostile request ids every path must survive.
"""

import asyncio
import os
import textwrap
import time
import types

import torch

from sglang_ext import hooks

RIDS = [
    "plain-rid_1.0",
    "../../etc/passwd",
    "/abs/path",
    "a\x00b",
    "dir/sub\\file",
    "x" * 5000,
    "漢字-emoji-😀",
    "",
    "..",
    ".hidden",
    "\udcff-lone-surrogate",
]

HIDDEN = 8


# A scrape of prometheus_client's multiprocess directory (PROMETHEUS_MULTIPROC_DIR), as
# SGLang's /metrics serves it: run with ``python -c`` in that environment, prints the text.
MULTIPROC_HTTP = textwrap.dedent(r"""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    registry = CollectorRegistry()  # what sglang.srt.utils.add_prometheus_middleware serves
    multiprocess.MultiProcessCollector(registry)
    print(generate_latest(registry).decode())
""")


class Mode:
    def __init__(self, extend=True):
        self.extend = extend

    def is_extend(self):
        return self.extend

    def is_target_verify(self):
        return False


class Req:
    def __init__(self, rid, num_tokens, seed):
        self.rid = rid
        self.origin_input_ids = [seed * 1000 + t for t in range(num_tokens)]
        self.seed = seed
        self.is_retracted = False
        self.customized_info = None
        self.aborted = False

    def finished(self):
        return self.aborted


def reference(req, layer_ids, start=0, stop=None):
    """[T, L, H] float32: value = seed*1e4 + token*100 + slot*10 + channel/10."""
    stop = len(req.origin_input_ids) if stop is None else stop
    t = torch.arange(start, stop, dtype=torch.float32)[:, None, None]
    s = torch.arange(len(layer_ids), dtype=torch.float32)[None, :, None]
    h = torch.arange(HIDDEN, dtype=torch.float32)[None, None, :]
    return req.seed * 1e4 + t * 100 + s * 10 + h / 10


def extend_args(reqs_and_spans, layer_ids, decoding=(), mode=None):
    """(batch, logits_output, extend lens): what the patched scheduler passes the hook for
    one extend batch of [(req, start, stop)] token spans, rows from ``reference``;
    ``decoding``: requests that add one decode row."""
    rows, lens, prefix = [], [], []
    for req, start, stop in reqs_and_spans:
        if req in decoding:
            rows.append(torch.zeros(1, len(layer_ids) * HIDDEN))
            lens.append(1)
            prefix.append(len(req.origin_input_ids))
        else:
            rows.append(reference(req, layer_ids, start, stop).reshape(stop - start, -1))
            lens.append(stop - start)
            prefix.append(start)
    batch = types.SimpleNamespace(
        reqs=[r for r, _, _ in reqs_and_spans],
        forward_mode=mode or Mode(),
        decoding_reqs=list(decoding),
        prefix_lens=prefix,
    )
    return batch, types.SimpleNamespace(hidden_states=torch.cat(rows).to(torch.float32)), lens


def run_extend(session, reqs_and_spans, layer_ids, decoding=(), mode=None):
    """One extend batch through ``session.on_prefill_result`` (``extend_args``)."""
    session.on_prefill_result(*extend_args(reqs_and_spans, layer_ids, decoding, mode))


class GenReq(Req):
    """A stand-in ``Req`` that generates: ``output_ids``, ``custom_params``, a length cap."""

    def __init__(self, rid, num_tokens, seed, max_new_tokens, output=True, stops_after=None):
        super().__init__(rid, num_tokens, seed)
        self.output_ids = []
        self.max_new_tokens = max_new_tokens
        self.stops_after = stops_after  # tokens after which it stops early (a stop token)
        params = {"hidden_states_output": True} if output else {}
        self.sampling_params = types.SimpleNamespace(custom_params=params, max_new_tokens=max_new_tokens)
        self.length_done = False

    def finished(self):
        return self.aborted or self.length_done

    def sample(self):
        """SGLang's append then ``update_finish_state``: the next id, then the length cap
        (or the early stop)."""
        self.output_ids.append(self.seed * 1000 + 500 + len(self.output_ids))
        if len(self.output_ids) >= min(self.max_new_tokens, self.stops_after or self.max_new_tokens):
            self.length_done = True


def output_rows_for(spans, layer_ids):
    """``[sum(stop - start), L * HIDDEN]``: ``reference`` rows of ``(req, start, stop)`` positions."""
    return torch.cat([reference(r, layer_ids, a, b).reshape(b - a, -1) for r, a, b in spans])


def run_output_prefill(session, spans, layer_ids, decoding=()):
    """One extend batch of ``(req, start, stop)`` prompt spans (``decoding``: requests
    decoding inside it, one row each), as the patched process_batch_result_prefill runs it
    (patch 0009): ``on_prefill_result``, the finish checks (a request whose prompt ends
    samples its first token), then ``on_outputs``."""
    rows, lens, prefix = [], [], []
    for req, start, stop in spans:
        if req in decoding:
            pos = len(req.origin_input_ids) + len(req.output_ids) - 1
            rows.append((req, pos, pos + 1))
            lens.append(1)
            prefix.append(pos)
        else:
            rows.append((req, start, stop))
            lens.append(stop - start)
            prefix.append(start)
    batch = types.SimpleNamespace(reqs=[r for r, _, _ in spans], forward_mode=Mode(True),
                                  decoding_reqs=list(decoding), prefix_lens=prefix)
    out = types.SimpleNamespace(hidden_states=output_rows_for(rows, layer_ids))
    session.on_prefill_result(batch, out, lens)
    for req, start, stop in spans:  # the finish checks (the loop after the hook)
        if req.finished():
            continue
        if req in decoding or stop == len(req.origin_input_ids):
            req.sample()
    session.on_outputs(batch, out, lens)


def run_decode(session, reqs, layer_ids, abort=()):
    """One decode batch: each request's row for the token it feeds; finished requests
    (an overlap scheduler's extra tick) get no new token, as upstream skips them; ``abort``:
    requests aborted in this step (SGLang's ``to_finish``: the token is appended, then the
    request is finished)."""
    batch = types.SimpleNamespace(reqs=list(reqs), forward_mode=Mode(False), decoding_reqs=None,
                                  prefix_lens=None)
    pos = [len(r.origin_input_ids) + len(r.output_ids) - 1 for r in reqs]
    out = types.SimpleNamespace(hidden_states=output_rows_for([(r, p, p + 1) for r, p in zip(reqs, pos)], layer_ids))
    for req in reqs:
        if req.finished():
            continue
        req.sample()
        if req in abort:
            req.aborted = True  # to_finish = FINISH_ABORT: finished in this step
    session.on_outputs(batch, out)


class Decoder(torch.nn.Module):
    pass


Decoder.__name__ = "LlamaModel"


def make_runner(directory, num_layers=8, layers=None, tp_rank=0, max_mb=64, dtype=None):
    lm = types.SimpleNamespace(capture_aux_hidden_states=False, model=Decoder())
    lm.model.layers_to_capture = []
    server_args = types.SimpleNamespace(
        dump_hidden_states_dir=str(directory),
        dump_hidden_states_layers=layers,
        dump_hidden_states_max_host_mb=max_mb,
        dump_hidden_states_dtype=dtype,
        model_path="/models/tiny",
    )
    return types.SimpleNamespace(
        server_args=server_args,
        is_draft_worker=False,
        model=lm,
        model_config=types.SimpleNamespace(num_hidden_layers=num_layers),
        ps=types.SimpleNamespace(tp_rank=tp_rank, attn_tp_rank=tp_rank),
        device="cpu",
        gpu_id=0,
    )


def inject_writer(monkeypatch, tmp_path, code, **env):
    """Run ``code`` at the start of every writer process started from now on (as a
    ``sitecustomize`` module on its PYTHONPATH, which it inherits): how a test makes the
    writer process slow or fail. ``env``: more variables for it (``str`` values)."""
    d = tmp_path / "writer-inject"
    d.mkdir(exist_ok=True)
    (d / "sitecustomize.py").write_text(textwrap.dedent(code))
    monkeypatch.setenv("PYTHONPATH", str(d) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k, v in env.items():
        monkeypatch.setenv(k, v)


# The writer process's rename to the final name fails as on a full disk.
PUBLISH_FAILS = """
    from sglang_ext import format as fmt
    def _full(*a, **k):
        raise OSError(28, "No space left on device")
    fmt.publish = _full
"""

# The writer process waits before each rename until the file $GATE exists.
PUBLISH_GATED = """
    import os, time
    from sglang_ext import format as fmt
    _real = fmt.publish
    def _gated(*a, **k):
        while not os.path.exists(os.environ["GATE"]):
            time.sleep(0.01)
        return _real(*a, **k)
    fmt.publish = _gated
"""


def idle(session, timeout=10):
    """Wait until the session's writer process has acknowledged everything; its counters."""
    w = session.writer
    assert w.wait_idle(timeout), "the writer process did not catch up"
    return w.snapshot()


def wait_for(cond, timeout=10):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def finish(req, timeout=10):
    """What the tokenizer manager does before answering: returns meta_info."""
    meta = dict(req.customized_info or {})
    asyncio.run(asyncio.wait_for(hooks.finish_response(meta), timeout))
    return meta
