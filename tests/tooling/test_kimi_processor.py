"""The tiny Kimi-K2.5's processor stand-in (testing/kimi_processor.py) and ``kimi_vl``'s
tokenizer (testing/tiny_models.py) against SGLang's own Kimi-K2.5 image path, on the CPU
(SGLang as installed in the test venv, srt/multimodal/processors/kimi_k25.py and
kimi_common.py):

- the chat template: an image part renders as Kimi-K2.5's published template renders it,
  one ``<|media_pad|>`` (``media_placeholder_token_id``) per image;
- ``media_tokens_calculator`` and the resize arithmetic equal SGLang's
  ``navit_resize_config`` (the GPU path's), and the grid the processor cuts gives that many
  tokens by SGLang's own grid formula (``KimiGridMMDataMixin._num_image_tokens_from_grid``:
  the merged patches the tower emits);
- ``pixel_values`` equal what SGLang's GPU preprocessing (``_process_single_image``:
  resize, zero padding, normalize, patchify) makes of the same image when run on CPU
  tensors: exactly without a resize, within a few 8-bit levels with one (PIL's bicubic
  against torch's antialiased one, as SGLang's docstring says);
- SGLang's ``KimiGPUProcessorWrapper`` over the stand-in, on a host without CUDA (its CPU
  fallback, ``_cpu_call``), expands the placeholder and returns the stand-in's pixels and
  grid under ``image_grid_thw``, from text and from the request's own ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")
kimi_k25 = pytest.importorskip("sglang.srt.multimodal.processors.kimi_k25")
kimi_common = pytest.importorskip("sglang.srt.multimodal.processors.kimi_common")

from testing import kimi_processor, tiny_models  # noqa: E402

PAD = tiny_models.KIMI_MEDIA_PLACEHOLDER
SIZES = [(84, 56), (56, 56), (70, 56), (30, 20), (1000, 300), (20, 500), (3000, 3000)]
UNRESIZED = [(84, 56), (56, 56), (70, 56), (30, 20)]  # within 16x16 patches: padded only


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    """The stand-in loaded from a ``kimi_vl``-style directory (processor config, tokenizer
    files, the processor file), as SGLang's AutoProcessor loads it."""
    path = tmp_path_factory.mktemp("kimi-vl")
    vision = tiny_models.kimi_vision_config(1024)
    (path / "processor_config.json").write_text(json.dumps(tiny_models.kimi_processor_config(vision)))
    tiny_models.save_kimi_vl_tokenizer(str(path))
    shutil.copy(Path(kimi_processor.__file__), path)
    return kimi_processor.TinyKimiK25Processor.from_pretrained(str(path))


def cfg(processor):
    return processor.media_processor.media_proc_cfg


def png_image(width, height, seed):
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    return Image.fromarray(pixels)


def wrapper(processor):
    """SGLang's KimiGPUProcessorWrapper over the stand-in, built as
    KimiK2_5VLImageProcessor builds it."""
    c = cfg(processor)
    return kimi_k25.KimiGPUProcessorWrapper(
        processor, image_token="<|media_pad|>", image_token_id=PAD, patch_size=c["patch_size"],
        merge_kernel_size=c["merge_kernel_size"], in_patch_limit=c["in_patch_limit"],
        patch_limit_on_one_side=c["patch_limit_on_one_side"], fixed_output_tokens=c.get("fixed_output_tokens"),
        image_mean=c["image_mean"], image_std=c["image_std"])


def sglang_pixels(processor, image):
    """SGLang's GPU preprocessing of ``image`` run on CPU tensors: [n, 3, p, p] float32."""
    c = cfg(processor)
    config = kimi_k25.navit_resize_config(*image.size, c["patch_size"], c["merge_kernel_size"], c["in_patch_limit"],
                                          c["patch_limit_on_one_side"], c.get("fixed_output_tokens"))
    scale, bias = wrapper(processor)._get_gpu_norm_tensors(device="cpu")

    def to_chw(im):
        return torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1).contiguous()

    return kimi_k25._process_single_image(image, config, scale, bias, c["patch_size"], to_chw=to_chw)


def test_chat_template_renders_one_placeholder_per_image(processor):
    """Kimi-K2.5's layout: <|im_user|>user<|im_middle|>, the image as
    <|media_begin|>image<|media_content|><|media_pad|><|media_end|>, the text, <|im_end|>,
    then the assistant's header (role names and "image" are unknown words, id 0)."""
    tok = processor.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t5 t17 t300"}]}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    s = tiny_models.KIMI_VL_SPECIAL
    assert ids == [s["<|im_user|>"], 0, s["<|im_middle|>"], s["<|media_begin|>"], 0, s["<|media_content|>"], PAD,
                   s["<|media_end|>"], 5, 17, 300, s["<|im_end|>"], s["<|im_assistant|>"], 0, s["<|im_middle|>"]]
    assert tok.convert_tokens_to_ids("<|media_pad|>") == PAD
    assert tok.encode("", add_special_tokens=False) == []  # no BOS of its own: SGLang adds none twice


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_token_count_is_sglangs(processor, size):
    """media_tokens_calculator and the resize equal SGLang's navit_resize_config; the grid
    the processor cuts merges into that many tokens by SGLang's grid formula."""
    c = cfg(processor)
    want = kimi_k25.navit_resize_config(*size, c["patch_size"], c["merge_kernel_size"], c["in_patch_limit"],
                                        c["patch_limit_on_one_side"], c.get("fixed_output_tokens"))
    assert kimi_processor.navit_resize(*size, c) == want
    image = png_image(*size, seed=size[0])
    n = processor.media_processor.media_tokens_calculator({"type": "image", "image": image})
    assert n == want["num_tokens"]
    out = processor.media_processor.preprocess([{"type": "image", "image": image}], return_tensors="pt")
    (grid,) = out["grid_thws"].tolist()
    mixin = SimpleNamespace(hf_config=SimpleNamespace(vision_config=SimpleNamespace(merge_kernel_size=[2, 2])))
    assert kimi_common.KimiGridMMDataMixin._num_image_tokens_from_grid(mixin, grid) == n
    assert out["pixel_values"].shape == (grid[1] * grid[2], 3, c["patch_size"], c["patch_size"])
    assert out["pixel_values"].dtype == torch.float32 and out["grid_thws"].dtype == torch.int64


@pytest.mark.parametrize("size", UNRESIZED, ids=lambda s: f"{s[0]}x{s[1]}")
def test_pixels_equal_sglangs_gpu_path_without_resize(processor, size):
    """Padded, normalized and patchified as SGLang's GPU path does (its torch fallback on
    CPU tensors): equal to float32 rounding."""
    image = png_image(*size, seed=7)
    got = processor.media_processor.preprocess([{"type": "image", "image": image}], return_tensors="pt")["pixel_values"]
    want = sglang_pixels(processor, image)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=0), f"max |diff| {float((got - want).abs().max()):.3g}"


def test_pixels_near_sglangs_gpu_path_with_resize(processor):
    """A 1000x300 image is resized (bicubic): PIL's (the real processor's) and torch's
    antialiased one (SGLang's GPU path) differ by a few 8-bit levels at most."""
    image = png_image(1000, 300, seed=3)
    got = processor.media_processor.preprocess([{"type": "image", "image": image}], return_tensors="pt")["pixel_values"]
    want = sglang_pixels(processor, image)
    assert got.shape == want.shape
    level = 1 / 255 / 0.5  # one 8-bit level after normalizing with std 0.5
    diff = (got - want).abs()
    assert float(diff.mean()) < 1.0 * level and float(diff.max()) <= 8 * level + 1e-6, (float(diff.mean()), float(diff.max()))


def test_sglang_cpu_fallback_over_the_stand_in(processor):
    """SGLang's wrapper without CUDA: the placeholder expanded to the image's token count
    (from the text, and from the request's own ids), the stand-in's pixels, the grid under
    image_grid_thw."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA SGLang's wrapper takes its GPU path, not the stand-in")
    image = png_image(84, 56, seed=1)
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t5 t17"}]}],
        tokenize=False, add_generation_prompt=True)
    ids = processor.tokenizer.encode(text, add_special_tokens=False)
    want_ids = [t for i in ids for t in ([PAD] * 6 if i == PAD else [i])]  # 4x6 patches, merged 2x2
    want_pixels = processor.media_processor.preprocess([image], return_tensors="pt")["pixel_values"]
    w = wrapper(processor)
    for kwargs in ({}, {"sglang_original_input_ids": ids}):
        out = w(text=[text], images=[image], padding=True, return_tensors="pt", **kwargs)
        assert out["input_ids"].reshape(-1).tolist() == want_ids, kwargs
        assert out["image_grid_thw"].tolist() == [[1, 4, 6]]
        assert torch.equal(out["pixel_values"], want_pixels)


def test_text_model_processor_keeps_its_in_memory_tokenizer(tmp_path):
    """``kimi`` (no tokenizer.json, served with --skip-tokenizer-init): the in-memory
    word-level tokenizer, the placeholder its only special token."""
    vision = tiny_models.kimi_vision_config(1024)
    (tmp_path / "processor_config.json").write_text(json.dumps(tiny_models.kimi_processor_config(vision)))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 1024},
                                                      "media_placeholder_token_id": PAD}))
    proc = kimi_processor.TinyKimiK25Processor.from_pretrained(str(tmp_path))
    assert proc.tokenizer.encode("t5 <|media_pad|> t300", add_special_tokens=False) == [5, PAD, 300]
    assert proc.tokenizer.chat_template is None
