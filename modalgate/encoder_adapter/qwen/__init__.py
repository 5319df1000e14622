"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL encoder, ``--encoder qwen:DIR``.

``adapter``: the registry's ``qwen`` adapter (transformers' image processor, batched).
``tower``: ``QwenVisionEncoder``, the tower (+ merger) loaded vision-only.
Nothing is imported here: torch loads only when a module that needs it does.
"""
