"""Every content part type that OpenAI, the Responses API, vLLM and SGLang accept, as data.

A part's declared type names its modality and where its payload sits. The table
is the single place that knows part shapes; ``read_part`` turns a raw part into
either a text part (nothing to check), a media part to check (a ``PartDraft``), or a
violation.

Servers also take parts without ``type``: vLLM infers the kind from the payload
key, and does the same, ignoring ``type``, whenever a part carries a ``uuid``. So
a part with a ``uuid`` is judged by its payload key as vLLM reads it, and one
whose declared type names another kind is refused (SGLang drops ``uuid`` and
reads the type: the two engines would see different media). A typed part that
also carries another kind's payload key is refused too: otherwise ``{"type":
"text", "video_embeds": ...}`` would pass here as text and reach a server that
reads keys as a video. A ``uuid`` part whose payload is ``null`` is vLLM's
reference to media it cached earlier: it counts as that modality, with no bytes
to check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from modalgate.errors import ErrorCode, Violation, path
from modalgate.validators.verdict import PartDraft

Shape = Literal[
    "text", "url", "input_image", "input_audio", "file", "input_file", "embeds", "never"
]


@dataclass(frozen=True, slots=True)
class PartKind:
    modality: str
    key: str  # where the payload sits in the part
    shape: Shape


PART_KINDS: dict[str, PartKind] = {
    # OpenAI chat
    "text": PartKind("text", "text", "text"),
    "refusal": PartKind("text", "refusal", "text"),
    "image_url": PartKind("image", "image_url", "url"),
    "input_audio": PartKind("audio", "input_audio", "input_audio"),
    "file": PartKind("file", "file", "file"),
    # OpenAI Responses API
    "input_text": PartKind("text", "text", "text"),
    "output_text": PartKind("text", "text", "text"),
    "input_image": PartKind("image", "image_url", "input_image"),
    "input_file": PartKind("file", "file_data", "input_file"),
    # vLLM / SGLang extensions
    "video_url": PartKind("video", "video_url", "url"),
    "audio_url": PartKind("audio", "audio_url", "url"),
    "image_embeds": PartKind("embeddings", "image_embeds", "embeds"),
    "audio_embeds": PartKind("embeddings", "audio_embeds", "embeds"),
    "video_embeds": PartKind("embeddings", "video_embeds", "embeds"),
    "prompt_embeds": PartKind("embeddings", "data", "embeds"),
    "thinking": PartKind("text", "thinking", "text"),
    "tool_reference": PartKind("text", "name", "text"),
    "image_pil": PartKind("image", "image_pil", "never"),
}

# vLLM's order for inferring the type from the payload key (no type, or a uuid).
INFERRED_FROM_KEY: tuple[tuple[str, str], ...] = (
    ("image_url", "image_url"),
    ("image_pil", "image_pil"),
    ("image_embeds", "image_embeds"),
    ("audio_embeds", "audio_embeds"),
    ("video_embeds", "video_embeds"),
    ("prompt_embeds", "prompt_embeds"),
    ("audio_url", "audio_url"),
    ("input_audio", "input_audio"),
    ("video_url", "video_url"),
    ("tool_reference", "tool_reference"),
)
MEDIA_KEYS = frozenset(
    {
        "image_url",
        "image_pil",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
        "audio_url",
        "input_audio",
        "video_url",
        "file",
    }
)
# OpenAI's values (``original``: full resolution, newer SDKs), and SGLang's ``default``.
IMAGE_DETAILS = frozenset({"auto", "low", "high", "original", "default"})
_DETAIL_PROBLEM = "'detail' must be one of auto, low, high, original"


def _bad(message: str, param: str) -> Violation:
    return Violation(ErrorCode.INVALID_REQUEST, f"{param}: {message}", param)


def part_type_of(part: dict[str, Any], where: str) -> tuple[str, str] | Violation:
    """The part's type and the param to blame for type-level problems."""
    declared = part.get("type")
    type_param = path(where, "type")
    if declared is not None and not isinstance(declared, str):
        return _bad("'type' must be a string", type_param)
    if declared is not None and part.get("uuid") is None:
        return _known_part_type(part, declared, type_param)
    inferred = next((kind for key, kind in INFERRED_FROM_KEY if key in part), None)
    if inferred is None:
        if declared is None:
            return _bad("content part has no 'type'", type_param)
        return _bad("a part with 'uuid' must carry a media payload key", type_param)
    if declared is not None and declared != inferred:
        return _bad(
            f"a part with 'uuid' is read by its payload key ({inferred!r}) by some servers and"
            f" by its type ({_short(declared)!r}) by others; make them agree",
            type_param,
        )
    return _known_part_type(part, inferred, path(where, inferred))


def _known_part_type(
    part: dict[str, Any], declared: str, type_param: str
) -> tuple[str, str] | Violation:
    if declared not in PART_KINDS:
        return Violation(
            ErrorCode.UNSUPPORTED_CONTENT_TYPE,
            f"{type_param}: unknown content part type {_short(declared)!r}",
            type_param,
        )
    if declared == "image_pil":
        return Violation(
            ErrorCode.UNSUPPORTED_CONTENT_TYPE,
            f"{type_param}: 'image_pil' parts hold in-process Python images and cannot be "
            "sent over HTTP; send the image as an image_url data URL",
            type_param,
        )
    stray = MEDIA_KEYS.intersection(part).difference((PART_KINDS[declared].key,))
    if stray:
        key = sorted(stray)[0]
        where = type_param.rsplit(".", 1)[0]
        return _bad(
            f"a {declared!r} part must not also carry {key!r}; send one payload per part",
            path(where, key),
        )
    return declared, type_param


def read_part(
    part_type: str, part: dict[str, Any], where: str, role: str
) -> PartDraft | Violation | None:
    """Check the part's shape; ``None`` for a well-formed text part."""
    kind = PART_KINDS[part_type]
    key_param = path(where, kind.key)
    value = part.get(kind.key)
    if kind.shape == "text":
        if not isinstance(value, str):
            return _bad(f"'{kind.key}' must be a string", key_param)
        return None
    media = PartDraft(
        param=where, part_type=part_type, modality=kind.modality, role=role, source="url"
    )
    if value is None and part.get("uuid") is not None and kind.key in part:
        media.source, media.payload_param = "cached", key_param  # vLLM's cached-media reference
        return media
    if kind.shape == "url":
        if isinstance(value, dict):
            detail = value.get("detail")
            if detail is not None and (not isinstance(detail, str) or detail not in IMAGE_DETAILS):
                return _bad(_DETAIL_PROBLEM, path(key_param, "detail"))
            url, url_param = value.get("url"), path(key_param, "url")
        else:
            url, url_param = value, key_param
        media.inlinable = True
        if not isinstance(url, str):
            if isinstance(value, dict):
                return _bad("must be a string (a URL or a data URL)", url_param)
            return _bad("must be a URL string or an object with a string 'url'", url_param)
        return with_url(media, url, url_param)
    if kind.shape == "input_image":
        detail = part.get("detail")
        if detail is not None and (not isinstance(detail, str) or detail not in IMAGE_DETAILS):
            return _bad(_DETAIL_PROBLEM, path(where, "detail"))
        return _url_or_file_id(media, part, "image_url", where)
    if kind.shape == "input_audio":
        if not isinstance(value, dict) or not isinstance(value.get("data"), str):
            return _bad("must be an object with base64 'data' and a 'format'", key_param)
        if not isinstance(value.get("format"), str):
            return _bad(
                "'format' must be a string such as 'wav' or 'mp3'", path(key_param, "format")
            )
        media.source, media.payload = "base64", value["data"]
        media.payload_param = path(key_param, "data")
        media.format = value["format"].lower()
        return media
    if kind.shape == "file":
        if not isinstance(value, dict):
            return _bad("must be an object with 'file_data' or 'file_id'", key_param)
        return _url_or_file_id(media, value, "file_data", key_param, bare_base64=True)
    if kind.shape == "input_file":
        url = part.get("file_url")
        if isinstance(url, str) and "file_data" not in part:
            return with_url(media, url, path(where, "file_url"))  # never inlined: not a URL slot
        return _url_or_file_id(media, part, "file_data", where, bare_base64=True)
    # embeds: a base64 tensor, or a dict of them (vLLM); checked by the server that loads them.
    well_formed = isinstance(value, str) or (
        isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    )
    if not well_formed:
        return _bad("must be a base64 string or an object of base64 strings", key_param)
    media.source, media.payload_param = "embeds", key_param
    return media


def _url_or_file_id(
    media: PartDraft, holder: dict[str, Any], url_key: str, where: str, *, bare_base64: bool = False
) -> PartDraft | Violation:
    url, file_id = holder.get(url_key), holder.get("file_id")
    if isinstance(url, str):
        media.inlinable = not bare_base64
        return with_url(media, url, path(where, url_key), bare_base64=bare_base64)
    if url is None and isinstance(file_id, str):
        media.source, media.payload_param = "file_id", path(where, "file_id")
        return media
    return _bad(f"must carry a string {url_key!r} or 'file_id'", path(where, url_key))


def with_url(media: PartDraft, url: str, url_param: str, *, bare_base64: bool = False) -> PartDraft:
    """A data URL, a remote URL, or (``file_data``) bare base64."""
    media.payload_param = url_param
    if url[:5].lower() == "data:":
        media.source, media.payload = "data", url
    elif bare_base64:
        media.source, media.payload = "base64", url
    else:
        media.url = url
    return media


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
