"""vLLM's message union, as data: which reading a chat message gets.

vLLM validates each message against a union of OpenAI's message types and its own
(``CustomChatCompletionMessageParam``), whose content parts are a union of typed
dicts, several with no required field at all. Pydantic's smart union keeps vLLM's
own message type only when some part of the content matches one of vLLM's part
types with at least one of that type's fields: otherwise the message is read as
OpenAI's, whose parts are checked against OpenAI's few part types (by role) as
parsing iterates them. So ``[{"type": "input_text", ...}]`` alone is refused, and
taken next to an image. The tables below are those typed dicts (vLLM 0.33.0's
``renderers/chat_utils/types.py`` and openai's); ``message_path`` says which
reading a message gets. The differential suite (``tests/conformance/``) holds
them to vLLM's own code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from modalgate.validators.dialects import OPENAI_DETAILS

# What a field holds: a JSON shape, checked as pydantic checks the typed dict.
FieldShape = Literal[
    "str",
    "str_or_null",
    "null",
    "bool",
    "url_object",
    "image_url_object",
    "audio_object",
    "file_object",
    "embeds_or_null",
]


@dataclass(frozen=True, slots=True)
class Member:
    """One typed dict of a content-part union."""

    type: str | None  # its ``type`` literal; None: it declares no ``type``
    type_required: bool
    fields: Mapping[str, FieldShape]
    required: frozenset[str] = frozenset()


def _member(
    type_: str | None,
    required: dict[str, FieldShape],
    optional: dict[str, FieldShape] | None = None,
    *,
    type_required: bool = True,
) -> Member:
    return Member(
        type_,
        type_required and type_ is not None,
        MappingProxyType({**required, **(optional or {})}),
        frozenset(required),
    )


_UUID: dict[str, FieldShape] = {"uuid": "str_or_null"}
OPENAI_TEXT = _member("text", {"text": "str"})
OPENAI_IMAGE = _member("image_url", {"image_url": "image_url_object"})
OPENAI_AUDIO = _member("input_audio", {"input_audio": "audio_object"})
OPENAI_FILE = _member("file", {"file": "file_object"})
OPENAI_REFUSAL = _member("refusal", {"refusal": "str"})
VLLM_PART_UNION: tuple[Member, ...] = (
    OPENAI_TEXT,
    OPENAI_IMAGE,
    OPENAI_AUDIO,
    OPENAI_FILE,
    _member("audio_url", {"audio_url": "url_object"}),
    _member("video_url", {"video_url": "url_object"}),
    OPENAI_REFUSAL,
    _member(None, {}, {"image_pil": "null", **_UUID}),
    _member(None, {}, {"image_url": "str_or_null", **_UUID}),
    _member("image_embeds", {}, {"image_embeds": "embeds_or_null", **_UUID}),
    _member("audio_embeds", {}, {"audio_embeds": "embeds_or_null", **_UUID}),
    _member(
        "video_embeds",
        {},
        {"video_embeds": "embeds_or_null", "audio_embeds": "embeds_or_null", **_UUID},
    ),
    _member("prompt_embeds", {"data": "str"}),
    _member(None, {}, {"audio_url": "str_or_null"}),
    _member(None, {}, {"video_url": "str_or_null", **_UUID}),
    _member("tool_reference", {}, {"name": "str"}, type_required=False),
    _member("thinking", {"thinking": "str"}, {"closed": "bool"}),
)
# OpenAI's message types, by role: the part types each takes (vLLM's fallback reading).
OPENAI_MESSAGE_PARTS: Mapping[str, tuple[Member, ...]] = MappingProxyType(
    {
        "user": (OPENAI_TEXT, OPENAI_IMAGE, OPENAI_AUDIO, OPENAI_FILE),
        "system": (OPENAI_TEXT,),
        "developer": (OPENAI_TEXT,),
        "tool": (OPENAI_TEXT,),
        "assistant": (OPENAI_TEXT, OPENAI_REFUSAL),
    }
)


def _url_object(value: object) -> bool:
    return isinstance(value, dict) and isinstance(value.get("url"), str)


def _image_url_object(value: object) -> bool:
    if not isinstance(value, dict):
        return False
    return isinstance(value.get("url"), str) and value.get("detail", "auto") in OPENAI_DETAILS


def _audio_object(value: object) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("data"), str)
        and value.get("format") in ("wav", "mp3")
    )


def _file_object(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(value[k], str) for k in ("file_data", "file_id", "filename") if k in value
    )


def _embeds_or_null(value: object) -> bool:
    """A base64 string, or a dict of base64 strings or number lists; or null."""
    if value is None or isinstance(value, str):
        return True
    return isinstance(value, dict) and all(
        isinstance(v, str)
        or (
            isinstance(v, list)
            and all(isinstance(n, int | float) and not isinstance(n, bool) for n in v)
        )
        for v in value.values()
    )


# Each field shape, checked as pydantic checks the typed dict's field.
_SHAPE_OK: Mapping[FieldShape, Callable[[object], bool]] = MappingProxyType(
    {
        "str": lambda value: isinstance(value, str),
        "str_or_null": lambda value: value is None or isinstance(value, str),
        "null": lambda value: value is None,
        "bool": lambda value: isinstance(value, bool),
        "url_object": _url_object,
        "image_url_object": _image_url_object,
        "audio_object": _audio_object,
        "file_object": _file_object,
        "embeds_or_null": _embeds_or_null,
    }
)


def fields_matched(part: object, member: Member) -> int | None:
    """How many of ``member``'s fields ``part`` sets, or None when it does not validate."""
    if not isinstance(part, dict):
        return None
    declared = part.get("type", None) if "type" in part else None
    if member.type is None:
        pass  # extra keys, ``type`` included, are allowed and ignored
    elif "type" in part:
        if declared != member.type:
            return None
    elif member.type_required:
        return None
    if any(key not in part for key in member.required):
        return None
    if any(key in part and not _SHAPE_OK[shape](part[key]) for key, shape in member.fields.items()):
        return None
    return sum(key in part for key in member.fields) + (member.type is not None and "type" in part)


def best_match(part: object, union: tuple[Member, ...]) -> int | None:
    """The most fields ``part`` sets in a member of ``union``; None: no member takes it."""
    if isinstance(part, str):
        return 0
    found = [n for n in (fields_matched(part, m) for m in union) if n is not None]
    return max(found) if found else None


MessagePath = Literal["own", "openai", "refused"]


def message_path(role: str, parts: list[object]) -> tuple[MessagePath, int | None]:
    """Which of vLLM's readings a message with list content gets, and on refusal the
    index of the first part to blame."""
    matched = [best_match(part, VLLM_PART_UNION) for part in parts]
    if all(n is not None for n in matched) and (any(matched) or role not in OPENAI_MESSAGE_PARTS):
        return "own", None
    fallback = OPENAI_MESSAGE_PARTS.get(role)
    if fallback is None:
        bad = next(i for i, n in enumerate(matched) if n is None)
        return "refused", bad
    for index, part in enumerate(parts):
        if isinstance(part, str) or best_match(part, fallback) is None:
            return "refused", index
    return "openai", None
