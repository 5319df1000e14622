"""Kept for Serve config files written before the move: ``import_path:
modalgate.encoder_adapter.ray_serve:app_builder`` (what ``--print-config`` wrote, and what
docs/scale.md showed) still builds the pool. A thin re-export; new files name
``modalgate.encoder_adapter.ray.serve:app_builder``.
"""

from modalgate.encoder_adapter.ray.serve import app_builder

__all__ = ["app_builder"]
