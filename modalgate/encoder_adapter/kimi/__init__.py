"""The Kimi (MoonViT) encoder, ``--encoder kimi:DIR``.

``adapter``: the registry's ``kimi`` adapter. ``preprocess``: ``KimiPreprocessor``, equal
to transformers' ``Kimi_K25ImageProcessor``. ``tower``: ``TransformersVisionEncoder``, the
tower (+ projector) loaded vision-only, helped by ``checkpoint`` (preprocessing settings
from the directory) and ``layout`` (checkpoint tensor names to transformers' module names).
Nothing is imported here: torch loads only when a module that needs it does.
"""
