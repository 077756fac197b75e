"""Store group (issue 35): the patched server with ``--dump-hidden-states-dir mooncake://...``
on llama and deepseek (the MLA model vLLM's connectors refuse), bf16 and fp8.

Per model and dump dtype, one server against a real ``mooncake_master`` this module starts
(tests/mooncake_fixture.py's ``Master``, from the mooncake wheel's package folder) and a
store node that lends the memory while the server lends none (``global_segment_size=0``,
as docs/store.md recommends). Every sample is read with hs-connectors' own
``MooncakeTransfer.get_generated(manifest)`` (what speculators' trainer calls), its layout
checked (``testing.store.sample_problems``), turned into a file-like record (fp8
dequantized with its scales) and compared with HF's float32 forward by ``checks.compare_file``
within the file tolerances (fp8: test_gpu_fp8's widened ones), then deleted.

Without mooncake or hs-connectors (staged: tests/gpu/stage-extras.sh, .whl/m and .whl/d)
every test is skipped with the reason."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from test_gpu_core import rand_ids
from test_gpu_fp8 import fp8_tol
from testing import store as st
from testing.checks import TOL_BLOCK, TOL_TOKEN, Problems, Worst, compare_file
from testing.server import CHUNK, ServerOptions
from testing.server import start_server as launch_server  # the conftest fixture is start_server

pytestmark = [pytest.mark.gpu, pytest.mark.models("llama", "deepseek")]  # kimi: the core group only

ERROR = "hidden_states_error"
NODE_BYTES = 1 << 30  # the store node's segment: far above the largest case's samples (~60 MB)


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    """A real ``mooncake_master`` (skips the module with the reason when mooncake or
    hs-connectors is not importable)."""
    reason = st.missing_reason()
    if reason:
        pytest.skip(reason)
    from mooncake_fixture import Master

    m = Master(tmp_path_factory.mktemp("mooncake"))
    yield m
    m.kill()


@pytest.fixture(scope="module")
def store_node(master, server_log_dir):
    node = st.StoreNode(master.address, NODE_BYTES, f"{server_log_dir}/store-node-{master.port}.log")
    yield node
    node.stop()


@pytest.fixture(scope="module")
def store_reader(master, store_node):
    return st.reader(master.address)


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def dump_dtype(request):
    return request.param


@pytest.fixture(scope="module")
def store_server(request, tiny_model, dump_dtype, master, store_node, server_log_dir, pytestconfig):
    """The patched server of this model and dtype, dumping into the store; it lends no
    memory (``global_segment_size=0``): the store node holds every sample."""
    from mooncake_fixture import master_config

    options = ServerOptions(dump_dtype=dump_dtype, cuda_graph=not pytestconfig.getoption("--no-cuda-graph"))
    name = f"{tiny_model.name}-store-{options.tag}"
    srv = launch_server(tiny_model.path, master_config(master, segment=0, buffer="64MiB"),
                        tiny_model.spec.layers_flag, options.launcher or tiny_model.spec.launcher,
                        f"{server_log_dir}/server-{name}.log", options)
    plugin = getattr(request.config, "_kimi_results", None)
    if plugin is not None:
        plugin.servers.append({"name": name, "startup_s": srv.startup_s, "command": srv.command,
                               "entrypoint_command": srv.printed})
    yield srv
    srv.stop()


def tolerances(dump_dtype):
    if dump_dtype == "fp8":
        return fp8_tol(TOL_BLOCK), fp8_tol(TOL_TOKEN)
    return TOL_BLOCK, TOL_TOKEN


def check_samples(reader, prompts, metas, reference, tiny_model, dump_dtype, record_property, case,
                  tol_token=True):
    """Every answer's sample, read with ``get_generated(manifest)``, against the reference:
    the answer carries a manifest (no path, no error, no pending flag), the sample's layout,
    then ``compare_file``; each sample is deleted once read. ``prompts``: token id lists;
    ``metas``: the answers' meta_info (or kv_transfer_params wrapped as one)."""
    problems, worst, handles = Problems(), Worst(), []
    tol_block, tol_tok = tolerances(dump_dtype)
    for i, (ids, meta) in enumerate(zip(prompts, metas)):
        where = f"{case} request {i} ({len(ids)} tokens)"
        extra = sorted(k for k in meta if k in ("hidden_states_path", "hidden_states_pending", ERROR))
        manifest = meta.get(st.MANIFEST)
        if extra or not manifest:
            problems.add(f"{where}: answer carries {extra} and manifest {manifest!r}; want the manifest only "
                         f"({ERROR}: {meta.get(ERROR)!r})")
            continue
        handles.append(manifest["handle"])
        try:
            sample = reader.get_generated(manifest)
        except Exception as e:  # noqa: BLE001 - the reader's error (marker, timeout, size) is the finding
            problems.add(f"{where}: get_generated({manifest['handle']!r}): {type(e).__name__}: {e}")
            continue
        found = st.sample_problems(sample, manifest, len(ids), dump_dtype == "fp8", where)
        if found:
            problems.extend(found)
        else:
            problems.extend(compare_file(st.sample_record(sample, tiny_model.layer_ids), ids, tiny_model.layer_ids,
                                         tiny_model.hidden_size, reference(ids, tiny_model.layer_ids), where, worst))
        reader.delete(manifest["handle"])
    if len(set(handles)) != len(handles):
        problems.add(f"{case}: two answers name the same handle")
    worst.record(record_property)
    record_property("requests", len(prompts))
    problems.extend(worst.problems(tol_block, tol_tok if tol_token else None))
    problems.check(f"{tiny_model.name} {dump_dtype} {case}")


def generate_all(server, prompts, rids=None):
    """The answers' meta_info to ``prompts``, sent at once."""
    rids = rids or [None] * len(prompts)
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(server.generate, ids, 1, rid) for ids, rid in zip(prompts, rids)]
        return [f.result()["meta_info"] for f in futs]


def test_concurrent_mixed_with_chunked_prefill(store_server, store_reader, reference, tiny_model, dump_dtype,
                                               rng, record_property):
    """24 concurrent prompts of 8-599 tokens plus one of 700 (three chunks of
    --chunked-prefill-size 256) and one of CHUNK + 1: every sample equals the reference."""
    prompts = [rand_ids(rng, rng.randrange(8, 600)) for _ in range(24)] + [rand_ids(rng, 700),
                                                                          rand_ids(rng, CHUNK + 1)]
    metas = generate_all(store_server, prompts)
    check_samples(store_reader, prompts, metas, reference, tiny_model, dump_dtype, record_property,
                  "concurrent_mixed_chunked")


def test_one_rid_twice_then_again(store_server, store_reader, reference, tiny_model, dump_dtype, rng,
                                  record_property):
    """One rid twice, the second sent while the first's sample is still in the store
    (SGLang 0.5.23 answers a rid already in flight with 400 "Duplicate request ID", so one
    after the other): two distinct handles (``handle_for(rid)`` + ``-`` + 8 random hex
    digits each), each the right prompt; once the trainer has read and deleted them, the
    rid again gets a handle of its own, neither of the first two."""
    import re

    from sglang_ext import store

    rid = f"store-dup-{dump_dtype}"
    unique = re.compile(re.escape(store.handle_for(rid)) + "-[0-9a-f]{32}")
    prompts = [rand_ids(rng, 200), rand_ids(rng, 200)]
    metas = [store_server.generate(ids, 1, rid)["meta_info"] for ids in prompts]
    handles = [m.get(st.MANIFEST, {}).get("handle", "") for m in metas]
    assert len(set(handles)) == 2 and all(unique.fullmatch(h) for h in handles), metas
    check_samples(store_reader, prompts, metas, reference, tiny_model, dump_dtype, record_property,
                  "same_rid_at_once")
    again = [rand_ids(rng, 90)]
    meta = store_server.generate(again[0], 1, rid)["meta_info"]
    handle = meta.get(st.MANIFEST, {}).get("handle", "")
    assert unique.fullmatch(handle) and handle not in handles, meta
    check_samples(store_reader, again, [meta], reference, tiny_model, dump_dtype, record_property,
                  "same_rid_again")


@pytest.mark.models("llama")  # /v1/completions builds text: the tiny Llama has a tokenizer
def test_v1_completions_kv_transfer_params_is_the_manifest(store_server, store_reader, reference, tiny_model,
                                                           dump_dtype, rng, record_property):
    """vLLM's protocol on /v1/completions, as speculators' generator uses it:
    ``kv_transfer_params`` is the manifest itself, and ``get_generated`` of it reads the
    prompt's sample (block tolerance, as the clients group)."""
    prompts, metas = [], []
    for n in (17, 300, 701):
        ids = rand_ids(rng, n)
        r = store_server.post({"model": tiny_model.path, "prompt": ids, "max_tokens": 1, "temperature": 0,
                               "return_token_ids": True}, path="/v1/completions")
        assert r.status_code == 200, f"HTTP {r.status_code} {r.text[:300]}"
        params = r.json().get("kv_transfer_params") or {}
        assert params.get("version") == 1 and "hidden_states_path" not in params, params
        assert r.json()["choices"][0].get("prompt_token_ids") == ids
        prompts.append(ids)
        metas.append({st.MANIFEST: params})
    check_samples(store_reader, prompts, metas, reference, tiny_model, dump_dtype, record_property,
                  "v1_completions", tol_token=False)


def test_samples_outlive_the_server(store_server, store_reader, reference, tiny_model, dump_dtype, rng,
                                    record_property):
    """Four samples put, then the server stopped (SIGTERM: its writer drains and exits):
    the store node still holds them, whole. Ends the server: the module's last test."""
    prompts = [rand_ids(rng, n) for n in (40, 260, 520, 700)]
    metas = generate_all(store_server, prompts)
    store_server.stop()
    assert not store_server.alive()
    check_samples(store_reader, prompts, metas, reference, tiny_model, dump_dtype, record_property,
                  "outlive_the_server")
