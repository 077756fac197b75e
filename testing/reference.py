"""The independent reference of the GPU suite: HF transformers' forward of the same weights
in float32, and the relative error of a dumped tensor against it.

Layer id k < N is ``output_hidden_states[k]`` (the residual stream entering decoder layer
k; 0 = the embeddings); id N is the input of the final norm, taken by a forward pre-hook on
``model.model.norm`` (HF's last ``hidden_states`` entry is after the norm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple


class Reference:
    """HF forward in float32: ``ref(ids, layer_ids) -> [T, L, H] float32 CPU tensor``.

    ``path``: an HF model directory; ``device``: where the forward runs ("cuda" in the GPU
    suite, "cpu" in the CPU check of this class)."""

    def __init__(self, path: str, device: str = "cuda"):
        import torch
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        self.num_layers = self.model.config.num_hidden_layers
        self.hidden_size = self.model.config.hidden_size
        self._pre_norm = None
        self._hook = self.model.model.norm.register_forward_pre_hook(self._grab)

    def _grab(self, module, args):
        self._pre_norm = args[0].detach()

    def __call__(self, ids: Sequence[int], layer_ids: Sequence[int]):
        import torch

        with torch.no_grad():
            out = self.model(torch.tensor([list(ids)], device=self.device), output_hidden_states=True)
        slots = [self._pre_norm[0] if k == self.num_layers else out.hidden_states[k][0]
                 for k in layer_ids]
        return torch.stack(slots, dim=1).float().cpu()  # [T, L, H]

    def to_dtype(self, dtype) -> None:
        """Cast the model's parameters (e.g. to ``torch.bfloat16``: HF's own bf16 forward of
        the same weights, the scale of bf16 rounding through this model's depth); the blocks
        returned stay float32.

        Buffers keep their dtype: the rotary embedding's ``inv_freq`` stays float32, as
        ``from_pretrained(dtype=torch.bfloat16)`` leaves it and as SGLang and vLLM compute
        the rope angles. ``model.to(dtype)`` would round it to bf16 too, which turns the
        angle at position p by up to p x 2^-9 rad per unit frequency: on a 4096-wide,
        head-dim-128 Llama that alone made HF's bf16 forward 8-12% off float32 after one to
        three layers at 512 tokens, against 1.3-2% with the buffers kept."""
        for p in self.model.parameters():
            p.data = p.data.to(dtype)

    def close(self) -> None:
        """Drop the model (frees its device memory once nothing else holds it)."""
        self._hook.remove()
        del self.model


@dataclass(frozen=True)
class RelError:
    """``block``: ||got - ref|| / ||ref|| over the whole [T, L, H] block; ``token``: the
    largest per-row error ||got[t, l] - ref[t, l]|| / ||ref[t, l]||; ``at``: its
    (token row, layer slot); ``slots``: per layer slot l, ||got[:, l] - ref[:, l]|| /
    ||ref[:, l]|| (where along the depth two forwards part)."""

    block: float
    token: float
    at: Tuple[int, int]
    slots: Tuple[float, ...] = ()


def rel_errors(got, ref) -> RelError:
    """Relative errors of ``got`` (any float dtype) against ``ref`` (float32), both
    [T, L, H]. Raises ValueError when the shapes differ."""
    if tuple(got.shape) != tuple(ref.shape):
        raise ValueError(f"shape {tuple(got.shape)} != reference shape {tuple(ref.shape)}")
    got, ref = got.float(), ref.float()
    diff = got - ref
    block = (diff.norm() / ref.norm()).item()
    rows = diff.norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)  # [T, L]
    flat = int(rows.argmax())
    slots = diff.norm(dim=(0, 2)) / ref.norm(dim=(0, 2)).clamp_min(1e-12)  # [L]
    return RelError(block, rows.max().item(), divmod(flat, rows.shape[1]), tuple(slots.tolist()))


class VLMReference:
    """HF's float32 forward of a vision-language model (Qwen2.5-VL) on a chat with images:
    ``ref(messages, layer_ids) -> (input_ids, [T, L, H] float32 CPU tensor)``.

    ``messages``: HF's chat format, image parts ``{"type": "image", "image": PIL.Image}``.
    HF's processor (the model directory's: chat template, image processor) makes
    ``input_ids`` (each image placeholder expanded to one image token per merged vision
    token), ``pixel_values`` and ``image_grid_thw``; the forward runs on exactly those, so
    the image rows are the language model's residual stream over the vision tower's merged
    embeddings. Layer id k is ``output_hidden_states[k]`` of the language model (ids below
    its layer count only)."""

    def __init__(self, path: str, device: str = "cuda"):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.device = device
        self.processor = AutoProcessor.from_pretrained(path)
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).to(device).eval()
        config = self.model.config
        self.num_layers = getattr(config, "text_config", config).num_hidden_layers

    def inputs(self, messages):
        """HF's processor output for ``messages`` (generation prompt added), on the device."""
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True, return_tensors="pt").to(self.device)

    def __call__(self, messages, layer_ids: Sequence[int]):
        import torch

        if any(k >= self.num_layers for k in layer_ids):
            raise ValueError(f"layer ids {list(layer_ids)}: the reference gives ids below {self.num_layers}")
        inputs = self.inputs(messages)
        with torch.no_grad():
            out = self.model(**inputs, output_hidden_states=True)
        block = torch.stack([out.hidden_states[k][0] for k in layer_ids], dim=1).float().cpu()
        return inputs["input_ids"][0].tolist(), block  # ids [T], block [T, L, H]

    def close(self) -> None:
        del self.model
