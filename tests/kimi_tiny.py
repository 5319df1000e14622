"""Tiny real Kimi-K2.5 models for tests: configs small enough to build and run in seconds.

Shared by the encoder tests; every model is a real transformers class built from a
config (seeded) and saved with ``save_pretrained``: nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    Kimi_K25Config,
    Kimi_K25ForConditionalGeneration,
    Kimi_K25ImageProcessor,
    Kimi_K25VisionConfig,
)

VISION_HIDDEN = 32
TEXT_HIDDEN = 48
# Pixel sizes giving different grids, one resized by the processor's max_side (24 patches).
IMAGE_SIZES = [(60, 45), (30, 100), (28, 28), (500, 120)]


def vision_config() -> Kimi_K25VisionConfig:
    return Kimi_K25VisionConfig(
        num_hidden_layers=2,
        hidden_size=VISION_HIDDEN,
        intermediate_size=64,
        num_attention_heads=2,
        pos_emb_height=8,
        pos_emb_width=8,
    )


def full_config() -> Kimi_K25Config:
    """A tiny Kimi-K2.5: MoonViT + projector + a two-layer DeepSeek-V3 MoE text model."""
    text = {
        "model_type": "deepseek_v3",
        "vocab_size": 128,
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "n_group": 1,
        "topk_group": 1,
    }
    return Kimi_K25Config(
        text_config=text,
        vision_config=vision_config().to_dict(),
        projection_hidden_size=VISION_HIDDEN,
    )


def processor() -> Kimi_K25ImageProcessor:
    return Kimi_K25ImageProcessor(max_patches=400, size={"max_height": 24, "max_width": 24})


def images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        for height, width in IMAGE_SIZES
    ]


def preprocess(items: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = processor()(items, return_tensors="pt")
    return batch["pixel_values"], batch["image_grid_thw"]


def save_full_checkpoint(directory: Path) -> Kimi_K25ForConditionalGeneration:
    """A sharded tiny full checkpoint (tower, projector, language model) and its processor."""
    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration(full_config()).eval()
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="20KB")
    processor().save_pretrained(directory)
    return model
