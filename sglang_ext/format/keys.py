"""The contract's spelled names: request and response keys, tensor and metadata keys,
file name suffixes, the index's name. The only place each is spelled."""

from __future__ import annotations

__all__ = [
    "FORMAT_VERSION", "WAIT_PARAM", "DUMP_PARAM", "PATH_KEY", "ERROR_KEY", "PENDING_KEY",
    "MANIFEST_KEY", "RESPONSE_KEYS", "KEY_HIDDEN_STATES", "KEY_TOKEN_IDS", "KEY_SCALES",
    "FP8", "DTYPE_META_KEY", "SCALE_LAYOUT_KEY", "SCALE_LAYOUT", "SUFFIX", "LOCK_SUFFIX",
    "ERROR_SUFFIX", "TMP_PREFIX", "TMP_SUFFIX", "INDEX_NAME", "SHUTDOWN_MESSAGE",
    "OUTPUT_PARAM", "VLLM_OUTPUT_PARAM", "NUM_PROMPT_TOKENS_KEY", "LAST_TOKEN_ID_KEY",
]


FORMAT_VERSION = "kimi-sglang/1"
# Request and response keys (the only place they are spelled).
WAIT_PARAM = "hidden_states_wait"  # request: custom_params key; false = answer early
DUMP_PARAM = "hidden_states_dump"  # request: custom_params key; false = not dumped
# request: custom_params key; true = the generated tokens' rows too (format.output)
OUTPUT_PARAM = "hidden_states_output"
VLLM_OUTPUT_PARAM = "include_output_tokens"  # the same, vLLM's kv_transfer_params spelling
PATH_KEY = "hidden_states_path"  # response meta_info: the file (absolute path)
ERROR_KEY = "hidden_states_error"  # response meta_info: why there is no file
PENDING_KEY = "hidden_states_pending"  # response meta_info: true = wait on <path>.lock
# response meta_info (store sink): the version-1 transfer manifest of the request's object
MANIFEST_KEY = "hidden_states_manifest"
RESPONSE_KEYS = (PATH_KEY, ERROR_KEY, PENDING_KEY, MANIFEST_KEY)  # all a dumped request's meta_info may add
KEY_HIDDEN_STATES = "hidden_states"
KEY_TOKEN_IDS = "token_ids"
KEY_SCALES = "hidden_states_scales"  # fp8 files: float32 [T, L, 1] (hs-connectors' name)
FP8 = "float8_e4m3fn"
# Metadata of fp8 files (bf16 files carry neither: their dtype is in the header).
DTYPE_META_KEY = "hidden_states_dtype"
SCALE_LAYOUT_KEY = "scale_layout"
SCALE_LAYOUT = "per_token_per_layer"  # one float32 scale per token and layer slot (quant)
# Metadata of files with output rows (format.output): P, and the last sampled id (decimal).
NUM_PROMPT_TOKENS_KEY = "num_prompt_tokens"
LAST_TOKEN_ID_KEY = "last_token_id"
SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"
ERROR_SUFFIX = ".error"
TMP_PREFIX = ".kimi-"  # temporary files: tmp_name; hidden, and ours by their prefix
TMP_SUFFIX = ".tmp"
INDEX_NAME = "index.jsonl"
# What a file still unwritten when the server shut down fails with (its ``.error``),
# whichever side settles it: the writer process at its drain deadline, the scheduler
# after the writer process exited.
SHUTDOWN_MESSAGE = "server shut down before the hidden-state file was written"
