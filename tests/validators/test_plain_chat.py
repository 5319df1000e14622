"""The short way for text-only chat (``request._plain_chat``) gives the whole walk's verdict.

``validate_request`` judges a chat request whose messages are all plain (a string
``role`` and ``content``, no reasoning key) without building a ``VerdictBuilder``;
every other request, however close to plain, takes the whole walk. Each body here
is judged both ways, the short way switched off for the reference: the verdicts
must be equal, field for field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest

from modalgate.policy import RuleMatcher, load_policy, parse_policy
from modalgate.settings import EngineSpec
from modalgate.validators import Verdict, validate_body, validate_request
from modalgate.validators import request as request_module
from modalgate.validators.dialects import SGLANG, Dialect, dialect_for

VLLM = dialect_for(EngineSpec(name="vllm"))
VLLM_TRUSTING = dialect_for(EngineSpec(name="vllm", trust_request_mm_kwargs=True))
DIALECTS: dict[str, Dialect | None] = {
    "none": None,
    "sglang": SGLANG,
    "vllm": VLLM,
    "vllm-trusting": VLLM_TRUSTING,
}
BUILT_IN = RuleMatcher(load_policy(), None)
STRICT = RuleMatcher(
    parse_policy(
        """
unknown_models: reject
default_model: small
limits: {max_body_bytes: 100000}
models:
  - name: small
    accepts: [image]
    limits: {max_body_bytes: 400}
  - name: on-vllm
    accepts: [image]
    engine: vllm
""",
        fmt="yaml",
    ),
    None,
)


class Subclassed(dict):
    """Not what a JSON parse makes: the whole walk judges it."""


USER = {"role": "user", "content": "hello"}
SYSTEM = {"role": "system", "content": "be brief"}

MESSAGES: dict[str, list[Any]] = {
    "plain": [SYSTEM, USER],
    "one": [USER],
    "named": [{"role": "user", "content": "hi", "name": "ann"}],
    "reasoning text": [USER, {"role": "assistant", "content": "ok", "reasoning": "because"}],
    "reasoning parts": [
        USER,
        {
            "role": "assistant",
            "content": "ok",
            "reasoning_content": [{"type": "text", "text": "x"}],
        },
    ],
    "reasoning not text": [{"role": "assistant", "content": "ok", "reasoning": 3}],
    "content null": [{"role": "assistant", "content": None}],
    "content missing": [{"role": "user"}],
    "content parts": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    "content number": [{"role": "user", "content": 5}],
    "role missing": [{"content": "x"}],
    "role number": [{"role": 1, "content": "x"}],
    "odd role": [{"role": "wizard", "content": "x"}],
    "upper role": [{"role": "USER", "content": "x"}],
    "a list": [USER, ["role", "content"]],
    "a string": ["hello"],
    "null": [None],
    "empty": [],
    "dict subclass": [Subclassed(USER)],
    "str subclass content": [{"role": "user", "content": type("S", (str,), {})("x")}],
}


def both_ways(
    monkeypatch: pytest.MonkeyPatch, judge: Callable[[], Verdict]
) -> tuple[Verdict, Verdict]:
    short = judge()
    with monkeypatch.context() as patched:
        patched.setattr(request_module, "_plain_chat", lambda *_: False)
        whole = judge()
    return short, whole


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("case", MESSAGES)
def test_the_short_way_and_the_whole_walk_agree(monkeypatch, case, dialect):
    request = {"model": "kimi-k3", "messages": MESSAGES[case]}
    of = DIALECTS[dialect]

    def judge() -> Verdict:
        return validate_request(
            request, BUILT_IN, 300, dialect=None if of is None else lambda _r: of
        )

    short, whole = both_ways(monkeypatch, judge)
    assert short == whole
    assert type(short) is Verdict


@pytest.mark.parametrize(
    "request_",
    [
        {"model": "kimi-k3", "messages": [USER], "mm_processor_kwargs": {"x": 1}},
        {"model": "kimi-k3", "messages": [USER], "media_io_kwargs": {"video": {}}},
        {"model": "kimi-k3", "messages": [USER], "mm_processor_kwargs": {}},
        {"model": "kimi-k3", "messages": [USER], "use_audio_in_video": True},
        {"model": "kimi-k3", "messages": {"role": "user"}},
        {"model": "kimi-k3"},
        {"model": 7, "messages": [USER]},
        {"messages": [USER]},
        {"model": "", "messages": [USER]},
        {"model": "nobody", "messages": [USER]},
        {"model": "small", "messages": [USER]},
        {"model": "small", "messages": [USER], "padding": "x" * 500},
        {"model": "on-vllm", "messages": []},
        {"model": "on-vllm", "messages": [USER], "mm_processor_kwargs": {"x": 1}},
        {"model": "SMALL", "messages": [USER]},
    ],
)
@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
@pytest.mark.parametrize("matcher", [BUILT_IN, STRICT], ids=["built-in", "strict"])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_request_level_check_is_kept(monkeypatch, request_, api, matcher, dialect):
    body = orjson.dumps(request_)
    of = DIALECTS[dialect]

    def judge() -> Verdict:
        return validate_body(body, matcher, api, None, None if of is None else lambda _r: of)

    short, whole = both_ways(monkeypatch, judge)
    assert short == whole


@pytest.mark.parametrize("serving", [None, "small", "on-vllm", "nobody"])
def test_a_request_judged_as_the_model_its_server_serves(monkeypatch, serving):
    body = orjson.dumps({"model": "whatever", "messages": [SYSTEM, USER]})

    def judge() -> Verdict:
        return validate_body(body, STRICT, "chat", lambda _name, _rule: serving)

    short, whole = both_ways(monkeypatch, judge)
    assert short == whole
