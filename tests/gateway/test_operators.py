"""What an operator meets first: the upstream URL as clients write it, a dry run the
OpenAI SDK can read, the start-up line, help for every flag, a README that runs as written.

Real parts throughout: ``modalgate serve`` processes, the toy upstream under uvicorn,
the official openai client.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from conftest import REPO_ROOT, data_url, image_bytes, image_part, serve
from gateway_proc import GatewayProcess
from modalgate.gateway.cli import _parser
from modalgate.gateway.service.dry_run import VERDICT_KEY
from modalgate.policy import RuleMatcher, load_policy
from toy_upstream import ToyUpstream

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

USER = [{"role": "user", "content": "hi"}]
VIDEO = {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}}
PNG = image_part(data_url(image_bytes("PNG", (64, 48))))
README = REPO_ROOT / "README.md"
DEPLOY = REPO_ROOT / "docs" / "deploy.md"


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[ToyUpstream, str]]:
    toy = ToyUpstream()
    with serve(toy.app()) as base:
        yield toy, base


@pytest.fixture(scope="module")
def dry_run() -> Iterator[GatewayProcess]:
    with GatewayProcess() as gateway:
        yield gateway


def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


def chat_paths(toy: ToyUpstream) -> list[str]:
    return [r.path for r in toy.received if r.path != "/v1/models"]


# ---------------------------------------------------------------- the upstream URL


@pytest.mark.parametrize("suffix", ["", "/v1", "/v1/"])
def test_the_default_upstream_is_taken_with_or_without_v1(upstream, suffix):
    toy, base = upstream
    toy.received.clear()
    with GatewayProcess("--upstream", base + suffix) as gateway:
        answer = client(gateway).chat.completions.create(model="kimi-k3", messages=USER)
        assert answer.choices[0].message.content.startswith("toy saw ")
        streamed = client(gateway).chat.completions.create(
            model="kimi-k3", messages=USER, stream=True
        )
        assert [c.choices[0].delta.content for c in streamed] == [f"t{i} " for i in range(5)]
        assert [m.id for m in client(gateway).models.list()] == ["toy"]
    assert chat_paths(toy) == ["/v1/chat/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("suffix", ["", "/v1"])
def test_a_rule_upstream_is_taken_with_or_without_v1(upstream, tmp_path, suffix):
    toy, base = upstream
    toy.received.clear()
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f"models:\n  - {{name: pictures, accepts: [image], upstream: '{base}{suffix}'}}\n",
        encoding="utf-8",
    )
    with GatewayProcess("--policy", str(policy)) as gateway:
        answer = client(gateway).chat.completions.create(
            model="pictures", messages=[{"role": "user", "content": [PNG]}]
        )
        assert answer.choices[0].message.content.startswith("toy saw ")
        assert httpx.get(gateway.url + "/readyz").json()["upstreams"] == {base: {"ready": True}}
    assert chat_paths(toy) == ["/v1/chat/completions"]


# ---------------------------------------------------------------- the dry run


def test_a_dry_run_answers_a_chat_completion_the_sdk_reads(dry_run):
    answer = client(dry_run).chat.completions.create(
        model="kimi-k3", messages=[{"role": "user", "content": [PNG]}]
    )
    assert answer.object == "chat.completion"
    [choice] = answer.choices
    assert choice.finish_reason == "stop"
    assert choice.message.role == "assistant"
    assert choice.message.content == (
        "modalgate accepted this request for 'kimi-k3' (rule 'kimi-k3'): image (png 64x48)."
    )
    assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (0, 0)
    verdict = answer.model_extra[VERDICT_KEY]
    assert (verdict["object"], verdict["accepted"], verdict["rule"]) == (
        "modalgate.verdict",
        True,
        "kimi-k3",
    )
    assert verdict["media"][0]["param"] == "messages.[0].content.[0]"


def test_a_dry_run_streams_when_asked(dry_run):
    stream = client(dry_run).chat.completions.create(
        model="kimi-k3", messages=USER, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert [c.choices[0].delta.content for c in chunks if c.choices] == [
        "modalgate accepted this request for 'kimi-k3' (rule 'kimi-k3'): no media.",
        None,
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, "stop"]
    assert chunks[-1].usage.total_tokens == 0
    assert chunks[0].model_extra[VERDICT_KEY]["accepted"] is True


def test_a_dry_run_answers_a_responses_object_streamed_or_not(dry_run):
    response = client(dry_run).responses.create(model="kimi-k3", input="hi")
    assert response.status == "completed"
    assert response.output_text == (
        "modalgate accepted this request for 'kimi-k3' (rule 'kimi-k3'): no media."
    )
    assert response.model_extra[VERDICT_KEY]["object"] == "modalgate.verdict"
    with client(dry_run).responses.stream(model="kimi-k3", input="hi") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert final.output_text == response.output_text


def test_a_dry_run_still_refuses_as_the_gate_would(dry_run):
    with pytest.raises(openai.BadRequestError) as caught:
        client(dry_run).chat.completions.create(
            model="kimi-k3", messages=[{"role": "user", "content": [VIDEO]}], stream=True
        )
    assert caught.value.code == "unsupported_modality"
    assert caught.value.param == "messages.[0].content.[0].type"
    with pytest.raises(openai.BadRequestError) as caught:
        client(dry_run).responses.create(
            model="kimi-k3", input=[{"role": "user", "content": [VIDEO]}]
        )
    assert caught.value.code == "unsupported_modality"
    assert caught.value.param == "input.[0].content.[0].type"


def test_the_validate_path_still_answers_the_bare_verdict(dry_run):
    answer = httpx.post(
        dry_run.url + "/v1/validate", json={"model": "kimi-k3", "messages": USER}
    ).json()
    assert answer["object"] == "modalgate.verdict"


# ---------------------------------------------------------------- the start-up line


def test_the_start_up_line_says_what_is_in_effect(upstream, tmp_path, monkeypatch):
    _, base = upstream
    monkeypatch.chdir(tmp_path)  # a short path: the log blanks 64+ character runs as base64
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "extends: builtin\n"
        f"models:\n  - {{name: pictures, accepts: [image], upstream: '{base}/v1'}}\n",
        encoding="utf-8",
    )
    with GatewayProcess("--policy", "policy.yaml", "--mode", "encoder", "--upstream", base) as gw:
        line = gw.wait_for_log(lambda r: r.get("event") == "gateway started")
    assert {k: v for k, v in line.items() if k not in ("ts", "level")} == {
        "logger": "modalgate.gateway",
        "event": "gateway started",
        "serving": "proxy",
        "mode": "encoder",
        "policy": "policy.yaml",
        "rules": len(RuleMatcher(load_policy(policy), "encoder").rules),
        "upstreams": f"pictures={base}; default={base}",
        "encoders": None,
        "api_keys": 0,
        "open_paths": "all",
        "shadow": None,
    }


def test_the_start_up_line_of_a_dry_run(dry_run):
    line = dry_run.wait_for_log(lambda r: r.get("event") == "gateway started")
    assert (line["serving"], line["policy"], line["upstreams"], line["mode"]) == (
        "validation service (dry run)",
        "built-in",
        None,
        None,
    )


# ---------------------------------------------------------------- help for every flag


def every_command(
    parser: argparse.ArgumentParser, words: tuple[str, ...] = ("modalgate",)
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield " ".join(words), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from every_command(child, (*words, name))


COMMANDS = dict(every_command(_parser()))


def test_every_flag_of_every_command_says_what_it_does():
    silent = [
        f"{command} {action.option_strings or action.dest}"
        for command, parser in COMMANDS.items()
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction)
        and (not action.help or action.help == argparse.SUPPRESS)
    ]
    assert silent == []
    assert {"modalgate serve", "modalgate ray deploy", "modalgate validate"} <= set(COMMANDS)


# ---------------------------------------------------------------- the README as written


def fenced(text: str, *languages: str) -> list[str]:
    """The fenced blocks in ``languages`` ("" for a plain fence), read fence by fence."""
    blocks: list[str] = []
    language: str | None = None  # None: outside a fence
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if language is None:
                language = line[3:].strip()
                blocks.append("")
            else:
                if language not in languages:
                    blocks.pop()
                language = None
        elif language is not None:
            blocks[-1] += line
    return blocks


def test_the_readme_python_runs_as_written():
    blocks = fenced(README.read_text("utf-8"), "python")
    assert blocks, "the README has no Python example"
    for block in blocks:
        namespace: dict[str, object] = {}
        exec(compile(block, "README.md", "exec"), namespace)  # as a reader would paste it
        with serve(namespace["app"]) as url:  # the mounted gate answers as documented
            refused = httpx.post(
                url + "/v1/chat/completions",
                json={"model": "kimi-k3", "messages": [{"role": "user", "content": [VIDEO]}]},
            )
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "unsupported_modality"


def command_lines(text: str) -> list[str]:
    """Every ``modalgate ...`` invocation in the shell and plain blocks, continuations joined."""
    lines: list[str] = []
    for block in fenced(text, "bash", "console", ""):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0]
            if lines and re.match(r"\s+\[", line):  # the usage's own continuation lines
                lines[-1] += line
                continue
            for segment in re.split(r"&&|\s\|\s", line):
                found = re.search(r"\bmodalgate\s+[a-z].*", segment)
                if found:
                    lines.append(found.group(0))
    return lines


def known_flags(words: list[str]) -> tuple[str, set[str]]:
    """The longest command among COMMANDS that ``words`` start with, and its flags."""
    command = "modalgate"
    for word in words[1:]:
        if f"{command} {word}" not in COMMANDS:
            break
        command = f"{command} {word}"
    flags = {flag for action in COMMANDS[command]._actions for flag in action.option_strings}
    return command, flags


@pytest.mark.parametrize("document", [README, DEPLOY], ids=lambda p: p.name)
def test_the_documented_commands_have_the_flags_they_use(document):
    lines = command_lines(document.read_text("utf-8"))
    assert lines
    for line in lines:
        words = shlex.split(line.replace("[", " ").replace("]", " "))
        command, flags = known_flags(words)
        assert command != "modalgate", line
        used = {w.split("=", 1)[0] for w in words if w.startswith("--")}
        assert used <= flags, (line, used - flags)


def test_the_readme_lists_every_command_and_the_extras_exist():
    text = README.read_text("utf-8")
    listed = {known_flags(shlex.split(line))[0] for line in command_lines(text)}
    top_level = {c for c in COMMANDS if c.count(" ") == 1}
    assert top_level <= {" ".join(c.split()[:2]) for c in listed}
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text("utf-8"))["project"][
        "optional-dependencies"
    ]
    for extra in re.findall(r"pip install -e '\.\[(\w+)\]'", text):
        assert extra in extras, extra
