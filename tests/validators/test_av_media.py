"""Video and audio parts checked as deeply as images: real files made here with PyAV.

Every container the built-in policy takes is accepted whole and refused cut at every
structural boundary (and at byte strides between them), inflated, mislabelled,
followed by another file, or over a rule's limits; random bytes and bare headers
never pass as video or audio. A property test holds that what the gate accepts
PyAV decodes to its last frame.
"""

from __future__ import annotations

import io
import os
import struct

import av
import pytest
from av_media import AUDIO_KINDS, VIDEO_KINDS, cut_points, decode_all, make_audio, make_video
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import b64, body, chat, data_url, noise_png
from media_stubs import PDF_BYTES
from modalgate.errors import ErrorCode
from modalgate.media import av_probe
from modalgate.media.inline_work import InlineWorkExceeded, run_within
from modalgate.policy import RuleMatcher, load_policy, parse_policy
from modalgate.settings import EngineSpec
from modalgate.validators import validate_body
from modalgate.validators.dialects import Dialect, dialect_for

VIDEO_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
AUDIO_MODEL = "Qwen/Qwen2.5-Omni-7B"
VIDEO_AT = "messages.[0].content.[0].video_url.url"
AUDIO_AT = "messages.[0].content.[0].input_audio.data"
FORMAT_AT = "messages.[0].content.[0].input_audio.format"
MIME = {"mp4": "video/mp4", "mov": "video/quicktime", "webm": "video/webm",
        "mkv": "video/x-matroska", "avi": "video/x-msvideo", "ts": "video/mp2t"}  # fmt: skip
# Built-in video formats (ts is off by default: a policy turns it on).
DEFAULT_VIDEO = ("mp4", "mov", "webm", "mkv", "avi")
AUDIO_MIME = {"flac": "audio/flac", "ogg": "audio/ogg", "m4a": "audio/mp4"}
_VLLM = dialect_for(EngineSpec(name="vllm"))


def VLLM_DIALECT(_rule: object) -> Dialect:
    return _VLLM


@pytest.fixture(scope="module")
def matcher() -> RuleMatcher:
    return RuleMatcher(load_policy(), None)


@pytest.fixture(scope="module")
def videos() -> dict[str, bytes]:
    return {fmt: make_video(fmt) for fmt in VIDEO_KINDS}


@pytest.fixture(scope="module")
def audios() -> dict[str, bytes]:
    return {fmt: make_audio(fmt) for fmt in AUDIO_KINDS}


def video_request(data: bytes, mime: str = "video/mp4", model: str = VIDEO_MODEL) -> bytes:
    part = {"type": "video_url", "video_url": {"url": data_url(data, mime)}}
    return body(chat(part, model=model))


def audio_request(data: bytes, fmt: str = "wav", model: str = AUDIO_MODEL) -> bytes:
    """``input_audio`` where its ``format`` may say so (OpenAI's: wav and mp3), else
    vLLM's ``audio_url`` with a data URL of the format's MIME type."""
    if fmt not in ("wav", "mp3"):
        part = {"type": "audio_url", "audio_url": {"url": data_url(data, AUDIO_MIME[fmt])}}
        return body(chat(part, model=model))
    part = {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}
    return body(chat(part, model=model))


def refusal(raw: bytes, matcher: RuleMatcher) -> tuple[ErrorCode, str | None, str]:
    verdict = validate_body(raw, matcher)
    assert not verdict.accepted, "accepted"
    assert verdict.status == 400
    [violation] = verdict.violations
    return violation.code, violation.param, violation.message


def policy_with(limits: str) -> RuleMatcher:
    text = f"extends: builtin\nlimits: {{{limits}}}\n"
    return RuleMatcher(parse_policy(text, fmt="yaml"), None)


# ---------------------------------------------------------------- whole files


@pytest.mark.parametrize("fmt", DEFAULT_VIDEO)
def test_a_whole_video_is_accepted_with_its_facts(fmt, videos, matcher):
    verdict = validate_body(video_request(videos[fmt], MIME[fmt]), matcher)
    assert verdict.accepted, [v.as_dict() for v in verdict.violations]
    [part] = verdict.parts
    assert (part.modality, part.format, part.width, part.height) == ("video", fmt, 64, 48)
    assert part.frames == 10
    assert part.seconds == pytest.approx(1.0)


@pytest.mark.parametrize("fmt", sorted(AUDIO_KINDS))
def test_a_whole_audio_file_is_accepted_with_its_length(fmt, audios, matcher):
    verdict = validate_body(audio_request(audios[fmt], fmt), matcher, dialect=VLLM_DIALECT)
    assert verdict.accepted, [v.as_dict() for v in verdict.violations]
    [part] = verdict.parts
    assert (part.modality, part.format) == ("audio", fmt)
    assert part.seconds == pytest.approx(1.0, abs=0.05)


def test_transport_streams_are_taken_where_the_policy_lists_them(videos):
    refused = refusal(video_request(videos["ts"], MIME["ts"]), RuleMatcher(load_policy(), None))
    assert refused[:2] == (ErrorCode.UNSUPPORTED_MEDIA_FORMAT, VIDEO_AT)
    listed = policy_with('video_formats: [mp4, ts], video_codecs: ["mpeg2video"]')
    assert validate_body(video_request(videos["ts"], MIME["ts"]), listed).accepted


# ---------------------------------------------------------------- what is not video or audio


@pytest.mark.parametrize(
    ("data", "mime", "message"),
    [
        (os.urandom(500), "video/mp4", "the data is not a video file of a known format"),
        (b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2" + bytes(400), "video/mp4",
         "the MP4 video is not whole: it has no movie header (moov box)"),
        (b"\x1a\x45\xdf\xa3" + bytes(300), "video/x-matroska",
         "the MKV video is not whole: it is cut short (inside an element header)"),
    ],
)  # fmt: skip
def test_random_bytes_and_bare_headers_are_not_video(data, mime, message, matcher):
    code, param, text = refusal(video_request(data, mime), matcher)
    assert (code, param) == (ErrorCode.INVALID_MEDIA, VIDEO_AT)
    assert text == f"{VIDEO_AT}: {message}"


def test_random_bytes_and_a_bare_wav_header_are_not_audio(matcher):
    code, param, text = refusal(audio_request(os.urandom(400)), matcher)
    assert (code, param) == (ErrorCode.INVALID_MEDIA, AUDIO_AT)
    assert text == f"{AUDIO_AT}: the data is not an audio file of a known format"
    header = b"RIFF" + struct.pack("<I", 36) + b"WAVE" + bytes(32)
    code, param, text = refusal(audio_request(header), matcher)
    assert (code, param) == (ErrorCode.INVALID_MEDIA, AUDIO_AT)
    assert text == f"{AUDIO_AT}: the data cannot be read as WAV audio (damaged or cut short)"


@pytest.mark.parametrize(
    ("data", "kind"),
    [(noise_png(32, 32, 0), "an image (PNG)"), (PDF_BYTES, "a document (PDF)")],
)
def test_an_image_or_a_document_sent_as_video_is_a_mismatch(data, kind, matcher):
    code, param, text = refusal(video_request(data), matcher)
    assert (code, param) == (ErrorCode.MODALITY_MISMATCH, VIDEO_AT)
    assert text == f"{VIDEO_AT}: declared as video but the data is {kind}"


def test_a_video_sent_as_audio_is_a_mismatch(videos, matcher):
    code, param, _ = refusal(audio_request(videos["mp4"]), matcher)
    assert (code, param) == (ErrorCode.MODALITY_MISMATCH, AUDIO_AT)


# ---------------------------------------------------------------- the claimed format


def test_input_audio_format_is_held_to_the_bytes(audios, matcher):
    code, param, text = refusal(audio_request(audios["wav"], "mp3"), matcher)
    assert (code, param) == (ErrorCode.MODALITY_MISMATCH, FORMAT_AT)
    assert text == f"{FORMAT_AT}: the format is given as 'mp3' but the data is WAV"


def test_the_data_urls_mime_type_is_held_to_the_bytes(videos, matcher):
    code, param, text = refusal(video_request(videos["mp4"], "video/webm"), matcher)
    assert (code, param) == (ErrorCode.MODALITY_MISMATCH, VIDEO_AT)
    assert text == f"{VIDEO_AT}: the format is given as 'video/webm' but the data is MP4"
    # Names of one container family, and types nobody registered, are not held against it.
    for mime in ("video/quicktime", "application/octet-stream", "video/x-unknown"):
        assert validate_body(video_request(videos["mp4"], mime), matcher).accepted, mime


# ---------------------------------------------------------------- cut short, everywhere


@pytest.mark.parametrize("fmt", DEFAULT_VIDEO)
def test_a_video_cut_anywhere_is_refused(fmt, videos, matcher):
    data = videos[fmt]
    accepted = [
        cut
        for cut in cut_points(data)
        if validate_body(video_request(data[:cut], MIME[fmt]), matcher).accepted
    ]
    assert accepted == []
    code, param, _ = refusal(video_request(data[: len(data) // 2], MIME[fmt]), matcher)
    assert (code, param) == (ErrorCode.INVALID_MEDIA, VIDEO_AT)


@pytest.mark.parametrize("fmt", ["wav", "flac", "ogg", "m4a"])
def test_an_audio_file_cut_anywhere_is_refused(fmt, audios, matcher):
    data = audios[fmt]
    accepted = [
        cut
        for cut in cut_points(data)
        if validate_body(audio_request(data[:cut], fmt), matcher, dialect=VLLM_DIALECT).accepted
    ]
    assert accepted == []


def test_an_mp3_cut_between_frames_or_inside_one_is_refused(audios, matcher):
    """MP3 is a bare stream of frames, but LAME's Info frame declares how many: cut
    between two frames, it holds less than it says; cut inside one, its last frame is
    decoded and fails."""
    data = audios["mp3"]
    with av.open(io.BytesIO(data)) as container:
        frame = [packet.pos for packet in container.demux() if packet.size][20]
    code, param, text = refusal(audio_request(data[:frame], "mp3"), matcher)
    assert (code, param, text) == (
        ErrorCode.INVALID_MEDIA,
        AUDIO_AT,
        f"{AUDIO_AT}: the audio declares 1.000 s but holds 0.522 s (cut short, or its"
        " duration is false)",
    )
    code, param, _ = refusal(audio_request(data[: frame + 40], "mp3"), matcher)
    assert (code, param) == (ErrorCode.INVALID_MEDIA, AUDIO_AT)


# ---------------------------------------------------------------- lies and polyglots


def test_a_duration_inflated_in_the_header_is_refused(videos, matcher):
    """A Matroska Segment whose Info says 100 s over 1 s of frames. (An MP4's mvhd and
    mdhd durations are not what FFmpeg reads: its loaders count the sample table.)"""
    data = bytearray(videos["mkv"])
    duration = data.find(b"\x44\x89\x88")  # Duration, an 8-byte float
    assert duration > 0
    (ticks,) = struct.unpack_from(">d", data, duration + 3)
    struct.pack_into(">d", data, duration + 3, ticks * 100)
    code, param, text = refusal(video_request(bytes(data), MIME["mkv"]), matcher)
    assert (code, param) == (ErrorCode.INVALID_MEDIA, VIDEO_AT)
    assert text == (
        f"{VIDEO_AT}: the video declares 100.000 s but holds 1.000 s (cut short, or its"
        " duration is false)"
    )


def test_a_wav_that_says_it_is_longer_than_it_is_is_refused(audios, matcher):
    data = bytearray(audios["wav"])
    struct.pack_into("<I", data, 4, len(data) * 2)
    code, param, text = refusal(audio_request(bytes(data)), matcher)
    assert (code, param) == (ErrorCode.INVALID_MEDIA, AUDIO_AT)
    assert text == (
        f"{AUDIO_AT}: the WAV audio is not whole: it is cut short (its RIFF chunk ends past"
        " the data)"
    )


@pytest.mark.parametrize("fmt", DEFAULT_VIDEO)
def test_a_file_after_the_video_is_refused(fmt, videos, matcher):
    polyglot = videos[fmt] + b"PK\x03\x04" + bytes(200)
    code, param, _ = refusal(video_request(polyglot, MIME[fmt]), matcher)
    assert (code, param) == (ErrorCode.INVALID_MEDIA, VIDEO_AT)


def test_a_stream_of_the_wrong_codec_data_is_refused(videos, matcher):
    """An MP4 whose H.264 samples are overwritten with noise: its boxes are whole."""
    data = bytearray(videos["mp4"])
    mdat = data.find(b"mdat")
    size = struct.unpack_from(">I", data, mdat - 4)[0]
    data[mdat + 4 : mdat - 4 + size] = os.urandom(size - 8)
    code, param, text = refusal(video_request(bytes(data)), matcher)
    assert (code, param) == (ErrorCode.INVALID_MEDIA, VIDEO_AT)
    assert "cannot be decoded" in text


# ---------------------------------------------------------------- the rule's limits


@pytest.mark.parametrize(
    ("limits", "code", "message"),
    [
        ("max_video_seconds: 0.5", ErrorCode.MEDIA_TOO_LARGE,
         "video is 1.0 s long; the limit is 0.5 s"),
        ("max_video_frames: 5", ErrorCode.MEDIA_TOO_LARGE, "video has 10 frames; the limit is 5"),
        ("max_video_pixels: 1000", ErrorCode.MEDIA_TOO_LARGE,
         "video frames are 64x48 (3072 pixels); the limit is 1000 pixels"),
        ("video_codecs: [vp9]", ErrorCode.UNSUPPORTED_MEDIA_FORMAT,
         "h264 video is not accepted (vp9)"),
        ("video_formats: [webm]", ErrorCode.UNSUPPORTED_MEDIA_FORMAT,
         "MP4 video is not accepted (accepted: webm)"),
    ],
)  # fmt: skip
def test_video_limits(limits, code, message, videos):
    refused = refusal(video_request(videos["mp4"]), policy_with(limits))
    assert refused == (code, VIDEO_AT, f"{VIDEO_AT}: {message}")


@pytest.mark.parametrize(
    ("limits", "code", "message"),
    [
        ("max_audio_seconds: 0.5", ErrorCode.MEDIA_TOO_LARGE,
         "audio is 1.0 s long; the limit is 0.5 s"),
        ("min_audio_sample_rate: 22050", ErrorCode.UNSUPPORTED_MEDIA_FORMAT,
         "audio sampled at 16000 Hz is not accepted (22050..192000 Hz)"),
        ("audio_codecs: [flac]", ErrorCode.UNSUPPORTED_MEDIA_FORMAT,
         "pcm_s16le audio is not accepted (flac)"),
        ("audio_formats: [mp3]", ErrorCode.UNSUPPORTED_MEDIA_FORMAT,
         "WAV audio is not accepted (accepted: mp3)"),
    ],
)  # fmt: skip
def test_audio_limits(limits, code, message, audios):
    refused = refusal(audio_request(audios["wav"]), policy_with(limits))
    assert refused == (code, AUDIO_AT, f"{AUDIO_AT}: {message}")


def test_too_many_channels(matcher):
    stereo = make_audio("wav", channels=2)
    assert validate_body(audio_request(stereo), matcher).accepted
    refused = refusal(audio_request(stereo), policy_with("max_audio_channels: 1"))
    assert refused == (
        ErrorCode.UNSUPPORTED_MEDIA_FORMAT,
        AUDIO_AT,
        f"{AUDIO_AT}: audio with 2 channels is not accepted (1..1)",
    )


def test_a_frame_size_over_the_limit_is_refused_without_decoding(matcher):
    wide = make_video("mp4", frames=2, width=4096, height=64)
    refused = refusal(video_request(wide), policy_with("max_video_pixels: 100000"))
    assert refused[0] is ErrorCode.MEDIA_TOO_LARGE


# ---------------------------------------------------------------- off the event loop


def test_a_video_part_is_never_judged_under_the_loops_allowance(videos, matcher):
    """The middleware judges small bodies inline under an allowance; a probe spends it all."""
    result = run_within(validate_body, video_request(videos["mp4"]), matcher)
    assert isinstance(result, InlineWorkExceeded)
    assert validate_body(video_request(videos["mp4"]), matcher).accepted  # in a thread: judged


# ---------------------------------------------------------------- accepted means decodable


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from(DEFAULT_VIDEO),
    frames=st.integers(1, 6),
    side=st.integers(8, 40).map(lambda s: s * 2),
    cut=st.one_of(st.none(), st.floats(0.05, 0.999)),
)
def test_every_video_the_gate_accepts_decodes_to_its_end(fmt, frames, side, cut):
    data = make_video(fmt, frames=frames, width=side, height=side)
    if cut is not None:
        data = data[: max(1, int(len(data) * cut))]
    verdict = validate_body(video_request(data, MIME[fmt]), RuleMatcher(load_policy(), None))
    if verdict.accepted:
        assert cut is None
        assert decode_all(data) == frames
    else:
        assert verdict.violations[0].code in (ErrorCode.INVALID_MEDIA, ErrorCode.MODALITY_MISMATCH)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from(["wav", "flac", "ogg", "m4a", "mp3"]),
    seconds=st.floats(0.05, 1.0),
    cut=st.one_of(st.none(), st.floats(0.05, 0.999)),
)
def test_every_audio_file_the_gate_accepts_decodes_to_its_end(fmt, seconds, cut):
    data = make_audio(fmt, seconds=seconds)
    if cut is not None:
        data = data[: max(1, int(len(data) * cut))]
    matcher = RuleMatcher(load_policy(), None)
    verdict = validate_body(audio_request(data, fmt), matcher, dialect=VLLM_DIALECT)
    if verdict.accepted:
        assert decode_all(data) >= 1


def test_a_probe_past_its_time_budget_is_refused_not_crashed(videos, matcher, monkeypatch):
    """A container shaped to make the demuxer loop meets the probe's budget: spent at
    once here, so every read raises inside FFmpeg's call and comes back as a refusal."""
    monkeypatch.setattr(av_probe, "PROBE_SECONDS", -1.0)
    code, param, text = refusal(video_request(videos["mp4"]), matcher)
    assert (code, param, text) == (
        ErrorCode.INVALID_MEDIA,
        VIDEO_AT,
        f"{VIDEO_AT}: the video takes too long to read (its structure loops)",
    )


def last_frame_damaged(data: bytes) -> bytes:
    """``data`` with its last video frame's coded data overwritten past its first quarter."""
    with av.open(io.BytesIO(data)) as container:
        pos, size = [(p.pos, p.size) for p in container.demux(video=0) if p.size][-1]
    damaged = bytearray(data)
    for at in range(pos + size // 4, pos + size - 2):
        damaged[at] = 0xFF if at % 2 else 0x00
    return bytes(damaged)


def test_damage_in_the_last_frame_is_refused_within_the_verified_pixels(videos, matcher):
    """Every frame is decoded (``verify_media_data``), up to ``max_verified_pixels``; past
    them frames are only counted, so there the damage passes, as it must at that cost."""
    data = last_frame_damaged(videos["avi"])
    refused = refusal(video_request(data, MIME["avi"]), matcher)
    assert refused == (
        ErrorCode.INVALID_MEDIA,
        VIDEO_AT,
        f"{VIDEO_AT}: the video's frame 10 cannot be decoded (its data is damaged)",
    )
    frame = 64 * 48
    assert validate_body(
        video_request(data, MIME["avi"]), policy_with(f"max_verified_pixels: {frame * 9}")
    ).accepted
    refused = refusal(
        video_request(data, MIME["avi"]), policy_with(f"max_verified_pixels: {frame * 10}")
    )
    assert refused[0] is ErrorCode.INVALID_MEDIA
    shallow = policy_with("verify_media_data: false")
    assert validate_body(video_request(data, MIME["avi"]), shallow).accepted
