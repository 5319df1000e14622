"""The gate's I/O step between validation and forwarding: fetch remote media, check it, inline it.

Validators stay pure: they accept a remote URL on its text alone. This stage
downloads it through the SSRF-safe fetcher, hands the bytes back to the same
content checks a data URL gets, and (by default) rewrites the URL into a data
URL so the model server never downloads it a second time.
"""

from __future__ import annotations

import anyio
import orjson

from modalgate.errors import Violation
from modalgate.media.fetch import FetchError, MediaFetcher
from modalgate.policy.models import MediaUrls
from modalgate.validators import MediaPart, Verdict, check_fetched


class MediaStage:
    def __init__(self, rules: MediaUrls) -> None:
        self.inline = rules.fetch and rules.inline_fetched
        self.fetcher = MediaFetcher(rules) if rules.fetch else None

    async def fetch(self, verdict: Verdict) -> None:
        """Fetch every remote part at once; failures and content problems become violations."""
        if self.fetcher is None or verdict.rule is None:
            return
        parts = verdict.remote_parts
        failures: list[Violation | None] = [None] * len(parts)
        limits = verdict.rule.limits

        async def one(index: int, part: MediaPart) -> None:
            assert self.fetcher is not None and part.url is not None
            cap = limits.max_image_bytes if part.modality == "image" else limits.max_body_bytes
            try:
                fetched = await self.fetcher.fetch(part.url, max_bytes=cap, modality=part.modality)
            except FetchError as exc:
                param = part.payload_param or part.param
                failures[index] = Violation(exc.code, f"{param}: {exc.reason}", param)
                return
            part.data = fetched.data
            part.mime = fetched.content_type or None

        async with anyio.create_task_group() as group:
            for index, part in enumerate(parts):
                group.start_soon(one, index, part)
        verdict.violations.extend(v for v in failures if v is not None)
        if verdict.accepted:
            check_fetched(verdict)

    @staticmethod
    def inlined_body(verdict: Verdict) -> bytes:
        for part in verdict.remote_parts:
            part.inline()
        return orjson.dumps(verdict.request)

    async def aclose(self) -> None:
        if self.fetcher is not None:
            await self.fetcher.aclose()
