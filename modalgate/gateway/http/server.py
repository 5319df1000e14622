"""``modalgate serve`` under uvicorn: one process, or ``--workers N`` sharing the port.

With several workers uvicorn starts each in its own process and each builds its
own gateway (``worker_app``, a factory), so the settings travel to them as the
``MODALGATE_*`` variables ``create_app()`` reads: the ones resolved here from
flags, environment and the policy's ``server:`` section, which the workers then
read back to the same values. Metrics go to Prometheus's multiprocess files in a
directory made here and removed when the last worker is gone, so any worker's
``/metrics`` counts every worker's requests.

In both forms the gateway drains on SIGTERM (``service/drain.py``): the drain is
the grace period, and uvicorn's own shutdown after it gets only ``HANDOVER_S``
for requests that arrived meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
import tempfile
from functools import partial
from typing import Any

import uvicorn
from pydantic import SecretStr
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess

from modalgate.gateway.app import Gateway, StartupError, create_app
from modalgate.gateway.gate.media_ids import deployment_secret
from modalgate.gateway.http.protocol import ServeHttpProtocol
from modalgate.gateway.observability.logs import uvicorn_log_config
from modalgate.gateway.observability.metrics import MULTIPROC_DIR_VARIABLE
from modalgate.settings import GatewaySettings, env_name

HANDOVER_S = 1.0
# glibc's mallopt parameters (malloc.h) and what ``reuse_big_buffers`` sets them to.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 128 * 1024 * 1024


def run_single(gateway: Gateway, settings: GatewaySettings) -> None:
    gateway.drain.enabled = True
    freeze_startup_heap()
    reuse_big_buffers()
    uvicorn.run(gateway, **_options(settings))


def run_workers(settings: GatewaySettings) -> bool:
    """``settings.workers`` processes, until the last has exited; False when one failed to
    start (its reason is its own one line; uvicorn then stops them all)."""
    with tempfile.TemporaryDirectory(prefix="modalgate-metrics-") as metrics_dir:
        os.environ.update(settings_environment(settings))
        os.environ[MULTIPROC_DIR_VARIABLE] = metrics_dir  # read as the workers import
        deployment_secret()  # drawn here if not given: every worker binds media ids alike
        config = uvicorn.Config(
            f"{__name__}:worker_app", factory=True, workers=settings.workers, **_options(settings)
        )
        supervisor = Multiprocess(config, sockets=[config.bind_socket()])
        with contextlib.suppress(KeyboardInterrupt):
            supervisor.run()
    return all(process.exitcode != STARTUP_FAILURE for process in supervisor.processes)


def worker_app() -> Gateway:
    """The factory each worker calls: the gateway ``MODALGATE_*`` describes, draining on
    SIGTERM; a problem is one line and uvicorn's start-up failure (the parent stops)."""
    try:
        gateway = create_app()
    except StartupError as exc:
        print(str(exc), file=sys.stderr)
        sys.exit(STARTUP_FAILURE)
    gateway.drain.enabled = True
    freeze_startup_heap()
    reuse_big_buffers()
    return gateway


def freeze_startup_heap() -> None:
    """Keep what start-up built (modules, the policy, pydantic's and torch's objects) out
    of every later garbage collection: each full collection walked all of it again, ~4%
    of the gateway's CPU under load (perf, ``benchmarks/p7_proxies.py``'s text load).
    Only ``modalgate serve`` does this: an app mounted elsewhere leaves its host's
    collector alone."""
    gc.collect()
    gc.freeze()


def reuse_big_buffers() -> bool:
    """Have glibc's malloc serve request-sized buffers from memory it keeps, not fresh pages.

    Every request body passes through buffers of its own size (the server's, the gate's
    join, the decoded JSON string). Above 128 KiB glibc maps each one anew and unmaps it
    when freed, so every page of every big body is faulted in and zeroed again: half the
    CPU a server spent receiving a 1 MB body (``perf``; 0.5 ms instead of 0.9-1.1 ms). With
    these thresholds blocks up to ``MMAP_THRESHOLD_BYTES`` come from the heap, and up to
    ``TRIM_THRESHOLD_BYTES`` of freed heap is kept for the next request, as tcmalloc keeps
    Envoy's. False (nothing changed) where the C library is not glibc.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def settings_environment(settings: GatewaySettings) -> dict[str, str]:
    """Every setting that has a value, as the variable that sets it to that value."""
    environment = {}
    for name in GatewaySettings.model_fields:
        value = getattr(settings, name)
        if value is None or value == ():
            continue
        environment[env_name(name)] = _text(value)
    return environment


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):  # keys: comma separated, as MODALGATE_API_KEYS reads them
        return ",".join(v.get_secret_value() if isinstance(v, SecretStr) else str(v) for v in value)
    return str(value)


def _options(settings: GatewaySettings) -> dict[str, Any]:
    return {
        "host": settings.host,
        "port": settings.port,
        "log_config": uvicorn_log_config(settings.log_level, settings.log_format),
        "access_log": False,  # RequestId writes the access log, with the request id
        # The drain (service/drain.py) is the grace period; this covers requests that
        # arrive while the listening socket closes.
        "timeout_graceful_shutdown": min(settings.grace_period_s, HANDOVER_S),
        "server_header": False,  # the upstream's own Server and Date headers pass through
        "date_header": False,
        # X-Forwarded-For is passed on as a chain, not folded into the client address.
        "proxy_headers": False,
        "lifespan": "on",
        # Request bodies whole, a small response in one write, a silent or slow client
        # timed out, a head's size capped (gateway/http/protocol.py).
        "http": partial(
            ServeHttpProtocol,
            read_timeout_s=settings.client_timeout_s,
            max_header_bytes=settings.max_header_bytes,
            head_timeout_s=settings.client_header_timeout_s,
            body_timeout_s=settings.client_body_timeout_s,
            body_min_rate=settings.client_body_min_rate,
        ),
    }
