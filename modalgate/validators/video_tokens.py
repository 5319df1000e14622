"""Vision tokens of a video from its frame size, counted frames and frame rate alone.

Two processors of transformers, each at its class defaults:

- ``Qwen2VLVideoProcessor`` (Qwen2-VL, Qwen2.5-VL, and the Omni models, whose
  processors pass their own pixel bounds): every frame kept (``do_sample_frames``
  off), each resized with the image's ``smart_resize`` within the video's pixel
  bounds, the count padded to a multiple of the temporal patch, one token per merged
  patch of each frame pair.
- ``Qwen3VLVideoProcessor`` (Qwen3-VL): frames sampled at 2 per second of the
  stream's average rate (at least 4, at most 768 and the frame count), then one
  ``smart_resize`` over the whole volume (frames x height x width within the pixel
  bounds), without the per-frame cap (``cap_pixels_per_frame`` unset, as it is by
  default in 5.25). It refuses a clip that samples fewer frames than the temporal
  patch, so the policy's ``min_video_frames`` refuses it first.

Both are checked against the processors on real frames in
``tests/validators/test_video_tokens.py``. A server that samples frames itself (vLLM's
loaders: ``num_frames``, ``fps``) writes fewer: the estimate is then an upper bound.
"""

from __future__ import annotations

from collections.abc import Callable

from modalgate.policy.models import TokenSpec
from modalgate.validators.tokens import (
    TokenEstimateError,
    qwen_smart_resize_tokens,
    volume_smart_resize,
)

# Qwen2VLVideoProcessor's class defaults.
QWEN_VIDEO_MIN_PIXELS = 128 * 28 * 28
QWEN_VIDEO_MAX_PIXELS = 768 * 28 * 28
QWEN_TEMPORAL_PATCH = 2
# Qwen3VLVideoProcessor's class defaults.
QWEN3_VIDEO_MIN_PIXELS = 128 * 32 * 32
QWEN3_VIDEO_MAX_PIXELS = 768 * 32 * 32
QWEN3_SAMPLE_FPS = 2
QWEN3_MIN_FRAMES, QWEN3_MAX_FRAMES = 4, 768
QWEN3_UNKNOWN_RATE = 24  # what the processor assumes when the stream gives none


def qwen2_vl_video_tokens(
    width: int, height: int, frames: int, frame_rate: float | None, spec: TokenSpec
) -> int:
    frame_spec = spec.model_copy(
        update={
            "min_pixels": spec.video_min_pixels or QWEN_VIDEO_MIN_PIXELS,
            "max_pixels": spec.video_max_pixels or QWEN_VIDEO_MAX_PIXELS,
        }
    )
    temporal = spec.temporal_patch_size or QWEN_TEMPORAL_PATCH
    return -(-frames // temporal) * qwen_smart_resize_tokens(width, height, frame_spec)


def qwen3_vl_sampled_frames(frames: int, frame_rate: float | None) -> int:
    """``Qwen3VLVideoProcessor.sample_frames``' count at its default 2 fps."""
    wanted = int(frames / (frame_rate or QWEN3_UNKNOWN_RATE) * QWEN3_SAMPLE_FPS)
    return min(max(wanted, QWEN3_MIN_FRAMES), QWEN3_MAX_FRAMES, frames)


def qwen3_vl_video_tokens(
    width: int, height: int, frames: int, frame_rate: float | None, spec: TokenSpec
) -> int:
    temporal = spec.temporal_patch_size or QWEN_TEMPORAL_PATCH
    sampled = qwen3_vl_sampled_frames(frames, frame_rate)
    if sampled < temporal:
        raise TokenEstimateError(f"the video needs at least {temporal} frames")
    patch, merge = spec.patch_size or 16, spec.merge_size or 2
    factor = patch * merge
    min_pixels = spec.video_min_pixels or QWEN3_VIDEO_MIN_PIXELS
    max_pixels = spec.video_max_pixels or QWEN3_VIDEO_MAX_PIXELS
    h_bar, w_bar = volume_smart_resize(
        height, width, sampled, temporal, factor, min_pixels, max_pixels, "video"
    )
    return -(-sampled // temporal) * (h_bar // factor) * (w_bar // factor)


VideoEstimator = Callable[[int, int, int, float | None, TokenSpec], int]
VIDEO_ESTIMATORS: dict[str, VideoEstimator] = {
    "qwen2_vl_video": qwen2_vl_video_tokens,
    "qwen3_vl_video": qwen3_vl_video_tokens,
}


def estimate_video_tokens(
    width: int, height: int, frames: int, frame_rate: float | None, spec: TokenSpec
) -> int | None:
    """The spec's video family's estimate, or ``None`` where it names none."""
    estimator = VIDEO_ESTIMATORS.get(spec.video_family or "")
    return None if estimator is None else estimator(width, height, frames, frame_rate, spec)
