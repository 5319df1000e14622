"""A corpus of real and damaged video and audio, judged by the gate and loaded the way
``transformers serve`` loads it, into the family's processor.

Why not through the server itself: ``transformers serve`` (5.25) cannot load a video on
a machine without torchcodec and FFmpeg's shared libraries, the machine CI gets. Its
video processors fetch with torchcodec (``BaseVideoProcessor.fetch_videos``), and for a
model its chat handler counts as multimodal it loads every video's audio track too
(``load_audio_from_video``), which only torchcodec can decode: every video, whole or
not, is a 500 there. Tried here with torchcodec 0.17 over Debian's FFmpeg 5.1, a silent
video comes back 400 with torchcodec's internal text in the detail. So the corpus goes
through the server's loading instead: every frame decoded by FFmpeg (through PyAV;
torchcodec is FFmpeg's decoders too) and stacked, with the stream's rate, into
``Qwen2VLVideoProcessor`` and ``Qwen3VLVideoProcessor``; audio through transformers'
``load_audio`` (soundfile, then soxr, its path without torchcodec) into Whisper's
feature extractor with each audio processor's own arguments. (transformers' own PyAV
loader, ``load_video(backend="pyav")``, fails every whole MKV and WebM here: it samples
over the container's declared frame count, which Matroska does not declare.)

Each file has one of four outcomes: both take it (``passed``; its token estimate must
equal the processor's), the gate refuses what the loader or processor raises on
(``protected``), the gate refuses what they take (``false_reject``: the gate refuses
every cut-short file, which a loader often decodes in part), or the gate takes what
they raise on (``bypass``: none allowed).
"""

from __future__ import annotations

import io
import os
import random
import struct
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import av
import numpy as np
import pytest
import transformers
from av_media import cut_points, make_audio, make_video
from transformers.audio_utils import load_audio
from transformers.models.qwen3_omni_moe import processing_qwen3_omni_moe
from transformers.video_utils import VideoMetadata

from conftest import b64, body, chat, data_url, noise_png
from media_stubs import PDF_BYTES
from modalgate.policy import RuleMatcher, parse_policy
from modalgate.settings import EngineSpec
from modalgate.validators import validate_body
from modalgate.validators.dialects import Dialect, dialect_for

VIDEO_MIME = {"mp4": "video/mp4", "mov": "video/quicktime", "webm": "video/webm",
              "mkv": "video/x-matroska", "avi": "video/x-msvideo"}  # fmt: skip
AUDIO_MIME = {"wav": "audio/wav", "flac": "audio/flac", "ogg": "audio/ogg", "mp3": "audio/mpeg"}
# soundfile decodes these four; m4a/aac need torchcodec, which this server lacks, so the
# policy for it lists what it can load (as an operator's would).
POLICY = "extends: builtin\nlimits: {audio_formats: [wav, flac, ogg, mp3]}\n"
VIDEO_MODELS = ("Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen3-VL-8B-Instruct")
AUDIO_MODELS = ("Qwen/Qwen2-Audio-7B-Instruct", "Qwen/Qwen3-Omni-30B-A3B-Instruct")


_VLLM = dialect_for(EngineSpec(name="vllm"))  # audio_url parts: vLLM's, not OpenAI's


def vllm_dialect(_rule: object) -> Dialect:
    return _VLLM


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    refused_by: Counter[str] = field(default_factory=Counter)
    bypasses: list[str] = field(default_factory=list)
    whole: Counter[str] = field(default_factory=Counter)  # the uncut files' outcomes
    off_by: Counter[int] = field(default_factory=Counter)  # damaged files' estimate misses
    wrong_counts: list[str] = field(default_factory=list)

    def render(self, title: str) -> str:
        codes = ", ".join(f"{code} {n}" for code, n in sorted(self.refused_by.items()))
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(self.outcomes.items()))
        misses = ", ".join(f"{n} off by {d}" for d, n in sorted(self.off_by.items())) or "none"
        return (
            f"{title}: {sum(self.outcomes.values())} judgements: {kinds}; refused: {codes};"
            f" estimates of damaged files passed: {misses}"
        )


def damaged(whole: bytes, seed: int) -> Iterator[tuple[str, bytes]]:
    """``whole``, cut at every boundary, with bytes flipped, followed by another file,
    and its length fields lied about."""
    rng = random.Random(seed)
    yield "whole", whole
    for cut in cut_points(whole)[::2]:
        yield f"cut@{cut}", whole[:cut]
    for n in range(12):
        flipped = bytearray(whole)
        for at in rng.sample(range(len(whole)), 1 + n * 3):
            flipped[at] ^= 1 << rng.randrange(8)
        yield f"flipped#{n}", bytes(flipped)
    yield "zip after", whole + b"PK\x03\x04" + bytes(64)
    for n in range(6):
        lied = bytearray(whole)
        at = rng.randrange(0, max(1, len(whole) - 4))
        struct.pack_into(">I", lied, at, rng.choice([0, 1, 0x7FFFFFFF, 0xFFFFFFFF]))
        yield f"length lie#{n}", bytes(lied)


def foreign(seed: int) -> Iterator[tuple[str, bytes]]:
    rng = random.Random(seed)
    yield "random", rng.randbytes(600)
    yield "png", noise_png(32, 32, seed)
    yield "pdf", PDF_BYTES
    yield "empty", b""


def video_corpus() -> Iterator[tuple[str, str, bytes]]:
    for n, fmt in enumerate(VIDEO_MIME):
        for frames, side in ((1, 32), (9, 64)):
            whole = make_video(fmt, frames=frames, width=side, height=side * 3 // 4, seed=n)
            for name, data in damaged(whole, n * 10 + frames):
                yield f"{fmt}/{frames}f/{name}", VIDEO_MIME[fmt], data
    for name, data in foreign(1):
        yield f"foreign/{name}", "video/mp4", data


def audio_corpus() -> Iterator[tuple[str, str, bytes]]:
    for n, fmt in enumerate(AUDIO_MIME):
        for seconds in (0.01, 0.7):
            whole = make_audio(fmt, seconds=seconds, tone_hz=300.0 + 100 * n)
            for name, data in damaged(whole, n * 10 + int(seconds * 10)):
                yield f"{fmt}/{seconds}s/{name}", fmt, data
    for name, data in foreign(2):
        yield f"foreign/{name}", "wav", data


def on_disk(data: bytes, suffix: str) -> Iterator[str]:
    fd, path = tempfile.mkstemp(suffix=suffix)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    try:
        yield path
    finally:
        os.unlink(path)


def quietly(run: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run()


def load_every_frame(data: bytes) -> tuple[np.ndarray, VideoMetadata]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        fps = float(stream.average_rate or stream.guessed_rate or 24)
    return np.stack(frames), VideoMetadata(total_num_frames=len(frames), fps=fps)


def video_tokens_served(processor: Any, data: bytes) -> int:
    """What the server's path makes of ``data``: raises where it would."""
    video, metadata = load_every_frame(data)
    grid = quietly(
        lambda: processor(videos=[video], video_metadata=[metadata], return_tensors="np")
    )["video_grid_thw"][0]
    return int(np.prod(grid)) // processor.merge_size**2


def audio_tokens_served(extractor: Any, kwargs: dict[str, Any], data: bytes, fmt: str) -> int:
    for path in on_disk(data, "." + fmt):
        samples = load_audio(path, sampling_rate=16_000, backend="soundfile")
        features = extractor(samples, sampling_rate=16_000, **kwargs)
        length = int(np.sum(features["attention_mask"]))
        if kwargs.get("truncation") is False:  # Qwen3-Omni's formula
            return int(processing_qwen3_omni_moe._get_feat_extract_output_lengths(length))
        return ((length - 1) // 2 + 1 - 2) // 2 + 1  # Qwen2-Audio's, Qwen2.5-Omni's
    raise AssertionError("unreachable")


def judge(tally: Tally, name: str, raw: bytes, matcher: RuleMatcher, served: Callable[[], int]):
    verdict = validate_body(raw, matcher, dialect=vllm_dialect)
    try:
        tokens, server_error = served(), None
    except Exception as exc:
        tokens, server_error = None, exc
    outcome = "bypass" if verdict.accepted else "false_reject"
    if server_error is not None and not verdict.accepted:
        outcome = "protected"
    elif server_error is None and verdict.accepted:
        outcome = "passed"
    if name.endswith("/whole"):
        tally.whole[outcome] += 1
    if outcome == "passed":
        tally.outcomes["passed"] += 1
        estimate = verdict.parts[0].tokens
        assert estimate is not None and tokens is not None
        if name.endswith("/whole") and estimate != tokens:
            tally.wrong_counts.append(f"{name}: gate {estimate}, processor {tokens}")
        elif estimate != tokens:  # damaged, yet whole enough for both: decoders may differ
            tally.off_by[abs(estimate - tokens)] += 1
        return
    if verdict.accepted:
        tally.outcomes["bypass"] += 1
        tally.bypasses.append(f"{name}: {type(server_error).__name__}: {server_error}"[:300])
        return
    tally.refused_by[verdict.violations[0].code.value] += 1
    tally.outcomes["protected" if server_error is not None else "false_reject"] += 1


@pytest.fixture(scope="module")
def matcher() -> RuleMatcher:
    return RuleMatcher(parse_policy(POLICY, fmt="yaml"), None)


def test_no_video_the_gate_takes_breaks_the_servers_loader_or_processor(matcher):
    processors = quietly(
        lambda: {
            VIDEO_MODELS[0]: transformers.Qwen2VLVideoProcessor(),
            VIDEO_MODELS[1]: transformers.Qwen3VLVideoProcessor(cap_pixels_per_frame=False),
        }
    )
    tally = Tally()
    for name, mime, data in video_corpus():
        part = {"type": "video_url", "video_url": {"url": data_url(data, mime)}}
        for model, processor in processors.items():
            raw = body(chat(part, model=model))
            served = lambda p=processor, d=data: video_tokens_served(p, d)  # noqa: E731
            judge(tally, f"{model} {name}", raw, matcher, served)
    print("\n" + tally.render("video"))
    assert tally.bypasses == []
    assert tally.wrong_counts == []
    assert not tally.off_by  # FFmpeg decodes for both
    # Whole files: five formats, two sizes, two models; Qwen3-VL's processor raises on
    # the one-frame clips, which the gate refuses.
    assert tally.whole == Counter(passed=15, protected=5)
    assert tally.refused_by["media_too_small"] >= 5


def test_no_audio_the_gate_takes_breaks_the_servers_loader_or_extractor(matcher):
    extractor = transformers.WhisperFeatureExtractor()
    qwen3 = dict(processing_qwen3_omni_moe.Qwen3OmniMoeProcessor.audio_kwargs)
    qwen3.pop("sampling_rate")
    qwen2 = {"padding": "max_length", "return_attention_mask": True}  # Qwen2AudioProcessor's
    kwargs = {AUDIO_MODELS[0]: qwen2, AUDIO_MODELS[1]: qwen3}
    tally = Tally()
    for name, fmt, data in audio_corpus():
        if fmt in ("wav", "mp3"):
            part = {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}
        else:
            part = {"type": "audio_url", "audio_url": {"url": data_url(data, AUDIO_MIME[fmt])}}
        for model, model_kwargs in kwargs.items():
            raw = body(chat(part, model=model))
            served = lambda k=model_kwargs, d=data, f=fmt: audio_tokens_served(extractor, k, d, f)  # noqa: E731
            judge(tally, f"{model} {name}", raw, matcher, served)
    print("\n" + tally.render("audio"))
    assert tally.bypasses == []
    assert tally.wrong_counts == []
    assert (
        tally.outcomes["passed"] >= 4 * 2 + 4
    )  # the whole files (10 ms is too short for Qwen3-Omni)
