"""A stand-in for Kimi-K2.5's remote-code processor (``KimiK25Processor`` with its
``KimiK25VisionProcessor``), copied into the tiny Kimi models' directories
(tiny_models.build_kimi, build_kimi_vl) and loaded from there by SGLang.

Why it exists: SGLang builds the multimodal processor of a multimodal architecture at
start-up even with --skip-tokenizer-init (``TokenizerManager.init_tokenizer_and_processor``:
``get_processor`` = ``AutoProcessor.from_pretrained(model_path)``, then
``get_mm_processor``), and ``--enable-multimodal`` cannot be turned off from the command
line. The real checkpoint ships its processor as remote code (``kimi_k25_processor.py``,
``kimi_k25_vision_processing.py``, ``media_utils.py``; tiktoken); this file is its shape,
reached the same way: ``processor_config.json``'s ``auto_map`` names it, the server runs
with --trust-remote-code.

What SGLang 0.5.23 reads (``KimiK2_5VLImageProcessor`` and ``KimiGPUProcessorWrapper``,
srt/multimodal/processors/kimi_k25.py): ``tokenizer`` (the placeholder ``<|media_pad|>``
resolved to ``media_placeholder_token_id``, the chat template), ``image_processor``,
``media_processor.media_proc_cfg`` (patch size, merge kernel, patch limits, mean/std).
With CUDA, SGLang preprocesses images itself (``_gpu_call``: ``navit_resize_config``, a
bicubic resize, zero padding, normalize, patchify) and expands the request's own
placeholder ids; without it (or with SGLANG_FORCE_CPU_IMAGE_PREPROCESSING) it calls this
processor: ``media_tokens_calculator`` per image, then ``__call__(text=[<placeholders
expanded>], medias=[{"type": "image", "image": PIL}])`` for ``input_ids``,
``pixel_values`` and ``grid_thws``.

Reproduced from the real processor (its image path only): ``navit_resize_image``'s
arithmetic (scale to at most ``in_patch_limit`` patches and ``patch_limit_on_one_side``
patches a side, never up; pad to a multiple of ``patch_size * merge_kernel_size``), the
token count ``(H/patch/merge) * (W/patch/merge)`` (``fixed_output_tokens`` when set), PIL's
bicubic resize, zero padding (right and bottom) before normalizing, ``(x/255 - mean) /
std`` in float32, ``navit_patchify``'s order (``pixel_values [n_patches, 3, patch,
patch]`` row-major over the grid, ``grid_thws [n_images, 3] = (1, H/patch, W/patch)``
int64). Not reproduced: videos and video chunks, transparent-background filling, the
tiktoken tokenizer (a word-level one instead: token i <-> ``t<i>``), and expanding
placeholders in ``__call__`` (SGLang expands before calling; so does this stand-in's
caller).

The tokenizer: with a ``tokenizer.json`` in the model directory (``kimi_vl``: a chat
template and Kimi's role and media tokens, tiny_models.save_kimi_vl_tokenizer), that one;
without (``kimi``, served with --skip-tokenizer-init), one built in memory whose only
special token is the placeholder: a ``tokenizer.json`` would make the GPU suite serve the
text model with a tokenizer (testing/server.py).

Besides the standard library, only transformers, tokenizers, numpy and PIL may be imported
here (transformers copies this file into its modules cache and checks that its imports
are installed; no import from this repository).
"""

from __future__ import annotations

import json
import math
import os

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

MEDIA_PAD = "<|media_pad|>"


class TinyKimiTokenizer(PreTrainedTokenizerFast):
    """A class of its own: SGLang's ``get_processor`` reloads a processor's tokenizer from
    the model directory when its class is transformers' generic ``TokenizersBackend`` (what
    ``PreTrainedTokenizerFast`` is in transformers 5)."""


def navit_resize(width: int, height: int, cfg: dict) -> dict:
    """The real processor's ``navit_resize_image`` for one ``width`` x ``height`` image
    under ``media_proc_cfg`` ``cfg``: ``new_width``/``new_height`` (the resize target,
    never larger than the image), ``pad_width``/``pad_height`` (zeros right and bottom up
    to a multiple of ``patch_size * merge_kernel_size``), ``num_tokens`` (merged vision
    tokens = ``<|media_pad|>`` tokens in the prompt). SGLang's GPU path computes the same
    (``kimi_k25.navit_resize_config``)."""
    patch, merge = cfg["patch_size"], cfg["merge_kernel_size"]
    limit, side = cfg["in_patch_limit"], cfg["patch_limit_on_one_side"]
    s1 = math.sqrt(limit / (max(1.0, width // patch) * max(1.0, height // patch)))
    scale = min(1.0, s1, side * patch / width, side * patch / height)
    new_w = min(max(1, int(width * scale)), side * patch)
    new_h = min(max(1, int(height * scale)), side * patch)
    factor = merge * patch
    pad_h, pad_w = (factor - new_h % factor) % factor, (factor - new_w % factor) % factor
    fixed = cfg.get("fixed_output_tokens")
    tokens = fixed if fixed is not None else ((new_h + pad_h) // factor) * ((new_w + pad_w) // factor)
    return {"num_tokens": tokens, "new_width": new_w, "new_height": new_h, "pad_width": pad_w, "pad_height": pad_h}


def _image(media):
    """The PIL image of a media dict ``{"type": "image", "image": PIL.Image}`` (or a bare
    image), as RGB; ValueError for another media type (videos are not reproduced)."""
    if isinstance(media, dict):
        if media.get("type") != "image":
            raise ValueError(f"the tiny Kimi processor takes images only, not {media.get('type')!r}")
        media = media["image"]
    return media.convert("RGB")


class TinyKimiMediaProcessor:
    """The real ``KimiK25VisionProcessor``'s image path: ``media_proc_cfg``,
    ``media_tokens_calculator``, ``preprocess``."""

    def __init__(self, media_proc_cfg: dict):
        self.media_proc_cfg = dict(media_proc_cfg)

    def media_tokens_calculator(self, media) -> int:
        """How many ``<|media_pad|>`` tokens the image of ``media`` becomes."""
        width, height = _image(media).size
        return navit_resize(width, height, self.media_proc_cfg)["num_tokens"]

    def preprocess(self, medias, return_tensors=None) -> dict:
        """``{"pixel_values": [n_patches, 3, patch, patch] float32, "grid_thws": [n, 3]
        int64}`` for a list of image medias (torch tensors when ``return_tensors`` is
        "pt", else numpy arrays); ``{}`` for none."""
        import numpy as np
        from PIL import Image

        cfg = self.media_proc_cfg
        patch = cfg["patch_size"]
        mean = np.asarray(cfg["image_mean"], dtype=np.float32)
        std = np.asarray(cfg["image_std"], dtype=np.float32)
        patches, grids = [], []
        for media in medias if isinstance(medias, list) else [medias]:
            image = _image(media)
            r = navit_resize(image.size[0], image.size[1], cfg)
            if (r["new_width"], r["new_height"]) != image.size:
                image = image.resize((r["new_width"], r["new_height"]), resample=Image.Resampling.BICUBIC)
            x = np.pad(np.asarray(image), ((0, r["pad_height"]), (0, r["pad_width"]), (0, 0)))
            x = ((x.astype(np.float32) / 255.0) - mean) / std
            h, w = x.shape[0] // patch, x.shape[1] // patch
            patches.append(x.reshape(h, patch, w, patch, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, patch, patch))
            grids.append([1, h, w])
        if not patches:
            return {}
        out = {"pixel_values": np.concatenate(patches).astype(np.float32), "grid_thws": np.asarray(grids, dtype=np.int64)}
        if return_tensors == "pt":
            import torch

            out = {k: torch.from_numpy(v) for k, v in out.items()}
        return out


class TinyKimiK25Processor:
    """``tokenizer`` (a TinyKimiTokenizer), ``media_processor`` (= ``image_processor``, a
    TinyKimiMediaProcessor)."""

    def __init__(self, tokenizer, media_proc_cfg: dict):
        self.tokenizer = tokenizer
        self.media_processor = self.image_processor = TinyKimiMediaProcessor(media_proc_cfg)

    @classmethod
    def register_for_auto_class(cls, auto_class: str = "AutoProcessor") -> None:
        """Called by AutoProcessor on remote-code classes; nothing to register."""

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> TinyKimiK25Processor:
        """From ``path``'s processor_config.json (``media_proc_cfg``) and its tokenizer
        files, or, without a tokenizer.json, config.json's vocab size and media
        placeholder id; other keyword arguments are ignored."""
        with open(os.path.join(path, "processor_config.json")) as f:
            media_proc_cfg = json.load(f)["media_proc_cfg"]
        if os.path.exists(os.path.join(path, "tokenizer.json")):
            return cls(TinyKimiTokenizer.from_pretrained(path), media_proc_cfg)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        vocab = {f"t{i}": i for i in range(config["text_config"]["vocab_size"])}
        pad_id = config["media_placeholder_token_id"]
        del vocab[f"t{pad_id}"]
        vocab[MEDIA_PAD] = pad_id
        tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer = TinyKimiTokenizer(tokenizer_object=tok, unk_token="t0", bos_token="t0", eos_token="t1",
                                      additional_special_tokens=[MEDIA_PAD])
        return cls(tokenizer, media_proc_cfg)

    def __call__(self, text=None, medias=None, return_tensors=None, **kwargs) -> dict:
        """``input_ids`` (and ``attention_mask``) of ``text`` (a string or a list of one
        per sequence, placeholders already expanded: SGLang's ``_cpu_call`` expands them
        with ``media_tokens_calculator``), plus ``preprocess(medias)``. ``padding`` and
        other tokenizer keyword arguments SGLang passes are ignored."""
        out = {}
        if text is not None:
            enc = self.tokenizer(text if isinstance(text, list) else [text], return_tensors=return_tensors)
            out.update({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
        if medias:
            out.update(self.media_processor.preprocess(medias, return_tensors=return_tensors))
        return out
