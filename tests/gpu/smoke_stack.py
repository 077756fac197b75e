"""Smoke test of a staged stack on the device host: `bash tests/gpu/stage-stack.sh smoke
sglang|vllm` (which sets the stack's PYTHONPATH first). Prints where each package comes
from and its version, then runs independent checks, each `OK name: detail` or
`FAIL name: error` (a failure does not stop the others): a CUDA bf16 matmul, a one-rank
NCCL all_reduce, a Triton kernel, torch.compile, cuDNN (WARN only: nothing here needs it),
then the stack's own: imports of the server modules, one compiled kernel of the stack
(sgl_kernel rmsnorm / vLLM's _C rms_norm and FlashAttention 3) and one of its Triton
kernels (SGLang's decode attention, GQA and MLA shapes), and the server configuration
(SGLang's ServerArgs / vLLM's engine config with extract_hidden_states and
ExampleHiddenStatesConnector) for a tiny Llama config. Exit status 1 when a check failed.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import itertools
import json
import os
import socket
import sys
import tempfile
import time
import traceback

FAILED, PASSED = [], []
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(REPO)  # sglang_ext, after the stack


def check(name):
    def run(fn):
        t0 = time.time()
        try:
            detail = fn()
            PASSED.append(name)
            print(f"OK   {name}: {detail or ''} [{time.time() - t0:.1f}s]", flush=True)
        except BaseException as e:  # noqa: BLE001 - report everything, go on
            FAILED.append(name)
            tb = traceback.format_exception(type(e), e, e.__traceback__)
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:800]}", flush=True)
            print("     " + "     ".join(tb[-4:]).rstrip()[:3000], flush=True)
        return fn
    return run


def rel_err(got, ref):
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def versions(stack):
    dists = ["torch", "triton", "torchvision", "torchaudio", "numpy", "transformers", "tokenizers",
             "huggingface-hub", "safetensors", "flashinfer-python", "apache-tvm-ffi", "xgrammar",
             "fastapi", "pydantic", "openai", "nvidia-nccl-cu13", "nvidia-cudnn-cu13", "cuda-bindings"]
    dists += ["sglang", "sglang-kernel"] if stack == "sglang" else ["vllm", "hs-connectors", "compressed-tensors"]
    print(f"python {sys.version.split()[0]} at {sys.executable}")
    print("PYTHONPATH=" + os.environ.get("PYTHONPATH", ""))
    for d in dists:
        try:
            dist = md.distribution(d)
            print(f"  {d:22s} {dist.version:18s} {dist.locate_file('')}")
        except md.PackageNotFoundError:
            print(f"  {d:22s} (not installed)")


def common():
    import torch

    @check("torch import")
    def _():
        return f"{torch.__version__} cuda {torch.version.cuda} from {os.path.dirname(torch.__file__)}"

    @check("cuda matmul")
    def _():
        dev = torch.cuda.get_device_name(0)
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ b.float()
        c = a @ b
        torch.cuda.synchronize()
        t0 = time.time()
        for _ in range(10):
            c = a @ b
        torch.cuda.synchronize()
        tflops = 10 * 2 * 4096**3 / (time.time() - t0) / 1e12
        err = rel_err(c, ref)
        assert err < 1e-2, f"relative error {err}"
        return f"{dev} cc {torch.cuda.get_device_capability(0)}, rel err {err:.1e}, ~{tflops:.0f} TFLOP/s"

    @check("nccl all_reduce (1 rank)")
    def _():
        import torch.distributed as dist
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        try:
            x = torch.ones(1024, device="cuda")
            dist.all_reduce(x)
            torch.cuda.synchronize()
            assert x.sum().item() == 1024
        finally:
            dist.destroy_process_group()
        return f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"

    @check("triton kernel")
    def _():
        import triton
        import triton.language as tl

        @triton.jit
        def add(x, y, out, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = i < n
            tl.store(out + i, tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)

        x = torch.randn(10000, device="cuda")
        y = torch.randn(10000, device="cuda")
        out = torch.empty_like(x)
        add[(triton.cdiv(10000, 1024),)](x, y, out, 10000, BLOCK=1024)
        assert torch.allclose(out, x + y)
        return f"triton {triton.__version__} from {os.path.dirname(triton.__file__)}"

    @check("torch.compile")
    def _():
        f = torch.compile(lambda x: torch.sin(x) * 2 + x.pow(2).sum(-1, keepdim=True))
        x = torch.randn(64, 128, device="cuda")
        assert torch.allclose(f(x), torch.sin(x) * 2 + x.pow(2).sum(-1, keepdim=True), atol=1e-4)
        return "inductor + triton"

    try:
        conv = torch.nn.functional.conv2d(torch.randn(1, 3, 8, 8, device="cuda"), torch.randn(4, 3, 3, 3, device="cuda"))
        print(f"OK   cudnn: version {torch.backends.cudnn.version()}, conv2d {tuple(conv.shape)}")
    except Exception as e:  # noqa: BLE001
        print(f"WARN cudnn: {type(e).__name__}: {str(e)[:300]} (not needed by the LLM paths)")


def imports(mods):
    for m in mods:
        @check(f"import {m}")
        def _(m=m):
            importlib.import_module(m)


def tiny_llama_dir():
    d = tempfile.mkdtemp(prefix="smoke-llama-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                   "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "num_hidden_layers": 4, "vocab_size": 1000, "max_position_embeddings": 2048,
                   "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "rope_theta": 10000.0,
                   "tie_word_embeddings": False}, f)
    return d


def sglang_decode(hq, hkv, dk, dv, mla, dev="cuda", dtype=None):
    """SGLang's Triton decode attention against a float32 reference; the relative error."""
    import torch
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    g = torch.Generator(device=dev).manual_seed(0)
    lens = [5, 37, 130]
    b, total = len(lens), sum(lens)
    q = torch.randn(b, hq, dk, device=dev, dtype=dtype or torch.bfloat16, generator=g)
    k = torch.randn(total, hkv, dk, device=dev, dtype=dtype or torch.bfloat16, generator=g)
    v = k[..., :dv] if mla else torch.randn(total, hkv, dv, device=dev, dtype=dtype or torch.bfloat16, generator=g)
    kv_indptr = torch.tensor([0, *itertools.accumulate(lens)], device=dev, dtype=torch.int32)
    kv_indices = torch.arange(total, device=dev, dtype=torch.int64)
    max_splits = 4
    o = torch.empty(b, hq, dv, device=dev, dtype=dtype or torch.bfloat16)
    logits = torch.empty(b, hq, max_splits, dv, device=dev, dtype=torch.float32)
    lse = torch.empty(b, hq, max_splits, device=dev, dtype=torch.float32)
    splits = torch.full((b,), 2, device=dev, dtype=torch.int32)
    scale = dk ** -0.5
    decode_attention_fwd(q, k, v, o, kv_indptr, kv_indices, logits, lse, splits, max_splits,
                         scale, 1.0, 1.0, has_mla=mla)
    ref = torch.empty_like(o, dtype=torch.float32)
    for i in range(b):
        s, e = int(kv_indptr[i]), int(kv_indptr[i + 1])
        kk = k[s:e].float().repeat_interleave(hq // hkv, dim=1)  # [t, hq, dk]
        vv = v[s:e].float().repeat_interleave(hq // hkv, dim=1)
        att = torch.einsum("hd,thd->ht", q[i].float(), kk) * scale
        ref[i] = torch.einsum("ht,thd->hd", att.softmax(-1), vv)
    err = rel_err(o, ref)
    assert err < 2e-2, f"relative error {err}"
    return f"rel err {err:.1e}"


def sglang_checks():
    import torch

    imports(["sgl_kernel", "flashinfer", "sglang.launch_server", "sglang.srt.managers.scheduler",
             "sglang.srt.model_executor.model_runner", "sglang.srt.models.llama",
             "sglang.srt.models.deepseek_v2", "sglang.srt.models.kimi_k25",
             "sglang.kernels.ops.gemm.cutedsl_dual_gemm",
             "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.moe.fused_moe_triton",
             "sglang.srt.entrypoints.http_server", "sglang_ext.hooks"])

    @check("sgl_kernel rmsnorm")
    def _():
        import sgl_kernel
        x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
        ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)) * w.float()
        err = rel_err(sgl_kernel.rmsnorm(x, w, 1e-6), ref)
        assert err < 1e-2, f"relative error {err}"
        return f"rel err {err:.1e}"

    @check("sglang triton decode attention (GQA 8/2 x 128)")
    def _():
        return sglang_decode(8, 2, 128, 128, False)

    @check("sglang triton decode attention (MLA 16 x 576/512)")
    def _():
        return sglang_decode(16, 1, 576, 512, True)

    @check("sglang server args (tiny llama, triton, kimi parsers)")
    def _():
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.server_args import prepare_server_args
        a = prepare_server_args(["--model-path", tiny_llama_dir(), "--attention-backend", "triton",
                                 "--sampling-backend", "pytorch", "--skip-tokenizer-init",
                                 "--reasoning-parser", "kimi_k2", "--tool-call-parser", "kimi_k2"])
        mc = ModelConfig.from_server_args(a)
        return f"{a.attention_backend}, {mc.hf_config.architectures}"


def vllm_checks():
    import torch

    imports(["vllm", "flashinfer", "vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main",
             "vllm.v1.engine.core", "vllm.v1.worker.gpu_model_runner",
             "vllm.v1.spec_decode.extract_hidden_states", "vllm.model_executor.models.extract_hidden_states",
             "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
             "vllm.model_executor.models.llama", "vllm.model_executor.models.deepseek_v2",
             "vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.triton_attn",
             "vllm.v1.attention.backends.mla.triton_mla", "hs_connectors"])

    @check("vllm platform")
    def _():
        from vllm.platforms import current_platform
        assert current_platform.is_cuda(), type(current_platform).__name__
        return type(current_platform).__name__

    @check("vllm _C rms_norm")
    def _():
        from vllm import _custom_ops as ops
        x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        ops.rms_norm(out, x, w, 1e-6)
        ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)) * w.float()
        err = rel_err(out, ref)
        assert err < 1e-2, f"relative error {err}"
        return f"rel err {err:.1e}"

    @check("vllm FlashAttention 3 (varlen, causal)")
    def _():
        from vllm.vllm_flash_attn import flash_attn_interface as fa
        assert fa.FA3_AVAILABLE, f"FA3 not staged (set vllm-fa3): {fa.FA3_UNAVAILABLE_REASON}"
        lens = [7, 100]
        t, h, hkv, d = sum(lens), 8, 2, 128
        q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, 7, 107], device="cuda", dtype=torch.int32)
        out = fa.flash_attn_varlen_func(q, k, v, max(lens), cu, max(lens), cu_seqlens_k=cu, causal=True,
                                        softmax_scale=d ** -0.5, fa_version=3)
        ref = torch.empty(t, h, d, device="cuda")
        for s, e in ((0, 7), (7, 107)):
            qq = q[s:e].float().transpose(0, 1)
            kk = k[s:e].float().repeat_interleave(h // hkv, 1).transpose(0, 1)
            vv = v[s:e].float().repeat_interleave(h // hkv, 1).transpose(0, 1)
            ref[s:e] = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(0, 1)
        err = rel_err(out, ref)
        assert err < 2e-2, f"relative error {err}"
        return f"rel err {err:.1e}"

    @check("vllm engine config (extract_hidden_states + ExampleHiddenStatesConnector)")
    def _():
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.entrypoints.launchers.app import build_app
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        args = make_arg_parser(FlexibleArgumentParser()).parse_args([
            "--model", tiny_llama_dir(), "--skip-tokenizer-init", "--max-model-len", "1024",
            "--speculative-config", json.dumps({"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                                "draft_model_config": {"hf_config": {
                                                    "eagle_aux_hidden_state_layer_ids": [1, 2]}}}),
            "--kv-transfer-config", json.dumps({"kv_connector": "ExampleHiddenStatesConnector",
                                                "kv_role": "kv_producer",
                                                "kv_connector_extra_config": {"shared_storage_path": "/tmp/hs"}})])
        validate_parsed_serve_args(args)
        cfg = AsyncEngineArgs.from_cli_args(args).create_engine_config()
        cls = KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)
        app = build_app(args, ("generate",), cfg.model_config)
        return (f"{cfg.speculative_config.method}, {cls.__name__}, attention {cfg.attention_config.backend}, "
                f"{len(app.routes)} routes")

    @check("bench's vLLM command lines (servers V and W) parse and validate")
    def _():
        from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        from bench import cli, servers
        root = tempfile.mkdtemp()
        args = cli.build_parser().parse_args(["--models", "llama-mid", "--modes", "vllm_nodump,vllm_dump",
                                              "--dump-root", root])
        seen = []
        for which in ("V", "W"):
            cmd = servers.server_cmd(args, "llama-mid", which)
            parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:])  # after python -m MOD
            validate_parsed_serve_args(parsed)
            seen.append(f"{which}: {len(cmd) - 3} args")
        spec, kv = parsed.speculative_config, parsed.kv_transfer_config
        spec = spec if isinstance(spec, dict) else vars(spec)
        kv = kv.model_dump() if hasattr(kv, "model_dump") else (kv if isinstance(kv, dict) else vars(kv))
        assert spec["method"] == "extract_hidden_states", spec
        assert kv["kv_connector"] == "ExampleHiddenStatesConnector", kv
        assert kv["kv_connector_extra_config"]["shared_storage_path"] == servers.dump_dir(args, "llama-mid", "W")
        return ", ".join(seen)


def main():
    stack = sys.argv[1] if len(sys.argv) > 1 else "sglang"
    if stack not in ("sglang", "vllm"):
        sys.exit("usage: smoke_stack.py sglang|vllm")
    versions(stack)
    common()
    sglang_checks() if stack == "sglang" else vllm_checks()
    print(f"smoke {stack}: {len(PASSED)} ok, {len(FAILED)} failed" + (f": {', '.join(FAILED)}" if FAILED else ""))
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
