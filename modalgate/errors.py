"""The error catalogue: stable codes, their HTTP status, and OpenAI's error envelope.

Codes are a public contract (clients branch on them); add new ones, never rename.
The envelope is OpenAI's, extended with ``violations`` so one response can name
every cheap problem at once, while the OpenAI SDK still reads ``code``/``param``
from the first one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

import orjson


class ErrorCode(str, Enum):
    INVALID_JSON = "invalid_json"
    INVALID_REQUEST = "invalid_request"
    UNSUPPORTED_CONTENT_TYPE = "unsupported_content_type"
    UNSUPPORTED_MODALITY = "unsupported_modality"
    MODALITY_MISMATCH = "modality_mismatch"
    ROLE_NOT_ALLOWED = "role_not_allowed"
    UNKNOWN_MODEL = "unknown_model"
    TOO_MANY_MEDIA = "too_many_media"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    INVALID_BASE64 = "invalid_base64"
    INVALID_IMAGE = "invalid_image"
    UNSUPPORTED_IMAGE_FORMAT = "unsupported_image_format"
    ANIMATED_IMAGE = "animated_image"
    IMAGE_TOO_LARGE = "image_too_large"
    IMAGE_TOO_SMALL = "image_too_small"
    UNSUPPORTED_IMAGE_SHAPE = "unsupported_image_shape"
    TOO_MANY_IMAGE_TOKENS = "too_many_image_tokens"
    INVALID_MEDIA = "invalid_media"
    UNSUPPORTED_MEDIA_FORMAT = "unsupported_media_format"
    MEDIA_TOO_LARGE = "media_too_large"
    MEDIA_TOO_SMALL = "media_too_small"
    URL_NOT_ALLOWED = "url_not_allowed"
    MEDIA_FETCH_FAILED = "media_fetch_failed"
    UNKNOWN_MEDIA_ID = "unknown_media_id"
    MEDIA_ID_NOT_ALLOWED = "media_id_not_allowed"
    ENCODER_OVERLOADED = "encoder_overloaded"
    ENCODER_ERROR = "encoder_error"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    INVALID_API_KEY = "invalid_api_key"
    REQUEST_TIMEOUT = "request_timeout"
    HEADERS_TOO_LARGE = "headers_too_large"

    def __str__(self) -> str:
        return self.value


STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_JSON: 400,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.UNSUPPORTED_CONTENT_TYPE: 400,
    ErrorCode.UNSUPPORTED_MODALITY: 400,
    ErrorCode.MODALITY_MISMATCH: 400,
    ErrorCode.ROLE_NOT_ALLOWED: 400,
    ErrorCode.UNKNOWN_MODEL: 404,
    ErrorCode.TOO_MANY_MEDIA: 400,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.INVALID_BASE64: 400,
    ErrorCode.INVALID_IMAGE: 400,
    ErrorCode.UNSUPPORTED_IMAGE_FORMAT: 400,
    ErrorCode.ANIMATED_IMAGE: 400,
    ErrorCode.IMAGE_TOO_LARGE: 400,
    ErrorCode.IMAGE_TOO_SMALL: 400,
    ErrorCode.UNSUPPORTED_IMAGE_SHAPE: 400,
    ErrorCode.TOO_MANY_IMAGE_TOKENS: 400,
    ErrorCode.INVALID_MEDIA: 400,
    ErrorCode.UNSUPPORTED_MEDIA_FORMAT: 400,
    ErrorCode.MEDIA_TOO_LARGE: 400,
    ErrorCode.MEDIA_TOO_SMALL: 400,
    ErrorCode.URL_NOT_ALLOWED: 400,
    ErrorCode.MEDIA_FETCH_FAILED: 400,
    ErrorCode.UNKNOWN_MEDIA_ID: 400,
    ErrorCode.MEDIA_ID_NOT_ALLOWED: 400,
    ErrorCode.ENCODER_OVERLOADED: 503,
    ErrorCode.ENCODER_ERROR: 500,
    ErrorCode.UPSTREAM_UNAVAILABLE: 502,
    ErrorCode.UPSTREAM_TIMEOUT: 504,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.INVALID_API_KEY: 401,
    ErrorCode.REQUEST_TIMEOUT: 408,
    ErrorCode.HEADERS_TOO_LARGE: 431,
}

# OpenAI's `type` field: client mistakes vs. our side failing.
_SERVER_SIDE = {
    ErrorCode.ENCODER_OVERLOADED,
    ErrorCode.ENCODER_ERROR,
    ErrorCode.UPSTREAM_UNAVAILABLE,
    ErrorCode.UPSTREAM_TIMEOUT,
}

# A 10,000-part request can produce 10,000 violations; the client needs a few.
MAX_LISTED_VIOLATIONS = 32


@dataclass(frozen=True, slots=True)
class Violation:
    """One problem with a request; ``param`` is an OpenAI-style path or None."""

    code: ErrorCode
    message: str
    param: str | None = None

    @property
    def status(self) -> int:
        return STATUS[self.code]

    def as_dict(self) -> dict[str, str | None]:
        return {"code": self.code.value, "message": self.message, "param": self.param}


def error_type(code: ErrorCode) -> str:
    if code in _SERVER_SIDE:
        return "server_error"
    return "invalid_request_error"


def error_body(violations: Sequence[Violation]) -> dict:
    """The envelope: the first violation fills message/param/code."""
    if not violations:
        raise ValueError("error_body needs at least one violation")
    first = violations[0]
    return {
        "error": {
            "message": first.message,
            "type": error_type(first.code),
            "param": first.param,
            "code": first.code.value,
            "violations": [v.as_dict() for v in violations[:MAX_LISTED_VIOLATIONS]],
        }
    }


def error_json(violations: Sequence[Violation]) -> bytes:
    return orjson.dumps(error_body(violations))


# Anthropic's ``error.type`` for each status (its SDK raises by status, and reads the type).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_json(violations: Sequence[Violation]) -> bytes:
    """The Anthropic Messages API's envelope, for refusals on its doors; ``code``,
    ``param`` and ``violations`` ride along inside ``error`` as in the OpenAI one."""
    first = violations[0]
    status = first.status
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps(
        {
            "type": "error",
            "error": {
                "type": kind,
                "message": first.message,
                "code": first.code.value,
                "param": first.param,
                "violations": [v.as_dict() for v in violations[:MAX_LISTED_VIOLATIONS]],
            },
        }
    )


def status_of(violations: Iterable[Violation]) -> int:
    """The status of the first violation: it is the one the envelope reports."""
    for violation in violations:
        return violation.status
    raise ValueError("status_of needs at least one violation")


def path(*parts: str | int) -> str:
    """OpenAI's param path style: ``messages.[1].content.[0].type``."""
    return ".".join(f"[{p}]" if isinstance(p, int) else p for p in parts)


def payload_too_large(cap: int) -> Violation:
    return Violation(
        ErrorCode.PAYLOAD_TOO_LARGE, f"the request body is larger than the limit of {cap} bytes"
    )
