"""Multipart audio uploads (``/v1/audio/transcriptions``, ``/translations``), read as the
engines' own form parser reads them.

vLLM and SGLang take these bodies through Starlette's form parser, which drives
python-multipart with the boundary of the ``Content-Type`` header; so does the gate, on
the same bytes, and the uploaded ``file`` becomes one audio part (sniffed and probed as
any audio), its ``model`` field the model the request is judged as. A name sent twice is
refused: Starlette keeps the last of each, and a gate that judged another one would be
judging a file the model never hears.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from modalgate.errors import ErrorCode, Violation
from modalgate.policy.matching import ResolvedRule
from modalgate.validators.admission import admit, invalid
from modalgate.validators.dialects import Dialect
from modalgate.validators.verdict import PartDraft, VerdictBuilder

MAX_FIELDS = 1000  # Starlette's own limits on a form's parts
# python-multipart logs a warning for each malformed form before it raises: a client could
# fill the gateway's log with them. The refusal (400, counted, logged once) says it all.
logging.getLogger("python_multipart.multipart").setLevel(logging.ERROR)
UPLOAD_FIELD = "file"


@dataclass(slots=True)
class FormPart:
    name: str | None = None
    filename: str | None = None
    content_type: str | None = None
    chunks: list[bytes] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Upload:
    """An uploaded file, in the parsed request under its field's name."""

    data: bytes
    filename: str | None
    content_type: str | None


def read_form(body: bytes, content_type: bytes | None) -> dict[str, Any] | Violation:
    """The form's fields (text as ``str``, files as ``Upload``), or why it is refused."""
    main, options = parse_options_header(content_type or b"")
    boundary = options.get(b"boundary")
    if main != b"multipart/form-data" or not boundary:
        return Violation(
            ErrorCode.INVALID_REQUEST,
            "an audio upload must be multipart/form-data with a boundary",
        )
    parts: list[FormPart] = []
    header: list[bytes] = [b"", b""]
    headers: dict[bytes, bytes] = {}

    def on_part_begin() -> None:
        parts.append(FormPart())
        headers.clear()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header[0] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header[1] += data[start:end]

    def on_header_end() -> None:
        headers[header[0].lower()] = header[1]
        header[0] = header[1] = b""

    def on_headers_finished() -> None:
        # As Starlette reads it: the name and filename parameters, whatever the disposition.
        _, params = parse_options_header(headers.get(b"content-disposition", b""))
        part = parts[-1]
        if b"name" in params:
            part.name = _decoded(params[b"name"])
        if b"filename" in params:
            part.filename = _decoded(params[b"filename"])
        if b"content-type" in headers:
            part.content_type = headers[b"content-type"].decode("latin-1")

    def on_part_data(data: bytes, start: int, end: int) -> None:
        parts[-1].chunks.append(data[start:end])

    callbacks = {
        "on_part_begin": on_part_begin,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished,
        "on_part_data": on_part_data,
    }
    try:
        parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
        parser.write(body)
        parser.finalize()
    except (MultipartParseError, ValueError):
        return Violation(ErrorCode.INVALID_REQUEST, "the multipart body is malformed")
    return _fields(parts)


def _decoded(value: bytes) -> str:
    """Starlette's ``_user_safe_decode``: UTF-8, else Latin-1."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


def _fields(parts: list[FormPart]) -> dict[str, Any] | Violation:
    if len(parts) > MAX_FIELDS:
        return Violation(ErrorCode.INVALID_REQUEST, f"more than {MAX_FIELDS} form fields")
    fields: dict[str, Any] = {}
    for part in parts:
        if part.name is None:
            continue  # Starlette refuses a part without a name; the engine answers it
        if part.name in fields:
            return invalid("a form field may be sent once", part.name[:60])
        data = b"".join(part.chunks)
        if part.filename is not None:
            fields[part.name] = Upload(data, part.filename, part.content_type)
        else:
            try:
                fields[part.name] = data.decode("utf-8")
            except UnicodeDecodeError:
                return invalid("a text field must be UTF-8", part.name[:60])
    return fields


def walk_upload(
    request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder, dialect: Dialect
) -> None:
    """The uploaded ``file``: an audio part whose bytes are all there is to judge."""
    upload = request.get(UPLOAD_FIELD)
    if not isinstance(upload, Upload):
        problem = "is required: the audio file" if upload is None else "must be a file"
        verdict.violations.append(invalid(problem, UPLOAD_FIELD))
        return
    media = PartDraft(
        param=UPLOAD_FIELD, part_type="file", modality="audio", role="user", source="upload"
    )
    media.type_param = media.payload_param = UPLOAD_FIELD
    media.data = upload.data  # its declared type is not trusted: the bytes say what it is
    admit(media, rule, verdict)
