"""deploy/k8s as written: the core manifests valid against the Kubernetes schemas
(``kubernetes-validate``, strict, offline), the Deployment's command a real
``modalgate extproc`` that starts and answers its gRPC health on the ports the probes
name, and the Envoy Gateway and Gateway API resources checked by structure.

No schema of the ``EnvoyExtensionPolicy`` and ``HTTPRoute`` CRDs ships in a Python
package, so ``test_the_envoy_gateway_resources_attach_the_processor`` checks, field by
field, what Envoy Gateway's API reference (v1.2+) requires of them: the kinds and API
versions, that the policy targets the route by name, that its backend is the
processor's Service on its gRPC port, a body mode Envoy Gateway knows, and fail closed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import REPO_ROOT, free_port
from gateway_proc import MODALGATE, GatewayProcess
from modalgate.gateway.cli import _parser
from modalgate.settings import GatewaySettings, env_name

K8S = REPO_ROOT / "deploy" / "k8s"
CORE_KINDS = {
    "ConfigMap",
    "Deployment",
    "Service",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
}
BODY_MODES = {"Buffered", "Streamed", "BufferedPartial", "FullDuplexStreamed"}


def documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def one(kind: str) -> dict[str, Any]:
    (doc,) = [doc for _, doc in documents() if doc["kind"] == kind]
    return doc


@pytest.mark.parametrize(
    ("name", "doc"),
    [(name, doc) for name, doc in documents() if doc["kind"] in CORE_KINDS],
    ids=lambda value: value if isinstance(value, str) else value["kind"],
)
def test_the_core_manifests_are_valid_kubernetes(name, doc):
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_kustomization_lists_every_manifest():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(listed) == sorted(on_disk)
    assert {doc["kind"] for _, doc in documents()} == CORE_KINDS | {
        "HTTPRoute",
        "EnvoyExtensionPolicy",
    }


def container() -> dict[str, Any]:
    (only,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return only


def test_the_processor_runs_as_a_locked_down_non_root_user():
    pod = one("Deployment")["spec"]["template"]["spec"]
    dockerfile = (REPO_ROOT / "deploy" / "Dockerfile").read_text()
    uid = re.search(r"--uid (\d+)", dockerfile).group(1)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == uid  # the image's own user
    context = container()["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"]["drop"] == ["ALL"]
    assert "cpu" in container()["resources"]["requests"]


def test_the_command_is_a_real_extproc_with_real_settings():
    args = _parser().parse_args(container()["args"])
    assert args.command == "extproc"
    for variable in container().get("env", []):
        names = {env_name(field) for field in GatewaySettings.model_fields}
        assert variable["name"] in names, variable
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert args.listen.endswith(f":{ports['grpc']}")
    assert args.port == ports["http-metrics"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container()[probe]["grpc"]["port"] == ports["grpc"]
    mount = container()["volumeMounts"][0]["mountPath"]
    assert Path(args.policy).parent == Path(mount)
    service_ports = {p["name"]: p["targetPort"] for p in one("Service")["spec"]["ports"]}
    assert service_ports == {"grpc": "grpc", "http-metrics": "http-metrics"}


def test_the_deployments_command_starts_and_answers_its_probes(tmp_path):
    """The container's args, run here: its policy from the ConfigMap, its ports free."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(one("ConfigMap")["data"]["policy.yaml"])
    grpc_port = free_port()
    args = []
    for arg in container()["args"]:
        if arg.startswith("--listen="):
            arg = f"--listen=127.0.0.1:{grpc_port}"
        elif arg.startswith("--host="):
            arg = "--host=127.0.0.1"
        elif arg.startswith("--port="):
            arg = "--port={port}"
        elif arg.startswith("--policy="):
            arg = f"--policy={policy}"
        args.append(arg)
    with GatewayProcess(command=[*MODALGATE, *args]) as processor:
        processor.wait_ready()
        service = container()["readinessProbe"]["grpc"]["service"]
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_the_envoy_gateway_resources_attach_the_processor():
    route, policy = one("HTTPRoute"), one("EnvoyExtensionPolicy")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert policy["apiVersion"] == "gateway.envoyproxy.io/v1alpha1"
    (target,) = policy["spec"]["targetRefs"]
    assert target == {
        "group": "gateway.networking.k8s.io",
        "kind": "HTTPRoute",
        "name": route["metadata"]["name"],
    }
    (ext_proc,) = policy["spec"]["extProc"]
    (backend,) = ext_proc["backendRefs"]
    service = one("Service")
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert backend == {"name": service["metadata"]["name"], "port": grpc_port}
    assert ext_proc["processingMode"]["request"]["body"] in BODY_MODES
    assert ext_proc["failOpen"] is False
    assert re.fullmatch(r"\d+(ms|s)", ext_proc["messageTimeout"])
