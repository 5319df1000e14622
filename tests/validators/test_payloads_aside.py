"""A big body read with its long data URL payloads aside gets the verdict the whole body gets.

``validate_body`` swaps each long base64 run for a random token, parses that skeleton,
and decodes the runs from the body's own bytes; it keeps that verdict only where it
accepts with every token taken once and decoded strictly. These tests hold the
result to the whole-body reading (the same function with the shortcut switched off)
on real images, on the spellings that make a run differ from its JSON string
(escapes, spaces, control characters, a key, a text), and on seeded random
mutations of a body.
"""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any

import orjson
import pytest

import modalgate.validators.request as request_module
import modalgate.validators.verdict as verdict_module
from conftest import animated_gif, body, chat, data_url, image_part, noise_png
from modalgate.errors import ErrorCode
from modalgate.gateway.gate.middleware import parsed_request
from modalgate.validators import validate_body
from modalgate.validators.json_body import ASIDE_MIN_PAYLOAD, payloads_aside
from modalgate.validators.verdict import Verdict, _request_slot

PNG = noise_png(96, 96, seed=1)  # ~27 KB: a payload past ASIDE_MIN_PAYLOAD
JPEG_LIKE = noise_png(100, 90, seed=2)
assert len(data_url(PNG)) > ASIDE_MIN_PAYLOAD


def whole(raw: bytes, matcher: Any) -> Verdict:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(request_module, "ASIDE_MIN_PAYLOAD", 1 << 62)
        return validate_body(raw, matcher)


def read_aside(verdict: Verdict) -> bool:
    return type(_request_slot.__get__(verdict, Verdict)) is bytes  # the body, unparsed


def assert_same(raw: bytes, matcher: Any) -> Verdict:
    quick, reference = validate_body(raw, matcher), whole(raw, matcher)
    assert quick.to_dict() == reference.to_dict()
    assert [part.data for part in quick.parts] == [part.data for part in reference.parts]
    assert quick.request == reference.request
    return quick


def test_an_accepted_image_is_read_aside_and_its_request_parsed_when_read(full_matcher):
    raw = body(chat(image_part(data_url(PNG)), {"type": "text", "text": "what is it?"}))
    verdict = validate_body(raw, full_matcher)
    assert verdict.accepted and read_aside(verdict)
    assert verdict.parts[0].data == PNG and verdict.parts[0].payload is None
    assert (verdict.parts[0].width, verdict.parts[0].height) == (96, 96)
    assert type(verdict) is not Verdict and isinstance(verdict, Verdict)
    assert verdict.request == orjson.loads(raw)  # parsed on this first read
    assert not read_aside(verdict)
    assert type(verdict) is Verdict  # a plain verdict from then on
    # Plain verdicts keep the slot: no property on the path every text-only request takes.
    assert type(Verdict.__dict__["request"]).__name__ == "member_descriptor"
    assert_same(raw, full_matcher)


def test_two_images_each_take_their_own_bytes(full_matcher):
    raw = body(chat(image_part(data_url(PNG)), image_part(data_url(JPEG_LIKE))))
    verdict = assert_same(raw, full_matcher)
    assert read_aside(validate_body(raw, full_matcher))
    assert [part.data for part in verdict.parts] == [PNG, JPEG_LIKE]


def test_a_later_stage_copy_of_the_verdict_carries_the_parsed_request(full_matcher):
    raw = body(chat(image_part(data_url(PNG))))
    verdict = validate_body(raw, full_matcher)
    refused = verdict.with_violations(*whole(b"{", full_matcher).violations)
    assert refused.request == orjson.loads(raw)
    assert not refused.accepted


def test_short_payloads_and_small_bodies_are_read_whole(full_matcher):
    small = body(chat(image_part(data_url(noise_png(8, 8, seed=3)))))
    assert not read_aside(validate_body(small, full_matcher))
    padded = body(chat(image_part(data_url(noise_png(8, 8, seed=3))), "x" * 70_000))
    assert payloads_aside(padded) == (padded, {})


def test_tokens_are_random_each_time():
    raw = body(chat(image_part(data_url(PNG))))
    first, second = (set(payloads_aside(raw)[1]) for _ in range(2))
    assert first != second
    (token,) = first
    assert len(token) == 18 and token.endswith("-0")


def escaped_slashes(raw: bytes) -> bytes:
    return raw.replace(b"/", b"\\/")  # JSON's own spelling of "/": the same string


def wrapped(raw: bytes, separator: bytes) -> bytes:
    """The base64 run broken every 76 characters, as MIME writes it."""
    start = raw.index(b";base64,") + 8
    end = raw.index(b'"', start)
    run = raw[start:end]
    lines = separator.join(run[i : i + 76] for i in range(0, len(run), 76))
    return raw[:start] + lines + raw[end:]


def cut(raw: bytes, keep: float) -> bytes:
    start = raw.index(b";base64,") + 8
    end = raw.index(b'"', start)
    stop = start + int((end - start) * keep) // 4 * 4
    return raw[:stop] + raw[end:]


IMAGE_BODY = body(chat(image_part(data_url(PNG))))
SPELLINGS = [
    pytest.param(escaped_slashes(IMAGE_BODY), True, None, id="escaped-slashes"),
    pytest.param(wrapped(IMAGE_BODY, b"\\n"), True, None, id="wrapped-with-escaped-newlines"),
    pytest.param(wrapped(IMAGE_BODY, b" "), True, None, id="wrapped-with-spaces"),
    pytest.param(wrapped(IMAGE_BODY, b"\n"), False, "invalid_json", id="raw-newlines"),
    pytest.param(
        IMAGE_BODY.replace(b";base64,", b";base64,\xff"),
        False,
        "invalid_json",
        id="not-utf8-in-the-run",
    ),
    pytest.param(b"\xef\xbb\xbf" + IMAGE_BODY, True, None, id="after-a-bom"),
    pytest.param(IMAGE_BODY + b",", False, "invalid_json", id="trailing-comma"),
    pytest.param(cut(IMAGE_BODY, 0.5), False, "invalid_image", id="cut-in-half"),
    pytest.param(
        body(chat(image_part(data_url(PNG, "video/mp4")))),
        False,
        "modality_mismatch",
        id="declared-video-mime",
    ),
    pytest.param(
        body(chat({"type": "text", "text": data_url(PNG)})), True, None, id="in-a-text-part"
    ),
    pytest.param(
        body({**chat(), "metadata": {"note": data_url(PNG)}}), True, None, id="in-another-field"
    ),
    pytest.param(
        body({**chat(image_part(data_url(PNG))), "x": {data_url(PNG): 1, data_url(PNG)[:-1]: 2}}),
        True,
        None,
        id="as-keys",
    ),
    pytest.param(
        body(chat(image_part(data_url(PNG)))).replace(b'"model"', b'"model":"a","model"', 1),
        False,
        "invalid_json",
        id="a-duplicate-key",
    ),
    pytest.param(
        body(chat(image_part(data_url(PNG)), image_part(data_url(PNG)).copy())),
        True,
        None,
        id="the-same-image-twice",
    ),
    pytest.param(
        body(chat(image_part(data_url(animated_gif(3) + b"x" * 30_000, "image/gif")))),
        False,
        None,
        id="a-gif-with-trailing-bytes",
    ),
]


@pytest.mark.parametrize(("raw", "accepted", "code"), SPELLINGS)
def test_every_spelling_gets_the_whole_bodys_verdict(raw, accepted, code, full_matcher):
    verdict = assert_same(raw, full_matcher)
    assert verdict.accepted is accepted
    if code is not None:
        assert verdict.violations[0].code == ErrorCode(code)


def test_a_refusal_is_worded_from_the_whole_body(encoder_matcher):
    video = {"type": "video_url", "video_url": {"url": data_url(PNG, "video/mp4")}}
    raw = body(chat(image_part(data_url(PNG)), video))
    verdict = assert_same(raw, encoder_matcher)
    assert verdict.violations[0].code is ErrorCode.UNSUPPORTED_MODALITY
    assert verdict.violations[0].param == "messages.[0].content.[1].type"


def test_a_token_written_by_the_client_is_not_taken(full_matcher):
    """With the nonce known (here: fixed), a token spelled elsewhere must still not
    stand in for an image: every token is taken once, in order, and a second reader
    of the same token gets the token's own text, which never decodes."""
    image = data_url(PNG)
    forged = "data:image/png;base64\\u002c" + "00" * 8 + "-0"  # the comma escaped: not scanned
    raw = body(chat(image_part(image))).replace(
        b"]}]", b',{"type":"image_url","image_url":{"url":"' + forged.encode() + b'"}}]}]'
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("modalgate.validators.json_body.os.urandom", lambda n: b"\0" * n)
        verdict = assert_same(raw, full_matcher)
    assert verdict.violations[0].code is ErrorCode.INVALID_BASE64
    assert verdict.violations[0].param == "messages.[0].content.[1].image_url.url"


MUTATIONS = 400
INTERESTING = b'"\\ ,:{}[]\n=/+A\x00\xff'


def mutate(raw: bytes, rng: random.Random) -> bytes:
    """One to three edits, most at a payload's edges; some keep the body valid (JSON's
    spellings of the same string, whitespace between tokens), most break something."""
    marks = [i for i in range(len(raw)) if raw.startswith(b";base64,", i)]
    edges = [m + d for m in marks for d in (-3, 0, 8, 9)]
    edges += [raw.index(b'"', m + 8) + d for m in marks for d in (-2, -1, 0, 1)]
    for _ in range(rng.randint(1, 3)):
        at = rng.choice(edges) if rng.random() < 0.6 else rng.randrange(len(raw))
        byte = bytes([rng.choice(INTERESTING)]) if rng.random() < 0.8 else rng.randbytes(1)
        kind = rng.randrange(6)
        if kind == 0:
            raw = raw[:at] + byte + raw[at:]
        elif kind == 1:
            raw = raw[:at] + raw[at + 1 :]
        elif kind == 2:
            raw = raw[:at] + byte + raw[at + 1 :]
        elif kind == 3:  # the same string, spelled with escapes
            slash = raw.find(b"/", at)
            raw = raw if slash < 0 else raw[:slash] + b"\\/" + raw[slash + 1 :]
        elif kind == 4:  # line breaks, escaped, inside a run
            mark = rng.choice(marks) + 8
            at = mark + rng.randrange(1, 200) * 4
            raw = raw[:at] + b"\\n" + raw[at:]
        else:  # whitespace between tokens
            comma = raw.find(b'",', at)
            raw = raw if comma < 0 else raw[: comma + 2] + b" \n\t" + raw[comma + 2 :]
    return raw


def test_random_mutations_get_the_whole_bodys_verdict(full_matcher):
    base = body(
        chat(
            {"type": "text", "text": "compare"},
            image_part(data_url(PNG)),
            image_part(data_url(JPEG_LIKE)),
        )
    )
    rng = random.Random(16)
    outcomes = {"accepted": 0, "refused": 0}
    for _ in range(MUTATIONS):
        verdict = assert_same(mutate(base, rng), full_matcher)
        outcomes["accepted" if verdict.accepted else "refused"] += 1
    # Both sides of the line were exercised.
    assert min(outcomes.values()) >= MUTATIONS // 10, outcomes


def test_a_token_left_untaken_stops_before_the_images_are_decoded(full_matcher, monkeypatch):
    """A long base64 run where no data URL is read (here in ``metadata``) sends the body to
    the whole reading; the shortcut gives up before probing, so each image is probed once."""
    raw = body({**chat(image_part(data_url(PNG)), image_part(data_url(JPEG_LIKE)))})
    raw = raw[:-1] + b',"metadata":{"note":"' + data_url(PNG).encode() + b'"}}'
    probed: list[str] = []
    real_probe = request_module.probe_violations

    def counting_probe(part: Any, rule: Any, cache: Any = None) -> Any:
        probed.append(part.param)
        return real_probe(part, rule, cache)

    monkeypatch.setattr(request_module, "probe_violations", counting_probe)
    verdict = validate_body(raw, full_matcher)
    assert verdict.accepted and not read_aside(verdict)
    assert len(probed) == 2  # the whole reading's two images, not four


def test_verdicts_compare_equal_before_their_request_is_read(full_matcher):
    raw = body(chat(image_part(data_url(PNG))))
    quick, reference = validate_body(raw, full_matcher), whole(raw, full_matcher)
    assert read_aside(quick)
    assert quick == reference and reference == quick
    assert not read_aside(quick)


def test_the_gateway_parses_a_deferred_request_off_the_event_loop(full_matcher, monkeypatch):
    """The dry run and the embeds rewrite read ``verdict.request`` on the loop: a body read
    with its payloads aside is parsed in a worker thread, as its validation was."""
    raw = body(chat(image_part(data_url(PNG))))
    verdict = validate_body(raw, full_matcher)
    assert read_aside(verdict)
    parsed_in: list[str] = []
    real_parse = verdict_module.parse_json_body

    def noting_parse(text: bytes) -> Any:
        parsed_in.append(threading.current_thread().name)
        return real_parse(text)

    monkeypatch.setattr(verdict_module, "parse_json_body", noting_parse)

    async def read_on_the_loop() -> Any:
        return await parsed_request(verdict), threading.current_thread().name

    request, loop_thread = asyncio.run(read_on_the_loop())
    assert request == orjson.loads(raw) and not read_aside(verdict)
    assert len(parsed_in) == 1 and parsed_in[0] != loop_thread
    assert asyncio.run(parsed_request(verdict)) is request  # plain now: no second parse
    assert len(parsed_in) == 1
