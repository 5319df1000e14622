"""Kimi-K2.5 checkpoint names: which module a tensor belongs to, and its name in transformers.

transformers renames Kimi-K2.5's on-disk tensors when it loads them
(``conversion_mapping.py``, entry ``kimi_k25``); the vision-only loader does the
same for the vision keys alone, so the language model is never read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

# Original-layout names, renamed the way transformers' ``conversion_mapping`` does for kimi_k25.
# The norm/fc pairs shift by one (norm0->norm1, norm1->norm2), so they only apply to a checkpoint
# recognised as original layout: in transformers' layout ``norm1`` already means the first norm.
ORIGINAL_LAYOUT_MARKER = re.compile(r"(^|\.)(wqkv|wo|norm0|mlp\.fc0)\.")
_ORIGINAL_RENAMES = (
    (re.compile(r"^layers\.(\d+)\.norm1\."), r"layers.\1.norm2."),
    (re.compile(r"^layers\.(\d+)\.norm0\."), r"layers.\1.norm1."),
    (re.compile(r"^layers\.(\d+)\.mlp\.fc1\."), r"layers.\1.mlp.fc2."),
    (re.compile(r"^layers\.(\d+)\.mlp\.fc0\."), r"layers.\1.mlp.fc1."),
    (re.compile(r"^layers\.(\d+)\.wo\."), r"layers.\1.attn.proj."),
)
_FUSED_QKV = re.compile(r"^layers\.(\d+)\.wqkv\.(weight|bias)$")
_PROJECTOR_RENAMES = {"proj.0.": "in_proj.", "proj.2.": "out_proj."}


def component_of(key: str, is_full: bool) -> tuple[str, str] | None:
    """Which module a checkpoint key belongs to (and the rest of its name), or None if LM."""
    name = key.removeprefix("model.")
    for component in ("vision_tower", "mm_projector"):
        if name.startswith(component + "."):
            if component == "mm_projector" and not is_full:
                return None
            return component, name[len(component) + 1 :]
    if is_full:
        return None
    return "vision_tower", key  # a standalone Kimi_K25VisionModel: unprefixed names


def strip_encoder(rest: str) -> str:
    """``encoder.blocks.3.wo`` -> ``layers.3.wo``: the original layout nests MoonViT's blocks."""
    rest = rest.removeprefix("encoder.")
    return "layers." + rest[len("blocks.") :] if rest.startswith("blocks.") else rest


def renamed(
    component: str, rest: str, tensor: torch.Tensor, original_layout: bool, num_heads: int
) -> Iterable[tuple[str, torch.Tensor]]:
    """Checkpoint name and tensor -> (module name, tensor) pairs, as transformers' load does."""
    if component == "mm_projector":
        for old, new in _PROJECTOR_RENAMES.items():
            if rest.startswith(old):
                rest = new + rest[len(old) :]
        yield rest, tensor
        return
    rest = strip_encoder(rest)
    if rest == "patch_embed.pos_emb.weight":
        yield "patch_embed.pos_emb.position_embeddings", tensor
        return
    if not original_layout:
        yield rest, tensor
        return
    fused = _FUSED_QKV.match(rest)
    if fused:
        layer, kind = fused.groups()
        query, key, value = torch.chunk(tensor, 3, dim=0)
        yield f"layers.{layer}.attn.q_proj.{kind}", _interleaved_to_half(query, num_heads)
        yield f"layers.{layer}.attn.k_proj.{kind}", _interleaved_to_half(key, num_heads)
        yield f"layers.{layer}.attn.v_proj.{kind}", value.contiguous()
        return
    for pattern, replacement in _ORIGINAL_RENAMES:
        renamed, count = pattern.subn(replacement, rest)
        if count:
            yield renamed, tensor
            return
    yield rest, tensor


def _interleaved_to_half(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Per head, rows (x0,y0,x1,y1,...) -> (x0,x1,...,y0,y1,...): complex RoPE to rotate-half.

    The same permutation as transformers' ``PermuteForRope`` (forward direction).
    """
    rows = tensor.shape[0]
    half = rows // num_heads // 2
    tail = tensor.shape[1:]
    permuted = tensor.reshape(num_heads, half, 2, *tail).transpose(1, 2)
    return permuted.reshape(rows, *tail).contiguous()
