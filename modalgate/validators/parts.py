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
from typing import Any, Literal, NamedTuple

from modalgate.errors import ErrorCode, Violation, path
from modalgate.validators.dialects import KEY_ORDER, OPENAI, Dialect, PayloadForm
from modalgate.validators.verdict import PartDraft

Shape = Literal[
    "text", "url", "input_image", "input_audio", "file", "input_file", "embeds", "tensor", "never"
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
    "prompt_embeds": PartKind("embeddings", "data", "tensor"),
    "thinking": PartKind("text", "thinking", "text"),
    "tool_reference": PartKind("text", "name", "text"),
    "image_pil": PartKind("image", "image_pil", "never"),
}

# Every payload key an engine reads a part by, bar the text one, and the file key.
MEDIA_KEYS = (frozenset(KEY_ORDER) - {"tool_reference"}) | {"file"}


_BOTH_FORMS: frozenset[PayloadForm] = frozenset({"object", "string"})


class PartType(NamedTuple):
    """A part's type as its engine reads it, and the param to blame for type-level problems."""

    name: str
    param: str
    by_key: bool  # read from its payload key (no ``type``, or a ``uuid`` the engine reads so)


def _bad(message: str, param: str) -> Violation:
    return Violation(ErrorCode.INVALID_REQUEST, f"{param}: {message}", param)


def part_type_of(
    part: dict[str, Any], where: str, dialect: Dialect = OPENAI
) -> PartType | Violation:
    """The part's type as ``dialect``'s engine reads it."""
    declared = part.get("type")
    type_param = path(where, "type")
    if declared is not None and not isinstance(declared, str):
        return _bad("'type' must be a string", type_param)
    read_by_key = part.get("uuid") is not None and dialect.uuid != "ignored"
    if declared is not None and not read_by_key:
        return _known_part_type(part, PartType(declared, type_param, False), dialect)
    if declared is None and dialect.typeless == "refused":
        return _bad(f"content part has no 'type' ({dialect.engine} needs one)", type_param)
    inferred = next((key for key in KEY_ORDER if key in part), None)
    if inferred is None:
        if declared is None:
            return _bad("content part has no 'type' and no payload key", type_param)
        return _bad("a part with 'uuid' must carry a media payload key", type_param)
    if declared is not None and declared != inferred and dialect.uuid == "must_agree":
        return _bad(
            f"a part with 'uuid' is read by its payload key ({inferred!r}) by some servers and"
            f" by its type ({_short(declared)!r}) by others; make them agree",
            type_param,
        )
    return _known_part_type(part, PartType(inferred, path(where, inferred), True), dialect)


def _known_part_type(
    part: dict[str, Any], typed: PartType, dialect: Dialect
) -> PartType | Violation:
    declared, type_param = typed.name, typed.param
    if declared not in PART_KINDS:
        return Violation(
            ErrorCode.UNSUPPORTED_CONTENT_TYPE,
            f"{type_param}: unknown content part type {_short(declared)!r}",
            type_param,
        )
    cached = part.get(PART_KINDS[declared].key) is None and part.get("uuid") is not None
    if declared == "image_pil" and not (cached and typed.by_key and "image_pil" in dialect.types):
        return Violation(
            ErrorCode.UNSUPPORTED_CONTENT_TYPE,
            f"{type_param}: 'image_pil' parts hold in-process Python images and cannot be "
            "sent over HTTP; send the image as an image_url data URL",
            type_param,
        )
    refusal = dialect.refusal(declared)
    if refusal is not None:
        return _bad(refusal, type_param)
    stray = MEDIA_KEYS.intersection(part).difference((PART_KINDS[declared].key,))
    if stray and not dialect.ignores_other_keys:
        key = sorted(stray)[0]
        where = type_param.rsplit(".", 1)[0]
        return _bad(
            f"a {declared!r} part must not also carry {key!r}; send one payload per part",
            path(where, key),
        )
    return typed


class _PartAt(NamedTuple):
    """A media part being read, and where: what each shape's reader needs."""

    typed: PartType
    part: dict[str, Any]
    value: Any  # the payload key's value
    where: str
    key_param: str
    dialect: Dialect


def read_part(
    typed: PartType, part: dict[str, Any], where: str, role: str, dialect: Dialect = OPENAI
) -> PartDraft | Violation | None:
    """Check the part's shape as ``dialect``'s engine takes it; ``None`` for a text part."""
    part_type = typed.name
    kind = PART_KINDS[part_type]
    key_param = path(where, kind.key)
    value = part.get(kind.key)
    roles = dialect.type_roles.get(part_type)
    if roles is not None and role not in roles:
        return _bad(
            f"{dialect.engine} takes {part_type!r} parts only in {', '.join(sorted(roles))}"
            " messages",
            path(where, "type"),
        )
    missing = [k for k in dialect.required_keys.get(part_type, ()) if k not in part]
    if missing and not typed.by_key:
        return _bad(f"{dialect.engine} needs {missing[0]!r} in {part_type!r} parts", where)
    if kind.shape == "text":
        skipped = value is None and part_type in dialect.skips_null_text
        checked = dialect.checked_text is None or part_type in dialect.checked_text
        if checked and not isinstance(value, str) and not skipped:
            return _bad(f"'{kind.key}' must be a string", key_param)
        return None
    media = PartDraft(
        param=where, part_type=part_type, modality=kind.modality, role=role, source="url"
    )
    media_id = part.get("uuid")
    if media_id is not None and dialect.uuid != "ignored":  # an id the engine keys caches on
        if isinstance(media_id, int | float):  # vLLM reads str(uuid): 42 and "42" are one id
            media_id = str(media_id)
        elif not isinstance(media_id, str):
            return _bad("'uuid' must be a string", path(where, "uuid"))
        media.media_id, media.id_param = media_id, path(where, "uuid")
        if value is None and typed.by_key and kind.key in part:
            media.source, media.payload_param = "cached", key_param  # vLLM's cached reference
            return media
    elif dialect.uuid == "by_key" and kind.key == part_type:
        # Where an id could stand without changing how the engine reads the part
        # (``media_ids: isolate`` gives it one).
        media.id_param = path(where, "uuid")
    at = _PartAt(typed, part, value, where, key_param, dialect)
    return _SHAPE_READERS[kind.shape](media, at)


def _read_url(media: PartDraft, at: _PartAt) -> PartDraft | Violation:
    typed, value, key_param, dialect = at.typed, at.value, at.key_param, at.dialect
    # Read by its key (vLLM), a URL may be a string or an object with ``url``.
    forms = _BOTH_FORMS if typed.by_key else dialect.url_forms
    if isinstance(value, dict) and "object" in forms:
        detail = value.get("detail", "auto")
        if typed.name == "image_url" and not _detail_ok(detail, dialect.image_details):
            return _bad(_detail_problem(dialect.image_details), path(key_param, "detail"))
        url, url_param = value.get("url"), path(key_param, "url")
    elif isinstance(value, str) and "string" in forms:
        url, url_param = value, key_param
    else:
        shape = " or ".join(
            {"object": "an object with a string 'url'", "string": "a URL string"}[f]
            for f in sorted(forms)
        )
        return _bad(f"must be {shape or 'given with a type'} ({dialect.engine})", key_param)
    media.inlinable = True
    if not isinstance(url, str):
        return _bad("must be a string (a URL or a data URL)", url_param)
    return with_url(media, url, url_param)


def _read_input_image(media: PartDraft, at: _PartAt) -> PartDraft | Violation:
    part, where, dialect = at.part, at.where, at.dialect
    detail = part.get("detail", "auto")
    if not _detail_ok(detail, dialect.input_image_details):
        return _bad(_detail_problem(dialect.input_image_details), path(where, "detail"))
    if not dialect.input_image_file_ids and not isinstance(part.get("image_url"), str):
        return _bad(f"must be a string ({dialect.engine})", path(where, "image_url"))
    return _url_or_file_id(media, part, "image_url", where)


def _read_input_audio(media: PartDraft, at: _PartAt) -> PartDraft | Violation:
    value, key_param, dialect = at.value, at.key_param, at.dialect
    if not isinstance(value, dict) or not isinstance(value.get("data"), str):
        return _bad("must be an object with base64 'data' and a 'format'", key_param)
    allowed = dialect.audio_formats
    fmt = value.get("format", "" if allowed is None else None)
    if not isinstance(fmt, str) or (allowed is not None and fmt not in allowed):
        shown = ", ".join(sorted(allowed)) if allowed is not None else "a string"
        return _bad(
            f"'format' must be one of {shown} ({dialect.engine})", path(key_param, "format")
        )
    media.source, media.payload = "base64", value["data"]
    media.payload_param = path(key_param, "data")
    media.format = fmt.lower() or None
    return media


def _read_file(media: PartDraft, at: _PartAt) -> PartDraft | Violation:
    value, key_param = at.value, at.key_param
    if not isinstance(value, dict):
        return _bad("must be an object with 'file_data' or 'file_id'", key_param)
    return _url_or_file_id(media, value, "file_data", key_param, bare_base64=True)


def _read_input_file(media: PartDraft, at: _PartAt) -> PartDraft | Violation:
    part, where = at.part, at.where
    url = part.get("file_url")
    if isinstance(url, str) and "file_data" not in part:
        media.inlinable = True  # fetched, it is forwarded as file_data (``MediaPart.inlined``)
        return with_url(media, url, path(where, "file_url"))
    return _url_or_file_id(media, part, "file_data", where, bare_base64=True)


def _read_embeds(media: PartDraft, at: _PartAt) -> PartDraft | Violation:
    """A base64 tensor (``tensor``), or also a dict of them (``embeds``: vLLM); checked by
    the server that loads them."""
    value, key_param = at.value, at.key_param
    shape = PART_KINDS[at.typed.name].shape
    well_formed = (isinstance(value, str) and value != "") or (
        shape == "embeds"
        and isinstance(value, dict)
        and all(_tensor_or_numbers(v) for v in value.values())
    )
    if not well_formed:
        if shape == "tensor":
            return _bad("must be a non-empty base64 string (a serialized tensor)", key_param)
        return _bad("must be a base64 string or an object of base64 strings", key_param)
    media.source, media.payload_param = "embeds", key_param
    return media


_SHAPE_READERS = {
    "url": _read_url,
    "input_image": _read_input_image,
    "input_audio": _read_input_audio,
    "file": _read_file,
    "input_file": _read_input_file,
    "embeds": _read_embeds,
    "tensor": _read_embeds,
    "never": _read_embeds,  # image_pil: only a cached reference gets this far, and returns first
}


def _tensor_or_numbers(value: Any) -> bool:
    """A base64 tensor, or numeric metadata (vLLM's image_grid_thw and the like)."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and all(
        isinstance(n, int | float) and not isinstance(n, bool) for n in value
    )


def _detail_ok(detail: Any, allowed: frozenset[str | None]) -> bool:
    if detail is None:
        return None in allowed
    return isinstance(detail, str) and detail in allowed


def _detail_problem(allowed: frozenset[str | None]) -> str:
    return f"'detail' must be one of {', '.join(sorted(d for d in allowed if d))}"


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
