"""The gate's I/O step between validation and forwarding: fetch remote media, check it, inline it.

Validators stay pure: they accept a remote URL on its text alone. This stage
downloads it through the SSRF-safe fetcher, hands the bytes back to the same
content checks a data URL gets, and (by default) rewrites the URL into a data
URL so the model server never downloads it a second time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from modalgate.errors import ErrorCode, Violation
from modalgate.media.fetch import Fetched, FetchError, MediaFetcher
from modalgate.policy.models import MediaUrls
from modalgate.validators import Verdict, check_fetched
from modalgate.validators.json_body import Location

T = TypeVar("T")
RunCpu = Callable[..., Awaitable[Any]]  # (size, function, *args) -> function(*args)


async def run_inline(size: int, function: Callable[..., T], *args: object) -> T:
    return function(*args)


class MediaStage:
    def __init__(self, rules: MediaUrls) -> None:
        self.inline = rules.fetch and rules.inline_fetched
        self.fetcher = MediaFetcher(rules) if rules.fetch else None

    async def fetch(self, verdict: Verdict, run_cpu: RunCpu = run_inline) -> Verdict:
        """A new verdict once every remote part is fetched (all at once): fetch failures
        and content problems become its violations. ``verdict`` itself is not changed.

        The fetched bytes are checked through ``run_cpu``: megabytes of them, or a PNG
        that inflates to many more, are CPU work for a thread, not the event loop."""
        if self.fetcher is None or verdict.rule is None:
            return verdict
        remote = [i for i, part in enumerate(verdict.parts) if part.url is not None]
        results: dict[int, Fetched | Violation] = {}
        limits = verdict.rule.limits

        async def one(index: int) -> None:
            assert self.fetcher is not None
            part = verdict.parts[index]
            assert part.url is not None
            cap = limits.max_image_bytes if part.modality == "image" else limits.max_body_bytes
            cap = min(cap, limits.max_fetched_bytes)
            try:
                results[index] = await self.fetcher.fetch(
                    part.url, max_bytes=cap, modality=part.modality
                )
            except FetchError as exc:
                param = part.payload_at
                results[index] = Violation(exc.code, f"{param}: {exc.reason}", param)

        async with anyio.create_task_group() as group:
            for index in remote:
                group.start_soon(one, index)
        failures = [results[i] for i in remote if isinstance(results[i], Violation)]
        if failures:
            return verdict.with_violations(*failures)
        fetched = {
            i: (r.data, r.content_type or None)
            for i, r in results.items()
            if isinstance(r, Fetched)
        }
        total = sum(len(data) for data, _ in fetched.values())
        if total > limits.max_fetched_bytes:
            too_much = Violation(
                ErrorCode.MEDIA_FETCH_FAILED,
                f"the request's remote media add up to {total} bytes; the limit is "
                f"{limits.max_fetched_bytes} bytes per request",
            )
            return verdict.with_violations(too_much)
        return await run_cpu(total, check_fetched, verdict, fetched)

    def inlined(self, verdict: Verdict) -> list[tuple[Location, Any]] | Violation:
        """Each fetched URL's place and data URL, or why the body would grow too large.

        The forwarded body obeys the same cap as the received one: inlining must not
        turn a small request into one no client could have sent.
        """
        assert verdict.rule is not None
        cap = verdict.rule.limits.max_body_bytes
        growth = sum(part.inlined_size() for part in verdict.remote_parts)
        if verdict.body_bytes + growth > cap:
            return Violation(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"with its remote media inlined the request body would be about "
                f"{verdict.body_bytes + growth} bytes; the limit is {cap} bytes",
            )
        return [edit for part in verdict.remote_parts for edit in part.inlined()]

    async def aclose(self) -> None:
        if self.fetcher is not None:
            await self.fetcher.aclose()
