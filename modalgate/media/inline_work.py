"""A bound on the CPU work done on the event loop, for checks whose cost is not the body's size.

Most of a request's checks cost a small constant per byte received, so a small
body is judged inline. A few do not: a 60 KB PNG may declare 50 megapixels,
and checking its pixel data means inflating all of it. Such a check charges its
work here first; the caller that judges a body on the event loop opens an
allowance (``inline_allowance``) and, when a check would exceed it, gets
``InlineWorkExceeded`` and judges the body again in a worker thread, where no
allowance applies. Work outside an allowance is never refused here.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")

# Bytes of inflated or decoded data the event loop may spend on one body: ~1 ms of zlib.
INLINE_WORK_BYTES = 1 << 20

_allowance: ContextVar[list[int] | None] = ContextVar("modalgate_inline_work", default=None)


class InlineWorkExceeded(Exception):
    """The check is too costly for the event loop; the caller runs it again in a thread.

    Not a ValueError: no client-error handler may take it for a bad input.
    """


def charge(work_bytes: int) -> None:
    """Count ``work_bytes`` against the open allowance, if any."""
    left = _allowance.get()
    if left is None:
        return
    left[0] -= work_bytes
    if left[0] < 0:
        raise InlineWorkExceeded


def charge_all() -> None:
    """For a check with no cost bound small enough for the loop (FFmpeg demuxing a video):
    under an allowance, the body goes to a thread."""
    charge(INLINE_WORK_BYTES + 1)


def run_within(function: Callable[..., T], *args: object) -> T | InlineWorkExceeded:
    """``function(*args)`` under a fresh allowance, or the exception that says it ran over.

    ``function`` must be pure over its arguments (a body's validation is): it is run
    again from the start elsewhere, so nothing it changed may be relied on.
    """
    token = _allowance.set([INLINE_WORK_BYTES])
    try:
        return function(*args)
    except InlineWorkExceeded as exc:
        return exc
    finally:
        _allowance.reset(token)
