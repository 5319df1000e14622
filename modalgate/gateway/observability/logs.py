"""Structured logs: one JSON object per line, each carrying the request id.

A log line must never carry a request body, image bytes or base64: requests are
large and private. So structured fields travel as ``extra={"fields": {...}}``
(never the message), every string is cut to ``MAX_FIELD_CHARS``, and any long
run of base64 alphabet left in it is blanked out as a last line of defence.

Exceptions come out as ``exc_type``, a short ``exc`` message and ``exc_at``
(the innermost frame), which locate a failure in one line without the
exception's full text. The whole traceback is added only when the formatter is
built with ``tracebacks=True``, which ``configure_logging`` does at DEBUG level.
"""

from __future__ import annotations

import logging
import re
import traceback
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Any, Literal

import orjson

from modalgate.gateway.gate.outcome import GateOutcome

request_id_var: ContextVar[str | None] = ContextVar("modalgate_request_id", default=None)

MAX_FIELD_CHARS = 300
MAX_MODEL_CHARS = 100
MAX_TRACEBACK_CHARS = 8000
# 64+ characters of the base64 alphabet in a row is data, not prose or an identifier.
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_-]{64,}={0,2}")
_CORE = ("ts", "level", "logger", "event")
_HANDLER_MARK = "_modalgate_handler"

logger = logging.getLogger("modalgate.gateway")


def safe_text(value: str, limit: int = MAX_FIELD_CHARS) -> str:
    """``value`` cut to ``limit`` characters, with base64-looking runs replaced."""
    if len(value) > limit:
        value = value[:limit] + "…"
    return _BASE64_RUN.sub(lambda m: f"[{len(m.group())} chars elided]", value)


def _safe(value: Any) -> Any:
    if isinstance(value, str):
        return safe_text(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    return safe_text(str(value))  # containers, objects: their text, bounded


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The record's structured fields: ``extra={"fields": {...}}``, request id, exception."""
    fields: dict[str, Any] = {}
    extra = getattr(record, "fields", None)
    if isinstance(extra, dict):
        fields.update((str(k), _safe(v)) for k, v in extra.items() if k not in _CORE)
    if "request_id" not in fields:
        request_id = request_id_var.get()
        if request_id is not None:
            fields["request_id"] = request_id
    if record.exc_info and record.exc_info[1] is not None:
        exc = record.exc_info[1]
        fields["exc_type"] = type(exc).__name__
        fields["exc"] = safe_text(str(exc))
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            last = frames[-1]
            fields["exc_at"] = f"{last.filename.rsplit('/', 1)[-1]}:{last.lineno} in {last.name}"
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, event, then the fields."""

    def __init__(self, tracebacks: bool = False) -> None:
        super().__init__()
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": safe_text(record.getMessage().strip(), 1000),
            **record_fields(record),
        }
        if self.tracebacks and record.exc_info:
            text = "".join(traceback.format_exception(*record.exc_info))
            line["traceback"] = safe_text(text, MAX_TRACEBACK_CHARS)
        return orjson.dumps(line, default=str).decode()


class TextFormatter(logging.Formatter):
    """For people at a terminal: the usual line, then ``key=value`` fields."""

    def __init__(self, tracebacks: bool = False) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()  # what Formatter.format sets before formatMessage
        record.asctime = self.formatTime(record)
        fields = record_fields(record)
        tail = " ".join(f"{k}={orjson.dumps(v, default=str).decode()}" for k, v in fields.items())
        text = f"{safe_text(self.formatMessage(record), 1000)} {tail}".rstrip()
        if self.tracebacks and record.exc_info:
            text += "\n" + safe_text(self.formatException(record.exc_info), MAX_TRACEBACK_CHARS)
        return text


def _level(level: str) -> int:
    name = level.upper()
    if name == "TRACE":  # uvicorn's extra level
        return 5
    value = logging.getLevelName(name)
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r}")
    return value


def _formatter(fmt: Literal["json", "text"]) -> type[JsonFormatter | TextFormatter]:
    if fmt not in ("json", "text"):
        raise ValueError(f"unknown log format {fmt!r}: json or text")
    return JsonFormatter if fmt == "json" else TextFormatter


def configure_logging(level: str = "info", fmt: Literal["json", "text"] = "json") -> None:
    """The "modalgate" logger tree to stderr in ``fmt``; calling it again replaces, not adds."""
    numeric = _level(level)
    factory = _formatter(fmt)
    root = logging.getLogger("modalgate")
    for handler in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(handler)
    handler = logging.StreamHandler()
    handler.setFormatter(factory(tracebacks=numeric <= logging.DEBUG))
    setattr(handler, _HANDLER_MARK, True)
    root.addHandler(handler)
    root.setLevel(numeric)
    root.propagate = False


def uvicorn_log_config(level: str = "info", fmt: Literal["json", "text"] = "json") -> dict:
    """A dictConfig for ``uvicorn.run(log_config=...)``: uvicorn's lines and ours, one format.

    uvicorn's access log is turned down to warnings: ``RequestId`` writes the
    access line (with the request id, without the query string), so two would
    be one too many.
    """
    numeric = _level(level)
    factory = _formatter(fmt)
    formatter = {"()": f"{__name__}.{factory.__name__}", "tracebacks": numeric <= logging.DEBUG}
    handler = {
        "class": "logging.StreamHandler",
        "formatter": "modalgate",
        "stream": "ext://sys.stderr",
    }
    quiet = {"handlers": ["modalgate"], "level": max(numeric, logging.WARNING), "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"modalgate": formatter},
        "handlers": {"modalgate": handler},
        "loggers": {
            "uvicorn": {"handlers": ["modalgate"], "level": numeric, "propagate": False},
            "uvicorn.error": {"level": numeric},
            "uvicorn.access": quiet,
            "modalgate": {"handlers": ["modalgate"], "level": numeric, "propagate": False},
        },
    }


def log_outcome(outcome: GateOutcome) -> None:
    """An ``OutcomeObserver``: one INFO line per refusal (shadowed or not) or fallback;
    others only at DEBUG."""
    if outcome.accepted and outcome.routed_from is not None:
        logger.info("request_rerouted", extra={"fields": _outcome_fields(outcome)})
        return
    if outcome.accepted:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request_accepted", extra={"fields": _outcome_fields(outcome)})
        return
    fields = _outcome_fields(outcome)
    fields.update(
        status=outcome.status,
        code=outcome.code,
        param=outcome.param,
        message=outcome.violations[0].message if outcome.violations else None,
        violations=len(outcome.violations),
    )
    # Shadow mode: the same fields, for a refusal that was forwarded all the same.
    logger.info(
        "request_shadowed" if outcome.shadowed else "request_rejected", extra={"fields": fields}
    )


def _outcome_fields(outcome: GateOutcome) -> dict[str, Any]:
    return {
        "model": safe_text(outcome.model, MAX_MODEL_CHARS) if outcome.model is not None else None,
        "rule": outcome.rule,
        "routed_from": outcome.routed_from,
        "mode": outcome.mode,
        "path": outcome.path,
        "body_bytes": outcome.body_bytes,
        "validation_ms": round(outcome.seconds * 1000, 3),
    }
