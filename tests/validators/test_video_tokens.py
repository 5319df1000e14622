"""Video token estimates equal transformers' ``Qwen2VLVideoProcessor`` count.

The processor is the class users get for Qwen2-VL and Qwen2.5-VL video, at its class
defaults (every frame kept, frames within 128*28*28..768*28*28 pixels, two frames a
temporal patch); it runs on the frames themselves, and the gate's estimate comes from
the frame size and count alone. End to end, a real video's part carries the count
the processor gives for the frames PyAV decodes from the same bytes.
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

from conftest import body, chat, data_url
from modalgate.policy import RuleMatcher, load_policy, parse_policy
from modalgate.policy.models import TokenSpec
from modalgate.validators import validate_body
from modalgate.validators.video_tokens import estimate_video_tokens

SPEC = TokenSpec(
    family="qwen_smart_resize", patch_size=14, merge_size=2, video_family="qwen2_vl_video"
)


@pytest.fixture(scope="module")
def processor():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.Qwen2VLVideoProcessor()


def processor_tokens(processor, frames: np.ndarray) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the per-frame pixel cap notice
        grid = processor(videos=[frames], return_tensors="np")["video_grid_thw"][0]
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
    assert estimate_video_tokens(width, height, frames, SPEC) == processor_tokens(processor, video)


@pytest.mark.parametrize(("frames", "side"), [(1, 64), (7, 96), (10, 320)])
def test_a_videos_part_carries_the_processors_count(processor, frames, side):
    data = make_video("mp4", frames=frames, width=side, height=side * 3 // 4)
    part = {"type": "video_url", "video_url": {"url": data_url(data, "video/mp4")}}
    verdict = validate_body(
        body(chat(part, model="Qwen/Qwen2-VL-7B-Instruct")), RuleMatcher(load_policy(), None)
    )
    assert verdict.accepted, [v.as_dict() for v in verdict.violations]
    with av.open(io.BytesIO(data)) as container:
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert len(decoded) == frames
    assert verdict.parts[0].tokens == processor_tokens(processor, decoded)


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
