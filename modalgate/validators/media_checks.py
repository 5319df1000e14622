"""Checks on one media part, in two tiers.

``cheap_violations`` reads only strings already in memory (URL text, data URL
header, base64 length); ``probe_violations`` decodes the base64 payload and reads
magic bytes and image headers. The request validator runs the probe tier only
when the cheap tier found nothing, so a request refused for its 17th image
never pays for decoding the first 16.
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3

from modalgate.errors import ErrorCode, Violation
from modalgate.media.data_url import Base64Error, decode_base64, decoded_size, parse_data_url
from modalgate.media.decode import DecodeError, verify_image_data
from modalgate.media.sniff import SNIFF_BYTES, mime_modality, sniff
from modalgate.media.urls import url_refusal
from modalgate.policy.matching import ResolvedRule
from modalgate.policy.models import MediaUrls
from modalgate.validators.av_checks import av_violations
from modalgate.validators.image_probe import ImageFacts, ImageProbeError, probe_image
from modalgate.validators.tokens import TokenEstimateError, estimate_tokens
from modalgate.validators.verdict import MediaPart, PartDraft
from modalgate.validators.verdict_cache import VerdictCache, key_of

_GENERIC_MIMES = frozenset({"", "application/octet-stream", "binary/octet-stream"})
_ARTICLE = {"image": "an image", "video": "a video", "audio": "audio", "file": "a document"}


def _violation(code: ErrorCode, part: PartDraft, message: str) -> Violation:
    param = part.payload_at
    return Violation(code, f"{param}: {message}", param)


def cheap_violations(
    part: PartDraft,
    rule: ResolvedRule,
    urls: MediaUrls,
    aside: dict[str, memoryview | bytes] | None = None,
) -> list[Violation]:
    """``aside``: payloads read from the body's bytes, by the token that stands for each
    (``json_body.payloads_aside``); a part whose payload is a token takes it, once."""
    if part.url is not None:
        reason = url_refusal(part.url, urls)
        return [_violation(ErrorCode.URL_NOT_ALLOWED, part, reason)] if reason else []
    if part.payload is None:
        return []  # file_id or embeddings: nothing to look at here
    if part.source == "data":
        if "data" not in urls.schemes:
            return [_violation(ErrorCode.URL_NOT_ALLOWED, part, "data URLs are not allowed")]
        data_url = parse_data_url(part.payload)
        if data_url is None:
            return [_violation(ErrorCode.INVALID_REQUEST, part, "malformed data URL")]
        if not data_url.is_base64:
            return [
                _violation(
                    ErrorCode.INVALID_BASE64,
                    part,
                    "data URLs must be base64-encoded (data:<mime>;base64,<data>)",
                )
            ]
        # A token for a payload set aside takes its bytes (once: ``dict.pop``).
        payload = aside.pop(data_url.payload, data_url.payload) if aside else data_url.payload
        part.mime, part.payload = data_url.mime or None, payload
        claimed = mime_modality(data_url.mime)
        if (
            part.modality != "file"
            and data_url.mime not in _GENERIC_MIMES
            and claimed != part.modality
        ):
            return [
                _violation(
                    ErrorCode.MODALITY_MISMATCH,
                    part,
                    f"the data URL's MIME type {data_url.mime[:60]!r} is not {part.modality}, "
                    f"but the part is declared as {part.modality}",
                )
            ]
    part.bytes = decoded_size(part.payload)
    if part.modality == "image" and part.bytes > rule.limits.max_image_bytes:
        part.bytes = decoded_size(part.payload, wrapped=True)
    if part.modality == "image" and part.bytes > rule.limits.max_image_bytes:
        return [
            _violation(
                ErrorCode.IMAGE_TOO_LARGE,
                part,
                f"image is {part.bytes} bytes; the limit is {rule.limits.max_image_bytes} bytes",
            )
        ]
    return []


def probe_violations(
    part: PartDraft, rule: ResolvedRule, cache: VerdictCache | None = None
) -> list[Violation]:
    """Decode an inline payload, then check what the bytes are (an upload's bytes came
    whole: checked as they are). With a ``cache``, a payload judged before under these
    limits takes what was learned then, undecoded (``verdict_cache.py``)."""
    if part.source == "upload":
        return content_violations(part, rule)
    if part.payload is None or part.source == "embeds":
        return []
    text = key = None
    if cache is not None and cache.takes(part.payload):
        text = _payload_bytes(part.payload)
        key = key_of(text, part, rule)  # the part as claimed, before its bytes are read
        entry = cache.recall(key, text)
        if entry is not None:
            entry.facts.apply(part)
            if _needs_digest(part, rule):
                if entry.digest is None:  # the same text decoded cleanly when judged
                    entry.digest = _digest(decode_base64(part.payload))
                part.digest = entry.digest
            return []  # the payload stays: MediaPart.content() decodes it where needed
    try:
        part.data = decode_base64(part.payload)
    except Base64Error as exc:
        return [_violation(ErrorCode.INVALID_BASE64, part, str(exc))]
    part.payload = None
    violations = content_violations(part, rule)
    if text is not None and not violations:
        assert cache is not None
        cache.remember(key, text, part)
    return violations


def _payload_bytes(payload: str | memoryview | bytes) -> bytes | memoryview:
    """The payload's text as bytes, uncopied where it is the body's (base64 is ASCII; a
    str that is not is refused when decoded, and never reaches a cache entry)."""
    if isinstance(payload, str):
        return payload.encode("utf-8", "surrogatepass")
    return payload


def content_violations(part: PartDraft, rule: ResolvedRule) -> list[Violation]:
    """Magic bytes and image header of ``part.data``, inline or fetched alike."""
    if part.data is None:
        return []
    part.bytes = len(part.data)
    if _needs_digest(part, rule):
        # What its id is bound to (gateway/gate/media_ids.py), while the bytes are at hand.
        part.digest = _digest(part.data)
    claimed = part.format or part.mime  # input_audio's ``format``, or the data URL's type
    sniffed = sniff(part.data[:SNIFF_BYTES])
    if sniffed is not None:
        part.format = sniffed.format
        if sniffed.modality != part.modality and part.modality != "file":
            return [
                _violation(
                    ErrorCode.MODALITY_MISMATCH,
                    part,
                    f"declared as {part.modality} but the data is "
                    f"{_ARTICLE[sniffed.modality]} ({sniffed.format.upper()})",
                )
            ]
    if part.modality in ("video", "audio"):
        if sniffed is None:
            part.format = None  # what was claimed is not what the bytes are
            what = "a video" if part.modality == "video" else "an audio"
            message = f"the data is not {what} file of a known format"
            return [_violation(ErrorCode.INVALID_MEDIA, part, message)]
        return av_violations(part, rule, claimed, _claimed_at(part))
    if part.modality != "image":
        return []
    if sniffed is None:
        return [_violation(ErrorCode.INVALID_IMAGE, part, "the data is not a recognised image")]
    return _image_violations(part, rule)


# media_ids modes that key ids on the bytes
_DIGESTED = frozenset({"bind", "isolate", "share", "strip"})


def _needs_digest(part: PartDraft, rule: ResolvedRule) -> bool:
    return (part.media_id is not None and rule.media_ids in _DIGESTED) or (
        rule.media_ids == "isolate" and part.id_param is not None
    )


def _digest(data: bytes) -> bytes:
    return blake3.blake3(data, max_threads=1).digest()


def _claimed_at(part: PartDraft) -> str:
    """Where the format beside the bytes sits: ``input_audio.format``, or the URL."""
    at = part.payload_at
    if part.part_type == "input_audio" and at.endswith(".data"):
        return at[: -len("data")] + "format"
    return at


def _image_violations(part: PartDraft, rule: ResolvedRule) -> list[Violation]:
    limits = rule.limits
    assert part.data is not None and part.format is not None
    if part.format not in limits.image_formats:
        accepted = ", ".join(limits.image_formats)
        return [
            _violation(
                ErrorCode.UNSUPPORTED_IMAGE_FORMAT,
                part,
                f"{part.format.upper()} images are not accepted (accepted: {accepted})",
            )
        ]
    # Frames are counted one past the limit and no further (a still: two at most).
    frame_limit = limits.max_image_frames if limits.allow_animated else 1
    try:
        facts = probe_image(part.data, part.format, frame_limit, limits.max_image_pixels)
    except ImageProbeError as exc:
        return [_violation(ErrorCode.INVALID_IMAGE, part, str(exc))]
    part.width, part.height, part.frames = facts.width, facts.height, facts.frames
    size = f"{facts.width}x{facts.height}"
    pixels = facts.width * facts.height
    if pixels > limits.max_image_pixels:
        return [
            _violation(
                ErrorCode.IMAGE_TOO_LARGE,
                part,
                f"image is {size} ({pixels} pixels); the limit is {limits.max_image_pixels} pixels",
            )
        ]
    if min(facts.width, facts.height) < limits.min_image_side:
        return [
            _violation(
                ErrorCode.IMAGE_TOO_SMALL,
                part,
                f"image is {size}; each side must be at least {limits.min_image_side} pixels",
            )
        ]
    if facts.frames > frame_limit:
        return [_frames_violation(part, facts, limits.allow_animated, frame_limit)]
    violations = _token_violations(part, rule)
    if violations or not limits.verify_image_data:
        return violations
    try:  # opt-in: a full decode, for the truncation no structural check can see
        verify_image_data(part.data, part.format, facts.frames, limits.max_image_pixels)
    except DecodeError as exc:
        return [_violation(ErrorCode.INVALID_IMAGE, part, str(exc))]
    return []


def _frames_violation(part: PartDraft, facts: ImageFacts, animated: bool, limit: int) -> Violation:
    """Say only what was counted: counting stops one frame past the limit."""
    name = (part.format or "").upper()
    counted = f"more than {limit}" if facts.frames_capped else str(facts.frames)
    if not animated:
        what = "more than one frame" if facts.frames_capped else f"{facts.frames} frames"
        return _violation(
            ErrorCode.ANIMATED_IMAGE, part, f"animated {name} with {what}; send a still image"
        )
    # Over the frame limit is a size limit, like bytes and pixels (the work grows with it).
    return _violation(
        ErrorCode.IMAGE_TOO_LARGE,
        part,
        f"animated {name} with {counted} frames; the limit is {limit} frames",
    )


def _token_violations(part: PartDraft, rule: ResolvedRule) -> list[Violation]:
    if rule.tokens is None or part.width is None or part.height is None:
        return []
    try:
        part.tokens = estimate_tokens(part.width, part.height, rule.tokens)
    except TokenEstimateError as exc:
        return [_violation(ErrorCode.UNSUPPORTED_IMAGE_SHAPE, part, str(exc))]
    limit = rule.limits.max_image_tokens
    if part.tokens is not None and limit is not None and part.tokens > limit:
        return [
            _violation(
                ErrorCode.TOO_MANY_IMAGE_TOKENS,
                part,
                f"image is {part.width}x{part.height}, {part.tokens} vision tokens; "
                f"the limit is {limit} per image",
            )
        ]
    return []


def budget_violations(
    parts: Sequence[MediaPart] | Sequence[PartDraft], rule: ResolvedRule
) -> list[Violation]:
    """The request-wide vision-token budget, blaming the image that crosses it."""
    limit = rule.limits.max_request_image_tokens
    if limit is None:
        return []
    total = 0
    vision = [part for part in parts if part.modality != "audio"]  # audio tokens aside
    for part in vision:
        total += part.tokens or 0
        if total > limit:
            grand_total = sum(p.tokens or 0 for p in vision)
            return [
                _violation(
                    ErrorCode.TOO_MANY_IMAGE_TOKENS,
                    part,
                    f"the request's images need {grand_total} vision tokens; "
                    f"the limit is {limit} per request",
                )
            ]
    return []
