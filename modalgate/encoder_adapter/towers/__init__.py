"""What every in-process encoder shares, whatever the model family.

``local_adapter``: the pipeline around a model (cache, decode pool, micro-batcher,
per-image failure isolation), no torch. ``vision_tower``: a transformers vision tower
loaded vision-only (device, dtype, batched forward, shard map, state checks).
The families (``kimi/``, ``qwen/``) build on both. Nothing is imported here, so
importing one module never loads torch for the other.
"""
