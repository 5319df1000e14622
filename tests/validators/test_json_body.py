"""Duplicate keys, however spelled, are refused; bodies that only look repetitive are not.

A body whose keys repeat could be read one way by the gate and another by the
engine (a bypass), so ``parse_json_body`` refuses it. These are the spellings a
cheaper check (counting keys in the text, comparing a re-serialisation) would have
to get right too: escapes, whitespace before the colon, keys inside strings, and
escapes that spell the same key differently.
"""

from __future__ import annotations

import pytest

from modalgate.errors import ErrorCode, Violation
from modalgate.validators.json_body import parse_json_body

REPEATED = [
    pytest.param(b'{"model":"a","model":"b"}', "model", id="compact"),
    pytest.param(b'{"model": "a", "model": "b"}', "model", id="spaced"),
    pytest.param(b'{"model" :"a","model"\n\t: "b"}', "model", id="whitespace-before-colon"),
    pytest.param(b'{"a":"x\\"y","a":1}', "a", id="backslash-in-a-value"),
    pytest.param(b'{"a":"\\\\","a":1}', "a", id="escaped-backslash-before-the-quote"),
    pytest.param(b'{"model":"a","mod\\u0065l":"b"}', "model", id="unicode-escape"),
    pytest.param(b'{"mod\\u0065l":"a","model":"b"}', "model", id="unicode-escape-first"),
    pytest.param(b'{"\\u006d\\u006f\\u0064\\u0065\\u006c":1,"model":2}', "model", id="all-escaped"),
    pytest.param(b'{"a\\"":1,"a\\"":2}', 'a"', id="escaped-quote-in-the-key"),
    pytest.param(b'{"a\\/b":1,"a/b":2}', "a/b", id="escaped-solidus"),
    pytest.param(b'{"\\u00e9":1,"\xc3\xa9":2}', "\u00e9", id="escaped-and-raw-utf8"),
    pytest.param(
        b'{"messages":[{"role":"user","content":"x","content":[{"type":"video_url"}]}]}',
        "content",
        id="nested",
    ),
    pytest.param(b'\xef\xbb\xbf{"model":"a","model":"b"}', "model", id="after-a-bom"),
    pytest.param(b'{"x":{"k":1,"k":1}}', "k", id="same-value"),
    pytest.param(b'[{"k":1},{"k":2,"k":3}]', "k", id="in-an-array"),
]


@pytest.mark.parametrize(("raw", "key"), REPEATED)
def test_a_repeated_key_is_refused_however_it_is_spelled(raw, key):
    problem = parse_json_body(raw)
    assert isinstance(problem, Violation)
    assert problem.code is ErrorCode.INVALID_JSON
    assert "repeats the key" in problem.message
    if key.isascii() and key.isalnum():  # others are named as the body spells them
        assert f"repeats the key {key!r}" in problem.message


DISTINCT = [
    pytest.param(b'{"a":"\\"a\\":1","b":2}', {"a": '"a":1', "b": 2}, id="a-key-inside-a-string"),
    pytest.param(b'{"a":"a:","b":"a"}', {"a": "a:", "b": "a"}, id="colons-in-strings"),
    pytest.param(b'{"a":{"a":{"a":1}}}', {"a": {"a": {"a": 1}}}, id="one-key-at-each-depth"),
    pytest.param(b'[{"k":1},{"k":2}]', [{"k": 1}, {"k": 2}], id="one-key-in-each-object"),
    pytest.param(b'{"a\\"":1,"a":2}', {'a"': 1, "a": 2}, id="an-escaped-quote-makes-another-key"),
    pytest.param(b'{"Model":1,"model":2}', {"Model": 1, "model": 2}, id="case-differs"),
    pytest.param(b'{"k" : 1 , "K" : 2}', {"k": 1, "K": 2}, id="spaced"),
]


@pytest.mark.parametrize(("raw", "parsed"), DISTINCT)
def test_distinct_keys_are_read(raw, parsed):
    assert parse_json_body(raw) == parsed
