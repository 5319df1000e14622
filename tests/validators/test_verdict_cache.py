"""Media judged before are recalled by their exact bytes, never by a likeness of them.

Real Pillow images in real request bodies through ``validate_body``, with and without a
``VerdictCache``: a repeat is not walked again and gets the verdict a fresh judgement
gets; bytes that differ anywhere (crafted to share the lookup key), other limits, other
claims, refusals and small payloads are judged afresh; the bounds hold, measured with
tracemalloc; media ids still get their digest; an encoder still gets the bytes.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import pybase64
import pytest

import modalgate.validators.media_checks as media_checks
from conftest import body, chat, data_url, image_part, noise_png
from modalgate.errors import ErrorCode
from modalgate.policy import RuleMatcher, parse_policy
from modalgate.validators import validate_body
from modalgate.validators.verdict import Verdict
from modalgate.validators.verdict_cache import ENTRY_OVERHEAD_BYTES, WINDOW, VerdictCache

PHOTOS = [noise_png(96, 96, seed=seed) for seed in range(3)]  # ~27 KB each


def photos_chat(*images: bytes, **extra: Any) -> bytes:
    parts = [image_part(data_url(image)) for image in images]
    return body(chat({"type": "text", "text": "what are these?"}, *parts, **extra))


def facts(verdict: Verdict) -> list[tuple[Any, ...]]:
    return [
        (p.format, p.width, p.height, p.frames, p.bytes, p.tokens, p.digest) for p in verdict.parts
    ]


class Walks:
    """Counts the structure walks validation runs (``probe_image``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = media_checks.probe_image

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(media_checks, "probe_image", counted)


@pytest.fixture
def walks(monkeypatch) -> Walks:
    return Walks(monkeypatch)


def test_a_resent_image_is_not_walked_again_and_gets_the_same_verdict(full_matcher, walks):
    cache = VerdictCache()
    first = validate_body(photos_chat(*PHOTOS), full_matcher, cache=cache)
    assert first.accepted and walks.count == 3
    turn_two = photos_chat(*PHOTOS)  # a new body, the same payloads
    again = validate_body(turn_two, full_matcher, cache=cache)
    assert walks.count == 3  # nothing walked
    assert (cache.hits, cache.misses, len(cache)) == (3, 3, 3)
    fresh = validate_body(turn_two, full_matcher)
    assert again.to_dict() == fresh.to_dict()
    assert facts(again) == facts(fresh)
    # Not decoded again either; the bytes are there for whoever needs them (an encoder).
    assert [p.data for p in again.parts] == [None, None, None]
    assert [p.content() for p in again.parts] == PHOTOS
    assert all(p.has_content for p in again.parts)


def test_bytes_that_share_the_lookup_key_but_differ_are_judged_afresh(full_matcher, walks):
    cache = VerdictCache(min_payload_bytes=0)
    validate_body(photos_chat(PHOTOS[0]), full_matcher, cache=cache)
    text = pybase64.b64encode(PHOTOS[0])
    # The same length and the same three windows (start, middle, end): one base64
    # character changed between them, where the PNG's pixel data sits.
    at = len(text) // 4
    assert WINDOW < at < len(text) // 2 - WINDOW
    forged = text[:at] + (b"A" if text[at : at + 1] != b"A" else b"B") + text[at + 1 :]
    raw = body(chat(image_part("data:image/png;base64," + forged.decode())))
    verdict = validate_body(raw, full_matcher, cache=cache)
    assert cache.hits == 0 and walks.count > 1
    assert verdict.to_dict() == validate_body(raw, full_matcher).to_dict()
    assert verdict.violations[0].code is ErrorCode.INVALID_IMAGE  # its CRC no longer holds


def test_the_same_bytes_under_other_limits_are_judged_afresh():
    policy = parse_policy(
        "extends: builtin\nmodels:\n"
        "  - {name: small, match: [small], accepts: [image], limits: {max_image_pixels: 4096}}\n",
        fmt="yaml",
    )
    matcher = RuleMatcher(policy)
    cache = VerdictCache()
    assert validate_body(photos_chat(PHOTOS[0]), matcher, cache=cache).accepted
    small = validate_body(photos_chat(PHOTOS[0], model="small"), matcher, cache=cache)
    assert small.violations[0].code is ErrorCode.IMAGE_TOO_LARGE
    assert (cache.hits, len(cache)) == (0, 1)
    # A reloaded policy with the very same limits: its rules judge the same, so it hits.
    reloaded = RuleMatcher(parse_policy("extends: builtin\n", fmt="yaml"))
    assert validate_body(photos_chat(PHOTOS[0]), reloaded, cache=cache).accepted
    assert cache.hits == 1


def test_the_same_bytes_claimed_as_another_type_are_judged_afresh(full_matcher, walks):
    cache = VerdictCache()
    validate_body(photos_chat(PHOTOS[0]), full_matcher, cache=cache)
    as_jpeg = data_url(PHOTOS[0], "image/jpeg")  # a PNG under a JPEG's MIME type
    verdict = validate_body(body(chat(image_part(as_jpeg))), full_matcher, cache=cache)
    assert verdict.accepted and walks.count == 2 and cache.hits == 0


def test_refusals_and_small_payloads_are_not_remembered(full_matcher, walks):
    cache = VerdictCache()
    truncated = PHOTOS[0][: len(PHOTOS[0]) // 2]
    for _ in range(2):
        verdict = validate_body(photos_chat(truncated), full_matcher, cache=cache)
        assert verdict.violations[0].code is ErrorCode.INVALID_IMAGE
    assert (len(cache), cache.hits) == (0, 0)
    looked_up = cache.misses
    tiny = noise_png(8, 8, seed=9)
    assert len(pybase64.b64encode(tiny)) < cache.min_payload_bytes
    for _ in range(2):
        assert validate_body(photos_chat(tiny), full_matcher, cache=cache).accepted
    assert (len(cache), cache.hits, cache.misses) == (0, 0, looked_up)  # not even looked up


def test_media_ids_get_their_digest_from_a_hit(full_matcher):
    cache = VerdictCache()
    named = {**image_part(data_url(PHOTOS[0])), "uuid": "photo"}
    raw = body(chat(named))
    plain = validate_body(photos_chat(PHOTOS[0]), full_matcher, cache=cache)
    assert plain.parts[0].digest is None  # no id: no digest taken
    first = validate_body(raw, full_matcher, cache=cache)  # a hit, digested now
    second = validate_body(raw, full_matcher, cache=cache)
    reference = validate_body(raw, full_matcher)
    assert cache.hits == 2
    assert first.parts[0].digest == second.parts[0].digest == reference.parts[0].digest
    assert reference.parts[0].digest is not None


def test_entries_and_bytes_are_bounded_least_recently_used_first(full_matcher):
    size = len(pybase64.b64encode(PHOTOS[0])) + ENTRY_OVERHEAD_BYTES
    cache = VerdictCache(max_entries=2)
    for photo in PHOTOS:
        validate_body(photos_chat(photo), full_matcher, cache=cache)
    assert len(cache) == 2
    validate_body(photos_chat(PHOTOS[0]), full_matcher, cache=cache)  # the oldest: gone
    assert cache.hits == 0
    by_bytes = VerdictCache(max_bytes=size * 2 + 100)
    for photo in (*PHOTOS, PHOTOS[2]):
        validate_body(photos_chat(photo), full_matcher, cache=by_bytes)
    assert len(by_bytes) == 2 and by_bytes.hits == 1
    assert by_bytes.accounted_bytes <= by_bytes.max_bytes
    by_bytes.resize(max_entries=1, max_bytes=by_bytes.max_bytes, min_payload_bytes=4096)
    assert len(by_bytes) == 1
    by_bytes.resize(max_entries=0, max_bytes=by_bytes.max_bytes, min_payload_bytes=4096)
    assert len(by_bytes) == 0 and not by_bytes.takes("x" * 10_000)


def test_an_entry_costs_its_text_and_at_most_the_accounted_overhead(full_matcher):
    cache = VerdictCache(max_entries=1_000, min_payload_bytes=0)
    images = [noise_png(40, 40, seed=100 + i) for i in range(200)]  # ~6.5 KB of base64
    bodies = [photos_chat(image) for image in images]
    texts = sum(len(pybase64.b64encode(image)) for image in images)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for raw in bodies:
            validate_body(raw, full_matcher, cache=cache)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(cache) == 200
    per_entry = (kept - texts) / 200
    assert 0 < per_entry <= ENTRY_OVERHEAD_BYTES, per_entry
    assert cache.accounted_bytes == texts + 200 * ENTRY_OVERHEAD_BYTES


def test_a_run_is_recognised_only_where_it_ends_with_the_text_held(full_matcher):
    cache = VerdictCache()
    validate_body(photos_chat(PHOTOS[0]), full_matcher, cache=cache)
    text = pybase64.b64encode(PHOTOS[0])
    raw = photos_chat(PHOTOS[0])
    begin = raw.index(text)
    assert cache.known_run(raw, begin) == text
    # The same text with more base64 after it: not the run held, scanned for its end.
    longer = raw[: begin + len(text)] + b"AAAA" + raw[begin + len(text) :]
    assert cache.known_run(longer, begin) is None
    verdict = validate_body(longer, full_matcher, cache=cache)
    assert verdict.to_dict() == validate_body(longer, full_matcher).to_dict()
    assert cache.hits == 0
    assert validate_body(raw, full_matcher, cache=cache).accepted and cache.hits == 1
