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


@dataclass(frozen=True, slots=True)
class Member:
    """One typed dict of a content-part union."""

    type: str | None  # its ``type`` literal; None: it declares no ``type``
    type_required: bool
    fields: Mapping[str, FieldShape]
    required: frozenset[str] = frozenset()
    # (field, its shape's predicate) for each field: what ``fields_matched`` runs.
    checks: tuple[tuple[str, Callable[[object], bool]], ...] = ()


def _member(
    type_: str | None,
    required: dict[str, FieldShape],
    optional: dict[str, FieldShape] | None = None,
    *,
    type_required: bool = True,
) -> Member:
    fields = {**required, **(optional or {})}
    return Member(
        type_,
        type_required and type_ is not None,
        MappingProxyType(fields),
        frozenset(required),
        tuple((key, _SHAPE_OK[shape]) for key, shape in fields.items()),
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


def fields_matched(part: object, member: Member) -> int | None:
    """How many of ``member``'s fields ``part`` sets, or None when it does not validate."""
    if not isinstance(part, dict):
        return None
    if member.type is None:
        pass  # extra keys, ``type`` included, are allowed and ignored
    elif "type" in part:
        if part["type"] != member.type:
            return None
    elif member.type_required:
        return None
    for key in member.required:
        if key not in part:
            return None
    matched = 0
    for key, shape_ok in member.checks:
        if key in part:
            if not shape_ok(part[key]):
                return None
            matched += 1
    return matched + (member.type is not None and "type" in part)


@dataclass(frozen=True, slots=True)
class _Union:
    """A union's members by the ``type`` a part may declare. A part is tried against the
    members its ``type`` can match (that type's, then those declaring none), never
    against every member: a vLLM message of 10,000 typeless parts costs 10,000 reads of
    a few members each, not of all 17."""

    by_type: Mapping[str, tuple[Member, ...]]  # members with that ``type``, and the typeless
    without_type: tuple[Member, ...]  # members a part without ``type`` may match
    any_type: tuple[Member, ...]  # the typeless: for a ``type`` no member declares
    # The fields of each of those two groups, where no member in it requires one: a part
    # with none of them is taken with no field set (the common refusal, at one test).
    without_type_fields: frozenset[str] | None
    any_type_fields: frozenset[str] | None


def _indexed(union: tuple[Member, ...]) -> _Union:
    typeless = tuple(m for m in union if m.type is None)
    typed: dict[str, tuple[Member, ...]] = {}
    for member in union:
        if member.type is not None:
            typed[member.type] = (*typed.get(member.type, ()), member)
    without_type = tuple(m for m in union if m.type is not None and not m.type_required) + typeless
    return _Union(
        MappingProxyType({name: (*own, *typeless) for name, own in typed.items()}),
        without_type,
        typeless,
        _optional_fields(without_type),
        _optional_fields(typeless),
    )


def _optional_fields(members: tuple[Member, ...]) -> frozenset[str] | None:
    if not members or any(m.required for m in members):
        return None
    return frozenset(key for m in members for key in m.fields)


def best_match(part: object, union: tuple[Member, ...]) -> int | None:
    """The most fields ``part`` sets in a member of ``union``; None: no member takes it."""
    if isinstance(part, str):
        return 0
    found = [n for n in (fields_matched(part, m) for m in union) if n is not None]
    return max(found) if found else None


def _taken(part: object, union: _Union) -> bool | None:
    """Whether a member of ``union`` takes ``part`` with at least one of its fields set
    (``best_match(...) > 0``: True), only with none set (False), or not at all (None);
    each candidate tried once, and the first with a field set ends the search."""
    if isinstance(part, str):
        return False
    if not isinstance(part, dict):
        return None
    if "type" not in part:
        candidates, fields = union.without_type, union.without_type_fields
    else:
        declared = part["type"]
        named = union.by_type.get(declared) if type(declared) is str else None
        if named is None:
            candidates, fields = union.any_type, union.any_type_fields
        else:
            candidates, fields = named, None
    if fields is not None and fields.isdisjoint(part):
        return False
    taken = None
    for member in candidates:
        matched = fields_matched(part, member)
        if matched:
            return True
        if matched is not None:
            taken = False
    return taken


MessagePath = Literal["own", "openai", "refused"]


def message_path(role: str, parts: list[object]) -> tuple[MessagePath, int | None]:
    """Which of vLLM's readings a message with list content gets, and on refusal the
    index of the first part to blame."""
    any_field = False
    for index, part in enumerate(parts):
        taken = _taken(part, _VLLM_PARTS)
        if taken is None:
            first_untaken = index
            break
        any_field = any_field or taken
    else:
        if any_field or role not in OPENAI_MESSAGE_PARTS:
            return "own", None
        first_untaken = None
    fallback = _OPENAI_PARTS.get(role)
    if fallback is None:
        return "refused", first_untaken
    for index, part in enumerate(parts):
        if isinstance(part, str) or _taken(part, fallback) is None:
            return "refused", index
    return "openai", None


_VLLM_PARTS = _indexed(VLLM_PART_UNION)
_OPENAI_PARTS = MappingProxyType(
    {role: _indexed(union) for role, union in OPENAI_MESSAGE_PARTS.items()}
)
