"""bench/bf16_drift.py on a CPU: one decoder layer of Llama-3.1-8B's shape, three streams."""

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
