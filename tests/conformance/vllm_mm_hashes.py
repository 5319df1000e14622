"""The multimodal cache keys vLLM computes for chat bodies: its own code, end to end.

Runs in ``.venv-conformance``: ``python vllm_mm_hashes.py MODEL_DIR ENGINE_MODEL`` reads a
JSON list of chat bodies on stdin and prints, per body, the ``mm_hashes`` vLLM's processor
keys its processor cache, its encoder cache and its prefix cache on: vLLM's own content-part
parser (``parse_chat_messages``: media decoded, ``uuid`` read as vLLM reads it), its model's
data parser, and ``ProcessorInputs.get_mm_hashes`` (the call ``processor.py`` makes), with
the engine's ``--model`` string and the default BLAKE3 hasher (docs/media_id_census.md §4).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from vllm.config import ModelConfig
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.parse import parse_mm_uuids
from vllm.multimodal.processing.inputs import ProcessorInputs
from vllm.renderers.chat_utils.chat_message import parse_chat_messages


def mm_hashes(body: dict[str, Any], config: ModelConfig, engine_model: str) -> dict[str, list]:
    _, mm_data, mm_uuids = parse_chat_messages(body["messages"], config, content_format="string")
    if not mm_data:
        return {}
    items = MULTIMODAL_REGISTRY.create_processor(config).info.parse_mm_data(mm_data)
    inputs = ProcessorInputs(prompt=[], mm_data_items=items, mm_uuid_items=parse_mm_uuids(mm_uuids))
    return inputs.get_mm_hashes(engine_model, "blake3")


def main() -> None:
    folder, engine_model = sys.argv[1], sys.argv[2]
    config = ModelConfig(model=folder, tokenizer=folder)
    bodies = json.load(sys.stdin)
    print(json.dumps([mm_hashes(body, config, engine_model) for body in bodies]))


if __name__ == "__main__":
    main()
