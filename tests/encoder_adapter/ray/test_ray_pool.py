"""The encoder pool on a real local Ray Serve (``pytest -m ray``): two CPU replicas of a tiny Kimi.

One Ray instance (``ray.init(num_cpus=2)``, no dashboard) and one deployed pool serve
the whole module: starting them is most of the group's time. The order of the tests
matters once: ``test_killing_a_replica_mid_request`` kills a replica, the gateway
tests run while Serve starts its replacement, and ``test_the_pool_recovers`` waits
for it last.
"""

from __future__ import annotations

import asyncio
import functools
import io
import os
import shlex
import signal
import struct
import sys
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from conftest import MP4_BYTES, chat, data_url, image_part, noise_png, serve
from gateway_proc import GatewayProcess
from kimi_tiny import save_full_checkpoint
from modalgate.encoder_adapter import Overloaded, create_encoder
from modalgate.encoder_adapter.kimi.adapter import KimiEncoderAdapter
from modalgate.encoder_adapter.ray.cli import add_ray_commands
from modalgate.encoder_adapter.ray.client import RayServeEncoder
from modalgate.encoder_adapter.ray.contract import ADDRESS_ENV
from modalgate.encoder_adapter.ray.serve import PoolConfig, deploy
from modalgate.gateway.app import create_app
from modalgate.policy import parse_policy

pytestmark = pytest.mark.ray

APP = "mg-test-pool"
SIZES = [(60, 45), (30, 100), (28, 28), (200, 90)]


@functools.cache
def _big_png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (2000, 2000), (10, 120, 30)).save(buffer, "PNG")
    return buffer.getvalue()


def heavy_request(seed: int, count: int = 16) -> list[bytes]:
    """Distinct 2000x2000 PNGs, ~16 KB each but ~0.1 s each to decode and resize: a replica
    is surely still busy with the request a moment later. Distinct bytes (a tEXt chunk
    before IEND) so the replica's cache serves none of them; made without re-encoding."""
    base = _big_png()
    out = []
    for i in range(count):
        text = b"n\x00%d" % (seed * 1000 + i)
        chunk = struct.pack(">I", len(text)) + b"tEXt" + text
        chunk += struct.pack(">I", zlib.crc32(b"tEXt" + text))
        out.append(base[:-12] + chunk + base[-12:])  # the last 12 bytes are IEND
    return out


@dataclass
class Pool:
    checkpoint: Path
    address: str
    encoder: RayServeEncoder
    gateway: GatewayProcess  # ``modalgate serve --encoder ray:APP``, started with the pool


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Iterator[Pool]:
    """A local Ray (2 CPUs, no dashboard), Serve without HTTP proxies, the pool (2 replicas),
    and a gateway process, which starts while the replicas do: both take seconds."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray
    from ray import serve

    checkpoint = tmp_path_factory.mktemp("kimi_ray")
    save_full_checkpoint(checkpoint)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    gateway = None
    try:
        serve.start(proxy_location="Disabled")
        config = PoolConfig(f"kimi:{checkpoint}", num_replicas=2, health_check_period_s=1.0)
        deploy(config, APP, wait=False)
        address = ray.get_runtime_context().gcs_address
        gateway = start_gateway(address)
        deadline = time.monotonic() + 120
        while serve.status().applications[APP].status != "RUNNING":
            assert time.monotonic() < deadline, serve.status().applications[APP]
            time.sleep(0.2)
        # One call per request: the tests about spreading count calls per replica.
        encoder = RayServeEncoder(APP, health_interval_s=0.5, coalesce_ms=0)
        try:
            yield Pool(checkpoint, address, encoder, gateway)
        finally:
            asyncio.run(encoder.close())
    finally:
        if gateway is not None:
            gateway.stop()
            gateway.log_path.unlink(missing_ok=True)
        ray.shutdown()  # the whole local cluster, Serve and replicas with it


def run(coro):
    return asyncio.run(coro)


def local_results(checkpoint: Path, images: list[bytes]):
    adapter = KimiEncoderAdapter(checkpoint, device="cpu")

    async def go():
        try:
            return await adapter.encode(images)
        finally:
            await adapter.close()

    return run(go())


def test_results_equal_the_local_adapters(pool):
    images = [noise_png(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
    images.append(b"\x89PNG\r\n\x1a\n broken")
    remote = run(pool.encoder.encode(images))
    local = local_results(pool.checkpoint, images)
    for got, want in zip(remote[:-1], local[:-1], strict=True):
        assert got.error is None
        assert isinstance(got.embedding, torch.Tensor) and got.embedding.dtype == torch.float32
        assert got.grid_thw == want.grid_thw
        torch.testing.assert_close(got.embedding, want.embedding, rtol=1e-5, atol=1e-6)
    # A violation made in the replica travels back as itself.
    assert remote[-1].embedding is None
    assert remote[-1].error is not None and remote[-1].error.code.value == "invalid_image"
    assert run(pool.encoder.encode([])) == []


def test_serve_batch_gives_the_same_results(pool):
    """The @serve.batch path of the same replicas: concurrent requests merged by Ray Serve."""
    encoder = RayServeEncoder(APP, batching="serve", coalesce_ms=0)  # merging left to Serve
    images = [noise_png(40 + i, 30 + i, 50 + i) for i in range(12)]

    async def go():
        before = {i["replica"]: i["calls"] for i in await encoder.info()}
        try:
            answers = await asyncio.gather(*(encoder.encode([image]) for image in images))
            after = {i["replica"]: i["calls"] for i in await encoder.info()}
            return [a[0] for a in answers], sum(after.values()) - sum(before.values())
        finally:
            await encoder.close()

    results, calls = run(go())
    for got, want in zip(results, local_results(pool.checkpoint, images), strict=True):
        torch.testing.assert_close(got.embedding, want.embedding, rtol=1e-5, atol=1e-6)
    assert calls < len(images)  # @serve.batch merged concurrent requests


def test_concurrent_requests_share_a_call(pool):
    """The gateway's coalescing (the default): one Serve call for requests arriving together,
    each request its own slice of the answer, in order."""
    encoder = RayServeEncoder(APP, coalesce_ms=20)
    requests = [
        [noise_png(36 + i, 30, 600 + 2 * i), noise_png(30, 36 + i, 601 + 2 * i)] for i in range(6)
    ]

    async def go():
        try:
            return await asyncio.gather(*(encoder.encode(r) for r in requests))
        finally:
            await encoder.close()

    answers = run(go())
    assert encoder.calls < len(requests)
    flat = local_results(pool.checkpoint, [image for r in requests for image in r])
    got = [result for answer in answers for result in answer]
    assert [len(a) for a in answers] == [2] * len(requests)
    for result, want in zip(got, flat, strict=True):
        torch.testing.assert_close(result.embedding, want.embedding, rtol=1e-5, atol=1e-6)


def test_requests_spread_over_both_replicas(pool):
    before = dict(pool.encoder.replicas)
    images = [noise_png(48, 48, 300 + i) for i in range(24)]

    async def go():
        await asyncio.gather(*(pool.encoder.encode([image]) for image in images))
        return await pool.encoder.info()

    info = run(go())
    served = {r for r, n in pool.encoder.replicas.items() if n > before.get(r, 0)}
    assert served == {i["replica"] for i in info}, (served, info)
    assert len(served) == 2


def test_a_full_replica_queue_is_overloaded(pool):
    """300 distinct images exceed the replica adapter's queue (256): its Overloaded crosses
    the hop as data and is raised again on this side (503 + Retry-After at the gateway)."""
    images = [noise_png(28, 28, 5000 + i) for i in range(300)]
    with pytest.raises(Overloaded) as refused:
        run(pool.encoder.encode(images))
    assert refused.value.retry_after_s >= 1


def test_no_running_replica_is_503_with_retry_after(pool):
    """A pool whose replicas cannot be placed (a GPU this cluster lacks): refused at once,
    through the CLI's deploy, the adapter, and the gateway."""
    from ray import serve

    parser = ray_parser()
    args = parser.parse_args(
        [
            *shlex.split("ray deploy --name mg-no-gpu --num-gpus 1 --no-wait"),
            *("--encoder", f"kimi:{pool.checkpoint}", "--address", pool.address),
        ]
    )
    assert args.run(args) == 0
    try:
        encoder = RayServeEncoder("mg-no-gpu", unavailable_retry_after_s=7)
        assert not encoder.healthy
        started = time.monotonic()
        with pytest.raises(Overloaded) as refused:
            run(encoder.encode([noise_png(30, 30, 1)]))
        assert refused.value.retry_after_s == 7
        assert time.monotonic() - started < 1
        with serve_gateway(encoder) as url:
            response = httpx.post(
                url + "/v1/encode",
                json=chat(image_part(data_url(noise_png(30, 30, 2)))),
                timeout=30,
            )
        assert response.status_code == 503
        assert response.headers["retry-after"] == "7"
        assert response.json()["error"]["code"] == "encoder_overloaded"
    finally:
        serve.delete("mg-no-gpu", _blocking=False)  # blocking waits out a 20 s grace period


def test_deploy_outlasts_serves_pickle_registry_race(pool, monkeypatch):
    """Serve registers and unregisters modules on cloudpickle's process-wide registry
    without a lock, so a handle's thread in this process can make a deploy's own
    unregister fail (seen once in CI). That error, made by cloudpickle itself, on the
    first try: deploy tries again and the pool is placed."""
    from ray import cloudpickle, serve

    real_run_many = serve.run_many
    calls = []

    def run_many_losing_the_race_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            cloudpickle.unregister_pickle_by_value(sys.modules[__name__])  # never registered
        return real_run_many(*args, **kwargs)

    monkeypatch.setattr(serve, "run_many", run_many_losing_the_race_once)
    config = PoolConfig(f"kimi:{pool.checkpoint}", num_gpus=1)
    try:
        deploy(config, "mg-race", wait=False)
        assert len(calls) == 2
        assert "mg-race" in serve.status().applications
    finally:
        serve.delete("mg-race", _blocking=False)


def test_an_unknown_app_is_refused_at_startup(pool):
    with pytest.raises(LookupError, match="no Ray Serve application 'mg-missing'"):
        create_encoder("ray:mg-missing")


def test_killing_a_replica_mid_request(pool):
    """Strict (no retries): the requests on the dead replica get encoder_error. Retrying:
    they are sent again and succeed. Nothing hangs. The victim holds requests of both."""
    strict = RayServeEncoder(APP, retries=0)
    retrying = RayServeEncoder(APP, retries=1)

    strict_requests = [heavy_request(i) for i in range(6)]
    retry_requests = [heavy_request(10 + i) for i in range(2)]

    async def go():
        # Strict requests, one at a time, until both replicas hold one (the router may
        # well send the first two to the same replica); whichever replica then gets a
        # retrying request holds requests of both adapters.
        strict_tasks: list[asyncio.Future] = []
        sent = sum(i["requests"] for i in await retrying.info())
        for request in strict_requests:
            strict_tasks.append(asyncio.ensure_future(strict.encode(request)))
            sent += 1
            before = await until(
                lambda info, n=sent: sum(i["requests"] for i in info) == n, retrying
            )
            if all(i["ongoing"] for i in before):
                break
        was = {i["replica"]: i for i in before}
        retry_tasks = [asyncio.ensure_future(retrying.encode(r)) for r in retry_requests]

        def holding_both(info: list[dict]) -> dict | None:
            """A replica that got a retrying request and still holds a strict one."""
            for replica in info:
                arrived = replica["requests"] - was[replica["replica"]]["requests"]
                if arrived and replica["ongoing"] > arrived:
                    return replica
            return None

        victim = holding_both(await until(holding_both, retrying))
        os.kill(victim["pid"], signal.SIGKILL)
        strict_done = await asyncio.wait_for(asyncio.gather(*strict_tasks), 60)
        retry_done = await asyncio.wait_for(asyncio.gather(*retry_tasks), 60)
        await strict.close()
        await retrying.close()
        return strict_done, retry_done

    strict_results, retry_results = run(go())
    codes = [{r.error.code.value if r.error else "ok" for r in res} for res in strict_results]
    assert {"encoder_error"} in codes, codes  # the one on the dead replica
    assert all(c in ({"ok"}, {"encoder_error"}) for c in codes)
    assert (strict.failed, strict.retried) == (codes.count({"encoder_error"}), 0)
    assert all(r.error is None for res in retry_results for r in res)
    assert retrying.retried >= 1 and retrying.failed == 0


def test_gateway_end_to_end_through_uvicorn(pool):
    """What ``--encoder ray:APP`` gives (the registry), under uvicorn; and a policy rule."""
    images = [noise_png(60, 45, 1), noise_png(30, 100, 2)]
    before = sum(i["images"] for i in run(pool.encoder.info()))
    encoder = create_encoder(f"ray:{APP}")
    assert isinstance(encoder, RayServeEncoder)
    with serve_gateway(encoder) as url:
        request = chat(*(image_part(data_url(image)) for image in images), model="kimi-k3")
        response = httpx.post(url + "/v1/encode", json=request, timeout=60)
        video = chat(
            {"type": "video_url", "video_url": {"url": data_url(MP4_BYTES, "video/mp4")}},
            model="kimi-k3",
        )
        refused = httpx.post(url + "/v1/encode", json=video, timeout=30)
    assert response.status_code == 200, response.text
    expected = local_results(pool.checkpoint, images)
    for item, want in zip(response.json()["data"], expected, strict=True):
        assert item["grid_thw"] == list(want.grid_thw)
        got = np.frombuffer(pybase64_decode(item["embedding"]), "<f4").reshape(item["shape"])
        np.testing.assert_allclose(got, want.embedding.numpy(), rtol=1e-5, atol=1e-6)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "unsupported_modality"
    after = sum(i["images"] for i in run(pool.encoder.info()))
    assert after - before <= 2  # the video never reached the pool (a new replica may count 0)

    policy = parse_policy(
        f"""
extends: builtin
models:
  - name: pooled-vit
    match: ["acme/pooled-vit*"]
    mode: encoder
    accepts: [image]
    encoder: "ray:{APP}"
""",
        fmt="yaml",
    )
    with serve(create_app(policy=policy, mode="encoder")) as url:
        ok = httpx.post(
            url + "/v1/encode",
            json=chat(image_part(data_url(noise_png(50, 50, 5))), model="acme/pooled-vit-1"),
            timeout=60,
        )
    assert ok.status_code == 200, ok.text
    assert ok.json()["data"][0]["tokens"] == 4


def test_a_gateway_restart_loses_only_in_flight_requests(pool):
    """``modalgate serve --encoder ray:APP`` in its own process: SIGTERM while its requests
    are in the pool; they finish (uvicorn drains) or get a clean JSON error, the process
    exits, and the pool, untouched, serves the next gateway."""
    process, base = pool.gateway.wait_ready(timeout_s=90).process, pool.gateway.url
    bodies = [chat(*(image_part(data_url(p)) for p in heavy_request(900 + k))) for k in range(3)]
    pids = {i["pid"] for i in run(pool.encoder.info())}
    with ThreadPoolExecutor(3) as threads:
        futures = [
            threads.submit(httpx.post, base + "/v1/encode", json=b, timeout=60) for b in bodies
        ]
        run(until(lambda info: any(i["ongoing"] for i in info), pool.encoder))
        process.send_signal(signal.SIGTERM)
        responses = [f.result() for f in futures]
    # uvicorn drains, then re-raises SIGTERM to the handler Ray's driver installed,
    # which exits with 15 after disconnecting from the cluster.
    assert process.wait(30) in (0, 15)
    for response in responses:
        if response.status_code != 200:
            assert response.json()["error"]["code"] in ("encoder_error", "encoder_overloaded")
    assert pids <= {i["pid"] for i in run(pool.encoder.info())}  # no replica restarted
    with serve_gateway(create_encoder(f"ray:{APP}")) as url:
        again = httpx.post(url + "/v1/encode", json=bodies[0], timeout=60)
    assert again.status_code == 200, again.text


def test_the_pool_recovers(pool):
    """Serve replaced the killed replica: two running again, and requests reach the new one
    (once the gateway's router has heard of it: a long poll, usually well under a second)."""
    from ray import serve

    deadline = time.monotonic() + 90
    while True:
        deployments = serve.status().applications[APP].deployments.values()
        running = sum(d.replica_states.get("RUNNING", 0) for d in deployments)
        if running == 2 and pool.encoder.healthy:
            break
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(0.5)
    replicas = {i["replica"] for i in run(pool.encoder.info())}
    before = dict(pool.encoder.replicas)
    for burst in range(20):
        images = [noise_png(48, 48, 7000 + 24 * burst + i) for i in range(24)]
        run(gather_encode(pool.encoder, images))
        served = {r for r, n in pool.encoder.replicas.items() if n > before.get(r, 0)}
        if served == replicas:
            break
        time.sleep(0.25)
    assert served == replicas and len(replicas) == 2, (served, replicas)


def test_cli_print_config_and_usage_errors(capsys):
    parser = ray_parser()
    args = parser.parse_args(
        shlex.split(
            "ray deploy --encoder kimi:/models/k --min-replicas 1 --max-replicas 4 --num-gpus 1 "
            "--print-config"
        )
    )
    assert args.run(args) == 0
    document = yaml.safe_load(capsys.readouterr().out)
    [app] = document["applications"]
    assert app["import_path"] == "modalgate.encoder_adapter.ray.serve:app_builder"
    assert app["args"] == {"spec": "kimi:/models/k"}
    [deployment] = app["deployments"]
    assert deployment["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert deployment["autoscaling_config"]["max_replicas"] == 4
    assert "num_replicas" not in deployment
    bad = parser.parse_args(["ray", "deploy", "--encoder", "kimi:/m", "--replicas", "0"])
    assert bad.run(bad) == 2
    assert "--replicas must be at least 1" in capsys.readouterr().err


# ---------------------------------------------------------------- helpers


def ray_parser():
    import argparse

    parser = argparse.ArgumentParser(prog="modalgate")
    add_ray_commands(parser.add_subparsers(dest="command"))
    return parser


async def until(predicate, encoder: RayServeEncoder, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        info = await encoder.info()
        if predicate(info):
            return info
        assert time.monotonic() < deadline, info
        await asyncio.sleep(0.02)


async def gather_encode(encoder: RayServeEncoder, images: list[bytes]) -> None:
    results = await asyncio.gather(*(encoder.encode([image]) for image in images))
    assert all(r[0].error is None for r in results)


def serve_gateway(encoder):
    return serve(create_app(policy=None, mode="encoder", encoder=encoder))


def start_gateway(address: str) -> GatewayProcess:
    """The command users run, started now; ``wait_ready`` before sending it requests."""
    script = Path(sys.executable).with_name("modalgate")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "modalgate.gateway.cli"]
    serve_args = f"serve --mode encoder --encoder ray:{APP} --log-level warning --port {{port}}"
    return GatewayProcess(command=[*command, *shlex.split(serve_args)], env={ADDRESS_ENV: address})


def pybase64_decode(text: str) -> bytes:
    import pybase64

    return pybase64.b64decode(text)


def test_the_health_watch_ends_quietly_when_ray_shuts_down(monkeypatch):
    """A status call made while Ray shuts down in this process raises Ray's SystemExit
    in the watching thread: the watch ends there, with no traceback."""
    import threading

    encoder = RayServeEncoder.__new__(RayServeEncoder)  # the watch alone, no cluster
    encoder._stop = threading.Event()
    encoder.health_interval_s = 0.01
    probes: list[int] = []

    def shutting_down() -> bool:
        probes.append(1)
        raise SystemExit(0)

    encoder._probe = shutting_down
    uncaught: list[object] = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    watch = threading.Thread(target=encoder._watch)
    watch.start()
    watch.join(10)
    assert not watch.is_alive() and probes == [1] and uncaught == []
