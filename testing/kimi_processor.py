"""A text-only stand-in for Kimi-K2.5's remote-code processor, copied into the tiny
``kimi`` model's directory (tiny_models.build_kimi) and loaded from there by SGLang.

Why it exists: SGLang builds the multimodal processor of a multimodal architecture at
start-up even with --skip-tokenizer-init (``TokenizerManager.init_tokenizer_and_processor``:
``get_processor`` = ``AutoProcessor.from_pretrained(model_path)``, then
``get_mm_processor``), and ``--enable-multimodal`` cannot be turned off from the command
line. The real checkpoint ships its processor as remote code (``kimi_k25_processor.py``,
tiktoken); this file is its shape, reached the same way: ``processor_config.json``'s
``auto_map`` names it, the server runs with --trust-remote-code.

SGLang's ``KimiK2_5VLImageProcessor`` (srt/multimodal/processors/kimi_k25.py, 0.5.17 and
0.5.23) reads ``tokenizer``, ``image_processor``, ``media_processor.media_proc_cfg`` (patch
size, merge kernel, patch limits, mean/std) and, for an image, ``media_tokens_calculator``.
The tokenizer is word level (token i <-> ``t<i>``, the media placeholder id <->
``<|media_pad|>``), built in memory: a ``tokenizer.json`` in the model directory would make
the GPU suite serve it with a tokenizer (testing/server.py). Images raise: the suite
sends token ids only.

Besides the standard library, only transformers and tokenizers may be imported here
(transformers copies this file into its modules cache and checks its imports).
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

MEDIA_PAD = "<|media_pad|>"


class TinyKimiTokenizer(PreTrainedTokenizerFast):
    """A class of its own: SGLang's ``get_processor`` reloads a processor's tokenizer from
    the model directory when its class is transformers' generic ``TokenizersBackend`` (what
    ``PreTrainedTokenizerFast`` is in transformers 5), and there are no tokenizer files."""


class TinyKimiMediaProcessor:
    """``media_proc_cfg``: the keys SGLang reads from Kimi's media processor."""

    def __init__(self, media_proc_cfg: dict):
        self.media_proc_cfg = dict(media_proc_cfg)

    def media_tokens_calculator(self, media):
        raise NotImplementedError("the tiny kimi model's processor is text only")


class TinyKimiK25Processor:
    """``tokenizer`` (a TinyKimiTokenizer), ``media_processor`` (= ``image_processor``)."""

    def __init__(self, tokenizer, media_proc_cfg: dict):
        self.tokenizer = tokenizer
        self.media_processor = self.image_processor = TinyKimiMediaProcessor(media_proc_cfg)

    @classmethod
    def register_for_auto_class(cls, auto_class: str = "AutoProcessor") -> None:
        """Called by AutoProcessor on remote-code classes; nothing to register."""

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> TinyKimiK25Processor:
        """From ``path``'s config.json (vocab size, media placeholder id) and
        processor_config.json (``media_proc_cfg``); other keyword arguments are ignored."""
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(path, "processor_config.json")) as f:
            media_proc_cfg = json.load(f)["media_proc_cfg"]
        vocab = {f"t{i}": i for i in range(config["text_config"]["vocab_size"])}
        pad_id = config["media_placeholder_token_id"]
        del vocab[f"t{pad_id}"]
        vocab[MEDIA_PAD] = pad_id
        tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer = TinyKimiTokenizer(tokenizer_object=tok, unk_token="t0", bos_token="t0", eos_token="t1",
                                      additional_special_tokens=[MEDIA_PAD])
        return cls(tokenizer, media_proc_cfg)

    def __call__(self, *args, **kwargs):
        raise NotImplementedError("the tiny kimi model's processor is text only")
