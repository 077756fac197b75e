"""bench/bf16_drift.py on a CPU: one decoder layer of Llama-3.1-8B's shape, three streams."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def test_drift_starts_at_bf16_rounding_and_grows_through_a_layer():
    """Entering layer 0 the streams differ by the bf16 rounding of the embeddings alone
    (relative ~2^-9; SDPA and eager identical); after one layer the two bf16 kernels part
    and both leave float32 by more than rounding, yet by less than 5%."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from bench import bf16_drift

    res = bf16_drift.drift("llama-8b", tokens=16, num_layers=1, layer_ids=[0, 1])
    e = res["errors"]
    assert res["layer_ids"] == [0, 1] and set(e) == {"bf16_sdpa_vs_f32", "bf16_eager_vs_f32",
                                                      "bf16_sdpa_vs_bf16_eager"}
    assert 5e-4 < e["bf16_sdpa_vs_f32"][0] < 4e-3 and e["bf16_sdpa_vs_f32"][0] == e["bf16_eager_vs_f32"][0]
    assert e["bf16_sdpa_vs_bf16_eager"][0] == 0.0
    for pair in e:
        assert e[pair][0] < e[pair][1] < 5e-2, (pair, e[pair])
    with pytest.raises(ValueError, match="not a Llama"):
        bf16_drift.drift("deepseek-tiny")


def test_layer_ids_outside_the_run_are_refused():
    """A shortened run keeps the model's ids that still exist, and refuses to return
    nothing: num_layers=1 leaves none of llama-8b's 2, 16, 29, 32."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import subprocess

    from bench import bf16_drift

    with pytest.raises(ValueError, match=r"not within 0..1"):
        bf16_drift.drift("llama-8b", tokens=4, num_layers=1)
    with pytest.raises(ValueError, match=r"not within 0..2"):
        bf16_drift.drift("llama-8b", tokens=4, num_layers=2, layer_ids=[3])
    r = subprocess.run([sys.executable, "-m", "bench.bf16_drift", "--num-layers", "1", "--tokens", "4"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "error: layer ids [2, 16, 29, 32] are not within 0..1" in r.stderr


def test_hf_drift_is_hf_own_bf16_load_against_its_float32_load(tmp_path):
    """The whole-model mode on the tiny Llama: its per-id errors are those of HF's own
    bf16 load (``from_pretrained(dtype=bfloat16)``) against its float32 load on the same
    prompts, computed here without bench code; bf16 rounding, so under 2e-2. A bad
    --prompt-lens is a one-line usage error."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import subprocess

    from transformers import AutoModelForCausalLM

    from bench import bf16_drift

    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import tiny_models

    path = str(tmp_path / "llama")
    tiny_models.build_llama(path)
    res = bf16_drift.hf_drift(path, [40, 300], device="cpu", seed=3, layer_ids=[2, 8])
    assert res["layer_ids"] == [2, 8] and res["prompt_lens"] == [40, 300]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, tiny_models.VOCAB, (t,), generator=g) for t in (40, 300)]
    want = [0.0, 0.0]
    models = {dt: AutoModelForCausalLM.from_pretrained(path, dtype=dt).eval() for dt in (torch.float32, torch.bfloat16)}
    with torch.no_grad():
        for p in prompts:
            f32, b16 = (models[dt](p[None], output_hidden_states=True).hidden_states for dt in models)
            # id 2: the stream entering layer 2 (id 8 = N, the final norm's input, is not among
            # HF's hidden_states, which end after the norm: only id 2 is recomputed here)
            a, b = f32[2][0], b16[2][0].float()
            want[0] = max(want[0], ((b - a).norm() / a.norm()).item())
    assert res["hf_bf16_vs_f32"]["slots"][0] == pytest.approx(want[0], rel=1e-4)
    assert 0 < want[0] < 2e-2 and 0 < res["hf_bf16_vs_f32"]["slots"][1] < 2e-2
    # a directory without a checkpoint is refused, never built into unless --build says so;
    # --build over a model is refused; bad ids, lengths and devices are one-line errors
    for argv, msg in (
            (["--hf-model-dir", path, "--prompt-lens", "5,x"], "--prompt-lens and --layer-ids take comma-separated"),
            (["--hf-model-dir", str(tmp_path / "none")], f"{tmp_path / 'none'} holds no HF checkpoint"),
            (["--hf-model-dir", path, "--build"], f"{path} already holds a model (config.json): building llama-8b"),
            (["--hf-model-dir", path, "--layer-ids", "2,9", "--device", "cpu"], "layer ids [2, 9] are not within 0..8"),
            (["--hf-model-dir", path, "--prompt-lens", "16,0", "--device", "cpu"], "prompt lengths must be >= 1"),
            (["--hf-model-dir", path, "--device", "tpu"], "--device tpu: cpu, cuda or cuda:N")):
        r = subprocess.run([sys.executable, "-m", "bench.bf16_drift", *argv], cwd=REPO, capture_output=True,
                           text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert r.returncode == 2 and f"error: {msg}" in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
    assert not (tmp_path / "none").exists()
    r = subprocess.run([sys.executable, "-m", "bench.bf16_drift", "--hf-model-dir", path, "--device", "cuda"],
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and "error: --device cuda: torch sees no CUDA device here" in r.stderr
