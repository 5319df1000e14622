"""The installed ``modalgate`` command, run for real in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import (
    MP4_BYTES,
    REPO_ROOT,
    Recorder,
    body,
    chat,
    data_url,
    free_port,
    image_bytes,
    image_part,
    send_body,
    start_server,
)
from modalgate.policy import policy_json_schema

_SCRIPT = Path(sys.executable).with_name("modalgate")
MODALGATE = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "modalgate.gateway.cli"]
BUILTIN = REPO_ROOT / "modalgate" / "policy" / "builtin.yaml"


def run(
    *args: str, stdin: bytes | None = None, cwd: Path | None = None, module: bool = False
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "modalgate.gateway.cli"] if module else MODALGATE
    return subprocess.run(
        [*command, *args],
        input=stdin.decode() if stdin is not None else None,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def _no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stdout + result.stderr


VIDEO_PART = {"type": "video_url", "video_url": {"url": data_url(MP4_BYTES, "video/mp4")}}


@pytest.fixture
def image_request(tmp_path: Path) -> Path:
    file = tmp_path / "image.json"
    file.write_bytes(
        body(
            chat(
                {"type": "text", "text": "what is this?"},
                image_part(data_url(image_bytes("PNG", (64, 48)))),
                image_part(data_url(image_bytes("JPEG", (30, 20)), "image/jpeg")),
            )
        )
    )
    return file


@pytest.fixture
def video_request(tmp_path: Path) -> Path:
    file = tmp_path / "video.json"
    file.write_bytes(body(chat({"type": "text", "text": "what happens?"}, VIDEO_PART)))
    return file


# ---------------------------------------------------------------- validate


@pytest.mark.parametrize("module", [False, True], ids=["script", "python-m"])
def test_validate_accepts_and_lists_media(image_request: Path, module: bool) -> None:
    result = run("validate", str(image_request), module=module)
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)
    assert verdict["accepted"] is True
    assert verdict["model"] == "kimi-k3"
    assert verdict["rule"] == "kimi-k3"
    assert verdict["violations"] == []
    facts = [
        {key: part[key] for key in ("param", "modality", "format", "width", "height")}
        for part in verdict["media"]
    ]
    assert facts == [
        {
            "param": "messages.[0].content.[1]",
            "modality": "image",
            "format": "png",
            "width": 64,
            "height": 48,
        },
        {
            "param": "messages.[0].content.[2]",
            "modality": "image",
            "format": "jpeg",
            "width": 30,
            "height": 20,
        },
    ]
    sizes = [part["bytes"] for part in verdict["media"]]
    assert sizes == [len(image_bytes("PNG", (64, 48))), len(image_bytes("JPEG", (30, 20)))]


def test_validate_video_to_kimi_k3_encoder_is_rejected(video_request: Path) -> None:
    result = run("validate", str(video_request), "--mode", "encoder")
    assert result.returncode == 1
    _no_traceback(result)
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "unsupported_modality"
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "messages.[0].content.[1].type"
    assert "Kimi-K3 encoder mode supports image input only" in error["message"]
    assert error["violations"] == [
        {"code": error["code"], "message": error["message"], "param": error["param"]}
    ]


def test_validate_video_to_kimi_k3_full_mode_uses_the_full_rule(video_request: Path) -> None:
    result = run("validate", str(video_request))
    assert result.returncode == 1
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "unsupported_modality"
    assert "encoder mode" not in error["message"]


def test_validate_video_to_a_video_model_is_accepted(tmp_path: Path) -> None:
    file = tmp_path / "qwen.json"
    file.write_bytes(body(chat(VIDEO_PART, model="Qwen/Qwen2.5-VL-7B-Instruct")))
    result = run("validate", str(file))
    assert result.returncode == 0, result.stdout
    media = json.loads(result.stdout)["media"]
    assert [(m["modality"], m["format"]) for m in media] == [("video", "mp4")]


def test_validate_reads_parts_as_the_engine_named(tmp_path: Path) -> None:
    """--engine: the verdict of the gate in front of that server (docs/policy.md's dialect
    table): SGLang takes ``detail: default``, which OpenAI's schema refuses."""
    url = data_url(image_bytes())
    image = {"type": "image_url", "image_url": {"url": url, "detail": "default"}}
    file = tmp_path / "detail.json"
    file.write_bytes(body(chat(image)))
    refused = run("validate", str(file))
    assert refused.returncode == 1
    error = json.loads(refused.stdout)["error"]
    assert error["code"] == "invalid_request"
    assert error["param"] == "messages.[0].content.[0].image_url.detail"
    assert run("validate", str(file), "--engine", "sglang").returncode == 0
    assert run("validate", str(file), "--engine", "openai").returncode == 1


def test_validate_takes_vllms_parsing_flags(tmp_path: Path) -> None:
    """vLLM refuses per-request processor kwargs unless started with
    --trust-request-mm-kwargs; the flag applies with --engine vllm only."""
    file = tmp_path / "kwargs.json"
    file.write_bytes(body(chat(mm_processor_kwargs={"max_pixels": 1_000_000})))
    assert run("validate", str(file)).returncode == 0  # openai: taken
    refused = run("validate", str(file), "--engine", "vllm")
    assert refused.returncode == 1
    assert json.loads(refused.stdout)["error"]["param"] == "mm_processor_kwargs"
    trusted = run("validate", str(file), "--engine", "vllm", "--trust-request-mm-kwargs")
    assert trusted.returncode == 0
    bad = run("validate", str(file), "--engine", "tgi")
    assert bad.returncode == 2 and "invalid choice: 'tgi'" in bad.stderr
    _no_traceback(bad)


def test_validate_invalid_json_is_rejected_not_a_usage_error(tmp_path: Path) -> None:
    file = tmp_path / "broken.json"
    file.write_text('{"model": "kimi-k3", "messages": [', encoding="utf-8")
    result = run("validate", str(file))
    assert result.returncode == 1
    _no_traceback(result)
    assert json.loads(result.stdout)["error"]["code"] == "invalid_json"


def test_validate_with_custom_policy(tmp_path: Path, image_request: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(
        '[[models]]\nname = "kimi-k3"\naccepts = []\nmessage = "text only here"\n',
        encoding="utf-8",
    )
    result = run("validate", str(image_request), "--policy", str(policy))
    assert result.returncode == 1
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "unsupported_modality"
    assert "text only here" in error["message"]
    assert [v["param"] for v in error["violations"]] == [
        "messages.[0].content.[1].type",
        "messages.[0].content.[2].type",
    ]


def test_validate_custom_policy_rejecting_unknown_models(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("unknown_models: reject\n", encoding="utf-8")
    request = tmp_path / "r.json"
    request.write_bytes(body(chat(model="no-such-model")))
    result = run("validate", str(request), "--policy", str(policy))
    assert result.returncode == 1
    error = json.loads(result.stdout)["error"]
    assert (error["code"], error["param"]) == ("unknown_model", "model")


def test_validate_reads_stdin(image_request: Path) -> None:
    result = run("validate", "-", stdin=image_request.read_bytes())
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["accepted"] is True


def test_validate_reads_stdin_and_rejects(video_request: Path) -> None:
    result = run("validate", "-", "--mode", "encoder", stdin=video_request.read_bytes())
    assert result.returncode == 1
    assert json.loads(result.stdout)["error"]["code"] == "unsupported_modality"


@pytest.mark.parametrize(
    "args",
    [
        ("validate",),
        ("validate", "--bogus", "x.json"),
        ("validate", "--mode"),
        ("frobnicate",),
        (),
    ],
    ids=["missing-request", "unknown-option", "option-without-value", "unknown-command", "none"],
)
def test_usage_errors_exit_2(args: tuple[str, ...]) -> None:
    result = run(*args)
    assert result.returncode == 2
    assert "usage" in result.stderr.lower()
    assert result.stdout == ""
    _no_traceback(result)


def test_validate_unreadable_request_file_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    result = run("validate", str(missing))
    assert result.returncode == 2
    assert str(missing) in result.stderr
    assert result.stdout == ""
    _no_traceback(result)


def test_validate_directory_as_request_exits_2(tmp_path: Path) -> None:
    result = run("validate", str(tmp_path))
    assert result.returncode == 2
    _no_traceback(result)


def test_validate_with_broken_policy_exits_2(tmp_path: Path, image_request: Path) -> None:
    policy = tmp_path / "broken.yaml"
    policy.write_text("models:\n  - {name: x, accepts: [smell]}\n", encoding="utf-8")
    result = run("validate", str(image_request), "--policy", str(policy))
    assert result.returncode == 2
    assert str(policy) in result.stderr
    assert "models.[0].accepts.[0]" in result.stderr
    assert result.stdout == ""
    _no_traceback(result)


def test_validate_with_missing_policy_exits_2(tmp_path: Path, image_request: Path) -> None:
    result = run("validate", str(image_request), "--policy", str(tmp_path / "none.yaml"))
    assert result.returncode == 2
    assert "none.yaml" in result.stderr
    _no_traceback(result)


# ---------------------------------------------------------------- check


def test_check_builtin_file() -> None:
    result = run("check", str(BUILTIN))
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout
    assert "encoder" in result.stdout  # the modes it found


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("good.yaml", "models:\n  - {name: m, match: ['acme/*'], accepts: [image]}\n"),
        ("good.toml", '[[models]]\nname = "m"\naccepts = ["image"]\n'),
        ("good.json", '{"models": [{"name": "m", "accepts": ["image"]}]}'),
    ],
)
def test_check_valid_custom_file(tmp_path: Path, name: str, text: str) -> None:
    file = tmp_path / name
    file.write_text(text, encoding="utf-8")
    result = run("check", str(file))
    assert result.returncode == 0, result.stderr
    assert "1 model rule" in result.stdout


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("typo.yaml", "limits:\n  max_imgaes: 3\n", "limits.max_imgaes"),
        ("modality.yaml", "models:\n  - {name: x, accepts: [smell]}\n", "models.[0].accepts.[0]"),
        ("type.json", '{"limits": {"max_images": "many"}}', "limits.max_images"),
        ("syntax.yaml", "models: [\n", "line "),
        ("syntax.toml", "models = [\n", "TOML"),
        ("syntax.json", '{"models": }', "line 1"),
        ("top.yaml", "- 1\n- 2\n", "mapping"),
        ("policy.ini", "x = 1\n", ".yaml"),
    ],
)
def test_check_broken_file(tmp_path: Path, name: str, text: str, expected: str) -> None:
    file = tmp_path / name
    file.write_text(text, encoding="utf-8")
    result = run("check", str(file))
    assert result.returncode == 1
    assert str(file) in result.stderr
    assert expected in result.stderr
    _no_traceback(result)


def test_check_missing_file(tmp_path: Path) -> None:
    result = run("check", str(tmp_path / "nowhere.yaml"))
    assert result.returncode == 1
    assert "nowhere.yaml" in result.stderr
    _no_traceback(result)


def test_check_needs_a_file() -> None:
    result = run("check")
    assert result.returncode == 2


# ---------------------------------------------------------------- schema


def test_schema_prints_json() -> None:
    result = run("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert schema == policy_json_schema()
    assert "models" in schema["properties"]


# ---------------------------------------------------------------- serve


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                *MODALGATE,
                "serve",
                "--port",
                str(port),
                "--mode",
                "encoder",
                "--log-level",
                "warning",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                pytest.fail(f"modalgate serve exited early: {log.read_text()}")
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"modalgate serve did not become ready: {log.read_text()}")
            time.sleep(0.1)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def test_serve_healthz(server: str) -> None:
    response = httpx.get(f"{server}/healthz", timeout=5)
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def _post(server: str, request: Any) -> httpx.Response:
    return httpx.post(f"{server}/v1/validate", json=request, timeout=10)


def test_serve_validate_accepts(server: str) -> None:
    response = _post(server, chat(image_part(data_url(image_bytes("PNG", (64, 48))))))
    assert response.status_code == 200
    verdict = response.json()
    assert verdict["accepted"] is True
    assert [(m["param"], m["width"], m["height"]) for m in verdict["media"]] == [
        ("messages.[0].content.[0]", 64, 48)
    ]


def test_serve_validate_rejects(server: str) -> None:
    response = _post(server, chat({"type": "text", "text": "what happens?"}, VIDEO_PART))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "unsupported_modality"
    assert error["param"] == "messages.[0].content.[1].type"
    assert "Kimi-K3 encoder mode supports image input only" in error["message"]
    assert error["violations"][0]["code"] == "unsupported_modality"


def test_serve_validate_invalid_json(server: str) -> None:
    response = httpx.post(
        f"{server}/v1/validate",
        content=b'{"model": ',
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_validate_fetch_downloads_and_checks_remote_media(tmp_path):
    png = image_bytes("PNG", (100, 60))
    server = start_server(Recorder(("127.0.0.1", 0), {"/a.png": lambda h: send_body(h, png)}))
    try:
        policy = tmp_path / "p.yaml"
        policy.write_text(
            "extends: builtin\n"
            "media_urls: {schemes: [data, https, http], allow_private: ['127.0.0.1/32']}\n"
        )
        request = tmp_path / "r.json"
        request.write_bytes(body(chat(image_part(server.base + "/a.png"), model="qwen2.5-vl")))
        plain = run("validate", str(request), "--policy", str(policy))
        assert plain.returncode == 0
        assert json.loads(plain.stdout)["media"][0]["width"] is None
        assert server.connections == []
        fetched = run("validate", str(request), "--policy", str(policy), "--fetch")
        assert fetched.returncode == 0, fetched.stdout + fetched.stderr
        [part] = json.loads(fetched.stdout)["media"]
        assert (part["format"], part["width"], part["height"], part["tokens"]) == (
            "png",
            100,
            60,
            8,
        )
        assert len(server.connections) == 1
    finally:
        server.shutdown()


def test_serve_freezes_the_startup_heap_before_serving() -> None:
    """What start-up built is out of the collector's way by the time uvicorn runs; the
    library alone (imported, an app built) leaves the collector as it was."""
    script = (
        "import gc, sys, uvicorn\n"
        "from modalgate.gateway import cli\n"
        "from modalgate.gateway.app import create_app\n"
        "create_app()\n"
        "print('library', gc.get_freeze_count())\n"
        "uvicorn.run = lambda app, **options: print('serve', gc.get_freeze_count(),"
        " options['http'].func.__name__, options['http'].keywords['read_timeout_s'],"
        " options['http'].keywords['max_header_bytes'])\n"
        "sys.exit(cli.main(['serve', '--port', '0', '--client-timeout', '7.5',"
        " '--max-header-bytes', '20000']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["library"] == "0"
    frozen, protocol, read_timeout, max_header_bytes = lines["serve"].split()
    assert int(frozen) > 10_000 and protocol == "ServeHttpProtocol"
    assert (read_timeout, max_header_bytes) == ("7.5", "20000")


def test_serve_keeps_big_buffers_in_the_heap() -> None:
    """Request-sized buffers made and freed as concurrent requests do (several alive at
    once, freed first in, first out): glibc's defaults fault their pages in again and
    again; after ``reuse_big_buffers`` the same memory serves the next ones."""
    script = (
        "import collections, resource, sys\n"
        "from modalgate.gateway.http.server import reuse_big_buffers\n"
        "def faults():\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    alive = collections.deque()\n"
        "    for i in range(400):\n"
        "        alive.append(bytes([i % 256]) * (900_000 + 1000 * (i % 7)))\n"
        "        alive.append(bytearray(alive[-1]))  # a body and its copy\n"
        "        if len(alive) > 8:\n"
        "            alive.popleft(), alive.popleft()\n"
        "    alive.clear()\n"
        "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n"
        "faults()  # glibc's thresholds settle\n"
        "default = faults()\n"
        "if not reuse_big_buffers():\n"
        "    sys.exit(3)\n"
        "print(default, faults())\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if result.returncode == 3:
        pytest.skip("not glibc: mallopt is not there to tune")
    assert result.returncode == 0, result.stderr
    default, tuned = map(int, result.stdout.split())
    assert default > 10_000  # ~220 pages a buffer, most buffers
    assert tuned < default / 4
