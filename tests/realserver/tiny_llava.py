"""A tiny random-weight LLaVA that ``transformers serve`` runs on one core: the second family.

``LlavaForConditionalGeneration`` from a config (seeded): a one-layer CLIP vision tower
at 56 px, patch 14 (16 image tokens), and a one-layer Llama; its real ``LlavaProcessor``
with a ``CLIPImageProcessor``, and a byte-level BPE tokenizer trained here with an
``<image>`` special token and a chat template that emits it for image parts. Everything
is ``save_pretrained`` into a folder the server loads as a user's checkpoint; nothing
is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

from realserver.tiny_vlm import byte_level_tokenizer

LLAVA_SPECIAL = ["<unk>", "<s>", "</s>", "<image>"]
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}<image>\n"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
IMAGE_SIDE, PATCH = 56, 14
IMAGE_TOKENS = (IMAGE_SIDE // PATCH) ** 2


def build_llava(folder: Path) -> Path:
    """A LLaVA of ~0.05 M parameters with its real ``LlavaProcessor``."""
    torch.manual_seed(0)
    raw = byte_level_tokenizer(LLAVA_SPECIAL)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
        additional_special_tokens=["<image>"],
    )
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    ids = {name: raw.token_to_id(name) for name in LLAVA_SPECIAL}
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=IMAGE_SIDE,
            patch_size=PATCH,
            projection_dim=32,
        ),
        text_config=LlamaConfig(
            vocab_size=raw.get_vocab_size(),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            bos_token_id=ids["<s>"],
            eos_token_id=ids["</s>"],
            pad_token_id=ids["<unk>"],
        ),
        image_token_id=ids["<image>"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_seq_length=IMAGE_TOKENS,
    )
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.max_new_tokens = 8
    model.generation_config.eos_token_id = ids["</s>"]
    model.generation_config.pad_token_id = ids["<unk>"]
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIDE},
            crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE},
        ),
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS, dropped by the "default" strategy
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    import sys

    print(build_llava(Path(sys.argv[1])))
