"""Checks on one video or audio part's bytes: what they are, that they are whole, and the
rule's limits on them.

The bytes were sniffed already (``media.sniff``: the container, from its magic);
here the format claimed beside them (``input_audio.format``, the data URL's MIME
type) must name the same container, the rule must take it, and FFmpeg's demuxer
must read it to its end (``media.av_probe``). Then the counted length, frames,
frame size, sample rate and channels meet the rule's limits.
"""

from __future__ import annotations

from modalgate.errors import ErrorCode, Violation
from modalgate.media.av_probe import MediaFacts, MediaProbeError, probe_media
from modalgate.media.inline_work import charge_all
from modalgate.policy.matching import ResolvedRule
from modalgate.policy.models import Limits
from modalgate.validators.audio_tokens import estimate_audio_tokens
from modalgate.validators.tokens import TokenEstimateError
from modalgate.validators.verdict import PartDraft
from modalgate.validators.video_tokens import estimate_video_tokens

# What a claimed format or MIME subtype names, as the sniffed container's name.
_CLAIMED = {
    "wav": "wav", "x-wav": "wav", "wave": "wav", "vnd.wave": "wav",
    "mp3": "mp3", "mpeg": "mp3", "mpeg3": "mp3", "x-mpeg-3": "mp3",
    "flac": "flac", "x-flac": "flac",
    "ogg": "ogg", "opus": "ogg", "vorbis": "ogg",
    "aac": "aac", "x-aac": "aac", "aacp": "aac",
    "m4a": "m4a", "x-m4a": "m4a", "mp4": "mp4",
    "quicktime": "mov", "mov": "mov",
    "webm": "webm", "x-matroska": "mkv", "matroska": "mkv", "mkv": "mkv",
    "avi": "avi", "x-msvideo": "avi", "msvideo": "avi",
    "mp2t": "ts", "ts": "ts",
}  # fmt: skip
# Containers one name may stand for: an MP4 file of audio is M4A; Matroska is WebM's parent.
_SAME = {
    "mp4": {"mp4", "m4a", "mov"},
    "m4a": {"m4a", "mp4"},
    "mov": {"mov", "mp4"},
    "mkv": {"mkv", "webm"},
    "webm": {"webm", "mkv"},
    "ogg": {"ogg", "ogv"},
    "aac": {"aac", "m4a"},
}


def _violation(
    code: ErrorCode, part: PartDraft, message: str, param: str | None = None
) -> Violation:
    where = param or part.payload_at
    return Violation(code, f"{where}: {message}", where)


def av_violations(
    part: PartDraft, rule: ResolvedRule, claimed: str | None, claimed_at: str | None
) -> list[Violation]:
    """``claimed``: the format the client named beside the bytes (``input_audio.format``,
    or the data URL's MIME type), if any, and where it sits."""
    assert part.data is not None and part.format is not None
    limits, what = rule.limits, part.modality
    mismatch = _claim_problem(part, claimed, claimed_at)
    if mismatch is not None:
        return [mismatch]
    allowed = limits.video_formats if what == "video" else limits.audio_formats
    if part.format not in allowed:
        return [
            _violation(
                ErrorCode.UNSUPPORTED_MEDIA_FORMAT,
                part,
                f"{part.format.upper()} {what} is not accepted (accepted: {', '.join(allowed)})",
            )
        ]
    charge_all()  # FFmpeg's work has no bound small enough for the event loop
    max_pixels = limits.max_video_pixels if what == "video" else 0
    try:
        facts = probe_media(
            part.data,
            part.format,
            what,
            max_pixels,
            limits.verify_media_data,
            limits.max_verified_pixels,
        )
    except MediaProbeError as exc:
        return [_violation(ErrorCode.INVALID_MEDIA, part, str(exc))]
    part.seconds, part.frames = facts.seconds, facts.packets if what == "video" else None
    part.width, part.height = facts.width, facts.height
    found = _video_limits(facts, limits) if what == "video" else _audio_limits(facts, limits)
    if found is not None:
        return [_violation(found[0], part, found[1])]
    if what == "audio" and rule.tokens is not None and facts.sample_rate:
        try:
            heard = facts.seconds  # with the encoder's priming, when not decoded
            if facts.decoded_samples is not None:
                heard = facts.decoded_samples / facts.sample_rate
            part.tokens = estimate_audio_tokens(heard, facts.sample_rate, rule.tokens)
        except TokenEstimateError as exc:
            return [_violation(ErrorCode.MEDIA_TOO_SMALL, part, str(exc))]
        if part.tokens == 0:  # the model would be handed a clip it cannot hear
            message = "the audio is too short for this model (it makes no audio tokens)"
            return [_violation(ErrorCode.MEDIA_TOO_SMALL, part, message)]
    if what == "video" and rule.tokens is not None and facts.width and facts.height:
        try:  # counted in the request's vision-token budget (``budget_violations``)
            part.tokens = estimate_video_tokens(
                facts.width, facts.height, facts.packets, facts.frame_rate, rule.tokens
            )
        except TokenEstimateError as exc:
            return [_violation(ErrorCode.UNSUPPORTED_IMAGE_SHAPE, part, str(exc))]
    return []


def _claim_problem(part: PartDraft, claimed: str | None, where: str | None) -> Violation | None:
    if not claimed:
        return None
    subtype = claimed.partition(";")[0].rpartition("/")[2].strip().lower()  # no codecs=
    named = _CLAIMED.get(subtype)
    actual = part.format
    assert actual is not None
    if named is None or named == actual or actual in _SAME.get(named, ()):
        return None  # a name we do not know is not held against the bytes
    return _violation(
        ErrorCode.MODALITY_MISMATCH,
        part,
        f"the format is given as {claimed[:40]!r} but the data is {actual.upper()}",
        where,
    )


def _video_limits(facts: MediaFacts, limits: Limits) -> tuple[ErrorCode, str] | None:
    codec = _codec_problem("video", facts.codec, limits.video_codecs)
    if codec is not None:
        return codec
    width, height = facts.width or 0, facts.height or 0
    if width * height > limits.max_video_pixels:
        return (
            ErrorCode.MEDIA_TOO_LARGE,
            f"video frames are {width}x{height} ({width * height} pixels); the limit is"
            f" {limits.max_video_pixels} pixels",
        )
    if width == 0 or height == 0:
        return ErrorCode.INVALID_MEDIA, "the video's frame size is missing"
    if facts.packets < limits.min_video_frames:
        return (
            ErrorCode.MEDIA_TOO_SMALL,
            f"video has {facts.packets} frame{'s' if facts.packets > 1 else ''}; this model"
            f" needs at least {limits.min_video_frames}",
        )
    if facts.packets > limits.max_video_frames:
        return (
            ErrorCode.MEDIA_TOO_LARGE,
            f"video has {facts.packets} frames; the limit is {limits.max_video_frames}",
        )
    return _length_problem("video", facts.seconds, limits.max_video_seconds)


def _audio_limits(facts: MediaFacts, limits: Limits) -> tuple[ErrorCode, str] | None:
    codec = _codec_problem("audio", facts.codec, limits.audio_codecs)
    if codec is not None:
        return codec
    rate, channels = facts.sample_rate or 0, facts.channels or 0
    if not limits.min_audio_sample_rate <= rate <= limits.max_audio_sample_rate:
        return (
            ErrorCode.UNSUPPORTED_MEDIA_FORMAT,
            f"audio sampled at {rate} Hz is not accepted ({limits.min_audio_sample_rate}"
            f"..{limits.max_audio_sample_rate} Hz)",
        )
    if not 1 <= channels <= limits.max_audio_channels:
        return (
            ErrorCode.UNSUPPORTED_MEDIA_FORMAT,
            f"audio with {channels} channels is not accepted (1..{limits.max_audio_channels})",
        )
    if facts.seconds < limits.min_audio_seconds:
        return (
            ErrorCode.MEDIA_TOO_SMALL,
            f"audio is {facts.seconds * 1000:.0f} ms long; this model needs at least"
            f" {limits.min_audio_seconds * 1000:g} ms",
        )
    return _length_problem("audio", facts.seconds, limits.max_audio_seconds)


def _codec_problem(
    what: str, codec: str, allowed: tuple[str, ...] | None
) -> tuple[ErrorCode, str] | None:
    if allowed is None or codec in allowed:
        return None
    return (
        ErrorCode.UNSUPPORTED_MEDIA_FORMAT,
        f"{codec} {what} is not accepted ({', '.join(allowed)})",
    )


def _length_problem(what: str, seconds: float, limit: float) -> tuple[ErrorCode, str] | None:
    if seconds <= limit:
        return None
    return ErrorCode.MEDIA_TOO_LARGE, f"{what} is {seconds:.1f} s long; the limit is {limit:g} s"
