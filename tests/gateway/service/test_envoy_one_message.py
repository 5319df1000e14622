"""One message each way inside Envoy: deploy/envoy/envoy-extproc-one-message.yaml (request
headers SKIPped, the body BUFFERED with its method and path as attributes and the gate's
headers as metadata; the decision back as dynamic metadata) with ``modalgate extproc``.

What the two-message shape guarantees, held here with the real Envoy and a recording
upstream (the tests are envoy_decisions.py's, shared with the Lua check's).
"""

# Fixtures imported from envoy_decisions are taken as test arguments by name:
# ruff: noqa: F811

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from envoy_decisions import (  # noqa: F401 - the shared tests and their client fixture
    http,
    pools,
    received,
    test_a_clean_body_goes_on_byte_for_byte_with_the_decision,
    test_a_fault_is_refused_with_the_gates_status_code_and_param,
    test_a_rewritten_body_goes_on_with_its_length,
    test_a_text_request_claiming_images_stays_on_the_text_pool,
    test_images_route_to_the_vision_pool_whatever_the_client_claims,
    test_what_the_gate_does_not_judge_goes_on_untouched,
    with_vision_pool,
)
from envoy_proc import config_on_ports, running_envoy
from test_envoy_extproc import Processor

from conftest import REPO_ROOT, free_port

CONFIG = REPO_ROOT / "deploy" / "envoy" / "envoy-extproc-one-message.yaml"


def two_pools(listen: int, text_port: int, vision_port: int, processor: int) -> dict[str, Any]:
    """The deploy config with a vision pool, routed to on the decision's metadata."""
    config = config_on_ports(
        CONFIG, listen, {"model_server": text_port, "modalgate_extproc": processor}
    )
    image = {"string_match": {"contains": "image"}}
    metadata = {"filter": "modalgate", "path": [{"key": "modalities"}], "value": image}
    with_vision_pool(config, vision_port, {"dynamic_metadata": [metadata]})
    return config


@pytest.fixture(scope="module")
def envoy(pools) -> Iterator[str]:
    _, _, text_port, vision_port = pools
    with Processor("--engine", "vllm", "--no-access-log") as processor:
        processor.wait_ready()
        config = two_pools(free_port(), text_port, vision_port, processor.grpc_port)
        with running_envoy(config, "/health") as url:
            yield url
