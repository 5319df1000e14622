"""A Kimi checkpoint directory's preprocessing settings.

The order of trust for settings: the checkpoint's own preprocessor file (the hub's
``media_proc_cfg`` or transformers' processor keys), then the model config,
then ``Kimi_K25ImageProcessor``'s defaults.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from modalgate.encoder_adapter.towers.vision_tower import EncoderLoadError

PREPROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def preprocessor_settings(path: Path, config: Any, vision_config: Any) -> dict[str, Any]:
    """Field by field: checkpoint preprocessor config, then model config, then processor defaults.

    Two preprocessor formats exist: the hub's ``media_proc_cfg`` (in_patch_limit,
    patch_limit_on_one_side, merge_kernel_size, ...) and transformers' ``Kimi_K25ImageProcessor``
    keys (max_patches, size.max_height, merge_size, ...; ``processor_config.json`` nests them
    under ``image_processor``). ``max_side`` counts patches, like ``patch_limit_on_one_side``.
    """
    from transformers import Kimi_K25ImageProcessor

    sources: list[dict[str, Any]] = [_from_processor_file(path)]
    model: dict[str, Any] = {
        "patch_size": vision_config.patch_size,
        "merge_size": _merge_size(vision_config.merge_kernel_size),
    }
    media = getattr(config, "media_proc_cfg", None)
    if isinstance(media, Mapping):
        model = _from_media_proc_cfg(media) | model
    sources.append(model)
    defaults = Kimi_K25ImageProcessor
    sources.append(
        {
            "patch_size": defaults.patch_size,
            "merge_size": defaults.merge_size,
            "max_patches": defaults.max_patches,
            "max_side": defaults.size["max_height"],
            "image_mean": defaults.image_mean,
            "image_std": defaults.image_std,
        }
    )
    settings: dict[str, Any] = {}
    for field in ("patch_size", "merge_size", "max_patches", "max_side", "image_mean", "image_std"):
        value = next(source[field] for source in sources if source.get(field) is not None)
        if field in ("image_mean", "image_std"):
            value = [float(v) for v in (value if isinstance(value, Iterable) else [value] * 3)]
        else:
            value = int(value)
        settings[field] = value
    return settings


def _from_processor_file(path: Path) -> dict[str, Any]:
    """The first preprocessor JSON in the directory, normalised to our field names."""
    for file_name in PREPROCESSOR_FILES:
        file = path / file_name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise EncoderLoadError(f"{file}: not a readable JSON file") from exc
        if not isinstance(data, dict):
            raise EncoderLoadError(f"{file}: not a JSON object")
        if isinstance(data.get("image_processor"), dict):
            data = data["image_processor"]
        if isinstance(data.get("media_proc_cfg"), dict):
            return _from_media_proc_cfg(data["media_proc_cfg"])
        size = data.get("size") if isinstance(data.get("size"), dict) else {}
        return {
            "patch_size": data.get("patch_size"),
            "merge_size": _merge_size(data.get("merge_size")),
            "max_patches": data.get("max_patches"),
            "max_side": size.get("max_height"),
            "image_mean": data.get("image_mean"),
            "image_std": data.get("image_std"),
        }
    return {}


def _from_media_proc_cfg(media: Mapping[str, Any]) -> dict[str, Any]:
    """The hub (remote-code) processor block: Kimi's own names for the same settings."""
    return {
        "patch_size": media.get("patch_size"),
        "merge_size": _merge_size(media.get("merge_kernel_size")),
        "max_patches": media.get("in_patch_limit"),
        "max_side": media.get("patch_limit_on_one_side"),
        "image_mean": media.get("image_mean"),
        "image_std": media.get("image_std"),
    }


def _merge_size(value: Any) -> int | None:
    """``2`` or ``[2, 2]`` -> 2; a non-square kernel has no single merge size."""
    if value is None or isinstance(value, int):
        return value
    values = [int(v) for v in value]
    if len(set(values)) != 1:
        raise EncoderLoadError(f"non-square merge kernel {values} is not supported")
    return values[0]
