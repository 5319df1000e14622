"""Vision tokens of a video from its frame size and its counted frames alone.

Qwen2-VL's and Qwen2.5-VL's video processor (transformers ``Qwen2VLVideoProcessor``,
class defaults: every frame kept, ``do_sample_frames`` off) resizes each frame with the
image's ``smart_resize`` within the video's own pixel bounds, pads the frame count to
a multiple of the temporal patch, and writes one token per merged patch of each
frame pair. Checked against the processor on real frames in
``tests/validators/test_video_tokens.py``. A server that samples frames itself (vLLM's
loaders: ``num_frames``, ``fps``) writes fewer: the estimate is then an upper bound.
"""

from __future__ import annotations

from collections.abc import Callable

from modalgate.policy.models import TokenSpec
from modalgate.validators.tokens import qwen_smart_resize_tokens

# Qwen2VLVideoProcessor's class defaults.
QWEN_VIDEO_MIN_PIXELS = 128 * 28 * 28
QWEN_VIDEO_MAX_PIXELS = 768 * 28 * 28
QWEN_TEMPORAL_PATCH = 2


def qwen2_vl_video_tokens(width: int, height: int, frames: int, spec: TokenSpec) -> int:
    frame_spec = spec.model_copy(
        update={
            "min_pixels": spec.video_min_pixels or QWEN_VIDEO_MIN_PIXELS,
            "max_pixels": spec.video_max_pixels or QWEN_VIDEO_MAX_PIXELS,
        }
    )
    temporal = spec.temporal_patch_size or QWEN_TEMPORAL_PATCH
    return -(-frames // temporal) * qwen_smart_resize_tokens(width, height, frame_spec)


VideoEstimator = Callable[[int, int, int, TokenSpec], int]
VIDEO_ESTIMATORS: dict[str, VideoEstimator] = {"qwen2_vl_video": qwen2_vl_video_tokens}


def estimate_video_tokens(width: int, height: int, frames: int, spec: TokenSpec) -> int | None:
    """The spec's video family's estimate, or ``None`` where it names none."""
    estimator = VIDEO_ESTIMATORS.get(spec.video_family or "")
    return None if estimator is None else estimator(width, height, frames, spec)
