"""Video token estimates equal transformers' video processors' counts.

``Qwen2VLVideoProcessor`` is the class users get for Qwen2-VL, Qwen2.5-VL and both Omni
models (each Omni processor passes its own pixel bounds and patch); it keeps every
frame. ``Qwen3VLVideoProcessor`` (Qwen3-VL) samples 2 frames a second of the stream's
rate and resizes the whole volume at once. Each runs on the frames themselves (and the
rate, for Qwen3-VL); the gate's estimate comes from the frame size, count and rate
alone. End to end, a real video's part carries the count the processor gives for the
frames PyAV decodes from the same bytes.
"""

from __future__ import annotations

import io
import warnings

import av
import numpy as np
import pytest
import transformers
from av_media import make_video
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.video_utils import VideoMetadata

from conftest import body, chat, data_url
from modalgate.policy import RuleMatcher, load_policy, parse_policy
from modalgate.policy.models import TokenSpec
from modalgate.validators import validate_body
from modalgate.validators.video_tokens import estimate_video_tokens

SPEC = TokenSpec(
    family="qwen_smart_resize", patch_size=14, merge_size=2, video_family="qwen2_vl_video"
)
# The Qwen3-Omni processor's video bounds and the vision config's patch.
QWEN3_OMNI_SPEC = SPEC.model_copy(
    update={"patch_size": 16, "video_min_pixels": 128 * 32 * 32, "video_max_pixels": 768 * 32 * 32}
)
QWEN3_VL_SPEC = TokenSpec(
    family="qwen_smart_resize", patch_size=16, merge_size=2, video_family="qwen3_vl_video"
)


@pytest.fixture(scope="module")
def processor():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.Qwen2VLVideoProcessor()


@pytest.fixture(scope="module")
def qwen3_omni_processor():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.Qwen2VLVideoProcessor(
            patch_size=16, size={"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}
        )


@pytest.fixture(scope="module")
def qwen3_vl_processor():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.Qwen3VLVideoProcessor()


def processor_tokens(processor, frames: np.ndarray, fps: float | None = None) -> int:
    metadata = {}
    if fps is not None:
        metadata["video_metadata"] = [VideoMetadata(total_num_frames=len(frames), fps=fps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the per-frame pixel cap notice
        grid = processor(videos=[frames], return_tensors="np", **metadata)["video_grid_thw"][0]
    return int(np.prod(grid)) // (processor.merge_size**2)


@settings(max_examples=120, deadline=None)
@given(
    frames=st.integers(1, 9),
    height=st.integers(16, 2400),
    width=st.integers(16, 2400),
)
def test_the_estimate_equals_the_processors_count(processor, frames, height, width):
    if max(height, width) / min(height, width) > 200:
        return  # refused as an image shape, as the processor refuses it
    video = np.zeros((frames, height, width, 3), np.uint8)
    estimate = estimate_video_tokens(width, height, frames, None, SPEC)
    assert estimate == processor_tokens(processor, video)


@settings(max_examples=60, deadline=None)
@given(
    frames=st.integers(1, 9),
    height=st.integers(16, 2400),
    width=st.integers(16, 2400),
)
def test_the_qwen3_omni_estimate_equals_its_processors_count(
    qwen3_omni_processor, frames, height, width
):
    if max(height, width) / min(height, width) > 200:
        return
    video = np.zeros((frames, height, width, 3), np.uint8)
    estimate = estimate_video_tokens(width, height, frames, None, QWEN3_OMNI_SPEC)
    assert estimate == processor_tokens(qwen3_omni_processor, video)


@settings(max_examples=120, deadline=None)
@given(
    frames=st.integers(2, 40),
    fps=st.sampled_from([1.0, 5.0, 12.0, 24.0, 25.0, 29.97, 60.0]),
    height=st.integers(8, 1800),
    width=st.integers(8, 1800),
)
def test_the_qwen3_vl_estimate_equals_its_processors_count(
    qwen3_vl_processor, frames, fps, height, width
):
    if max(height, width) / min(height, width) > 200:
        return
    video = np.zeros((frames, height, width, 3), np.uint8)
    estimate = estimate_video_tokens(width, height, frames, fps, QWEN3_VL_SPEC)
    assert estimate == processor_tokens(qwen3_vl_processor, video, fps)


def test_qwen3_vl_refuses_a_one_frame_clip_its_processor_would_crash_on(qwen3_vl_processor):
    with pytest.raises(ValueError, match="must be larger than temporal_factor"):
        processor_tokens(qwen3_vl_processor, np.zeros((1, 64, 64, 3), np.uint8), 24.0)
    data = make_video("mp4", frames=1, width=64, height=64)
    part = {"type": "video_url", "video_url": {"url": data_url(data, "video/mp4")}}
    verdict = validate_body(
        body(chat(part, model="Qwen/Qwen3-VL-8B-Instruct")), RuleMatcher(load_policy(), None)
    )
    [violation] = verdict.violations
    at = "messages.[0].content.[0].video_url.url"
    assert (violation.code.value, violation.param) == ("media_too_small", at)
    assert violation.message == f"{at}: video has 1 frame; this model needs at least 2"


@pytest.mark.parametrize(
    ("model", "which"),
    [
        ("Qwen/Qwen2-VL-7B-Instruct", "processor"),
        ("Qwen/Qwen2.5-Omni-7B", "processor"),
        ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "qwen3_omni_processor"),
        ("Qwen/Qwen3-VL-8B-Instruct", "qwen3_vl_processor"),
    ],
)
@pytest.mark.parametrize(("frames", "side", "fps"), [(2, 64, 24), (7, 96, 5), (30, 320, 10)])
def test_a_videos_part_carries_the_processors_count(request, model, which, frames, side, fps):
    data = make_video("mp4", frames=frames, width=side, height=side * 3 // 4, fps=fps)
    part = {"type": "video_url", "video_url": {"url": data_url(data, "video/mp4")}}
    verdict = validate_body(body(chat(part, model=model)), RuleMatcher(load_policy(), None))
    assert verdict.accepted, [v.as_dict() for v in verdict.violations]
    with av.open(io.BytesIO(data)) as container:
        rate = float(container.streams.video[0].average_rate)  # what transformers' loader reads
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert len(decoded) == frames
    expected = processor_tokens(request.getfixturevalue(which), decoded, rate)
    assert verdict.parts[0].tokens == expected


def test_video_tokens_count_in_the_requests_budget():
    data = make_video("mp4", frames=10, width=320, height=240)
    part = {"type": "video_url", "video_url": {"url": data_url(data, "video/mp4")}}
    text = "extends: builtin\nlimits: {max_request_image_tokens: 500}\n"
    matcher = RuleMatcher(parse_policy(text, fmt="yaml"), None)
    verdict = validate_body(body(chat(part, model="Qwen/Qwen2-VL-7B-Instruct")), matcher)
    [violation] = verdict.violations
    at = "messages.[0].content.[0].video_url.url"
    assert (violation.code.value, violation.param) == ("too_many_image_tokens", at)
    assert violation.message == (
        f"{at}: the request's images need 700 vision tokens; the limit is 500 per request"
    )
