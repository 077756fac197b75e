"""The peer: vLLM 0.33 serving the same random-weight models, without hidden states
(mode ``vllm_nodump``, server V) and with its own extraction (mode ``vllm_dump``, server W:
``speculative_config={"method": "extract_hidden_states", ...}`` plus the
``ExampleHiddenStatesConnector`` writing one safetensors file per request into
``<dump root>/kimi-bench-<model>-vllm``): its command line (``vllm_command``; interpreter
and paths from ``KIMI_BENCH_VLLM_*``, which bench/run_bench.sh sets from the staged vLLM
stack), environment, request (``/v1/completions``, token ids in, as speculators' offline
generator sends it) and response (the file, complete once its lock is released:
``wait_file``, so (b) means "file complete" for both engines). MLA models are vLLM's to
refuse: those workloads are ours alone (``unsupported``).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import sys
from typing import List, Optional

from sglang_ext import config

from bench import modes
from bench.models import MODELS, model_path

PEER_MODES = modes.names(peer=True)
SERVED_NAME = "kimi-bench"  # --served-model-name; the requests' "model"
DEFAULT_MODULE = "vllm.entrypoints.openai.api_server"
ENV_PYTHON = "KIMI_BENCH_VLLM_PYTHON"
ENV_PYTHONPATH = "KIMI_BENCH_VLLM_PYTHONPATH"
ENV_LD_LIBRARY_PATH = "KIMI_BENCH_VLLM_LD_LIBRARY_PATH"
MLA_UNSUPPORTED = ("vLLM 0.33's extract_hidden_states has no MLA support (ExampleHiddenStatesConnector:"
                   " 'MLA verifiers are unsupported'), so the DeepseekV3 workload is ours alone")
VERSION_LINE = re.compile(r"vLLM server version (\S+?),")


def is_peer(mode: str) -> bool:
    """Whether ``mode`` is served by vLLM."""
    return mode in PEER_MODES


def unsupported(name: str) -> Optional[str]:
    """Why model ``name`` has no vLLM cells (None: it has)."""
    return MLA_UNSUPPORTED if MODELS[name].mla else None


def speculative_config(layer_ids: List[int]) -> dict:
    """``--speculative-config`` of server W, as vLLM 0.33's extract_hidden_states tests
    and example write it (``num_speculative_tokens`` must be 1:
    v1/worker/gpu/spec_decode/extract_hidden_states.py). The ids go in sorted: vLLM stores the slots
    in ascending id order whatever the order given (interfaces.py,
    ``_set_aux_hidden_state_layers``), as our files do."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": sorted(layer_ids)}}}


def kv_transfer_config(dump_dir: str, threads: int) -> dict:
    """``--kv-transfer-config`` of server W: the example connector writing into
    ``dump_dir`` with ``threads`` writer threads (its default is 8, as ours), the
    synchronization lock on (its default)."""
    return {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": dump_dir, "num_writer_threads": threads}}


def dump_flags(name: str, dump_dir: str) -> List[str]:
    """The flags that make server W extract: both configs as JSON."""
    threads = config.env_settings(this_host=False)["writer_threads"]
    return ["--speculative-config", json.dumps(speculative_config(MODELS[name].layer_ids)),
            "--kv-transfer-config", json.dumps(kv_transfer_config(dump_dir, threads))]


def gpu_memory_utilization(args) -> float:
    """vLLM's ``--gpu-memory-utilization``: ``--vllm-gpu-memory-utilization``, else the
    same number as our ``--mem-fraction-static`` (vLLM's counts activations too, SGLang's
    static fraction does not: vLLM's KV pool is a little smaller at the same number)."""
    return args.vllm_gpu_memory_utilization or args.mem_fraction_static


def vllm_command(args, name: str, port: int, extra: List[str]) -> List[str]:
    """vLLM's argv for model ``name`` on ``port``: the flags shared by servers V and W,
    then ``extra`` (what makes the kind)."""
    python = os.environ.get(ENV_PYTHON) or sys.executable
    cmd = [python, "-m", args.vllm_server_module, "--model", model_path(args, name),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "bfloat16", "--gpu-memory-utilization", str(gpu_memory_utilization(args)),
           # our servers' prefill chunk (SGLang's default on an H200 is also vLLM's on a
           # 70-160 GiB GPU, engine/arg_utils.py get_batch_defaults), so that the two stay equal
           "--max-num-batched-tokens", str(MODELS[name].chunk),
           # as our servers: no prefix cache (a cached prefix would compute, and so store,
           # only its suffix), token ids in and out, triton attention
           "--no-enable-prefix-caching", "--skip-tokenizer-init", "--attention-backend", "TRITON_ATTN",
           "--disable-uvicorn-access-log",
           # as our servers (no CUDA graphs), and no torch.compile: start-up in seconds
           "--enforce-eager", "--optimization-level", "0"]
    return cmd + extra


def vllm_env() -> dict:
    """Extra environment of vLLM's servers: no usage report and no hub look-ups (the host
    is offline), the plain version line (``version_of``), and ``KIMI_BENCH_VLLM_PYTHONPATH``
    / ``KIMI_BENCH_VLLM_LD_LIBRARY_PATH`` as the whole ``PYTHONPATH`` / ``LD_LIBRARY_PATH``
    when set."""
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_DISABLE_LOG_LOGO": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for var, name in ((ENV_PYTHONPATH, "PYTHONPATH"), (ENV_LD_LIBRARY_PATH, "LD_LIBRARY_PATH")):
        if os.environ.get(var):
            env[name] = os.environ[var]
    return env


def version_of(log_text: str) -> Optional[str]:
    """vLLM's version from its start-up line ("vLLM server version 0.33.0, serving model
    ..."), None if the log has none."""
    m = VERSION_LINE.search(log_text)
    return m.group(1) if m else None


def completion_body(ids, token_ids: bool = False) -> dict:
    """The ``/v1/completions`` body of one prompt (``ids``: token ids); ``token_ids``
    asks for ``choices[0].prompt_token_ids`` back (speculators' check; the file check
    uses it, the timed cells do not)."""
    body = {"model": SERVED_NAME, "prompt": list(ids), "max_tokens": 1, "temperature": 0}
    if token_ids:
        body["return_token_ids"] = True
    return body


def file_path(response: dict) -> Optional[str]:
    """The hidden-state file a completion response names, or None."""
    return (response.get("kv_transfer_params") or {}).get("hidden_states_path")


def wait_file(path: str) -> None:
    """Block until vLLM's writer has released ``<path>.lock`` (returns at once when there
    is no lock file): a blocking shared flock, as vLLM's own reader ``load_hidden_states``
    takes, so the wait ends when the kernel wakes the client, with no polling delay."""
    try:
        fd = os.open(path + ".lock", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)
