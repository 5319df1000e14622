"""Media ids bound to the caller and the bytes (``gateway/gate/media_ids.py``), decided by
the gate's own pipeline (``ModalGate(...).decider``) on real Pillow images: what each mode
forwards, references by id alone, the refusals with their codes and params, and the memory's
bounds. tests/gateway/test_media_ids_serve.py drives the same through ``modalgate serve``.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from typing import Any

import orjson
import pytest

from conftest import b64, chat, data_url, image_part, noise_png
from modalgate import ModalGate
from modalgate.gateway.gate.id_store import ENTRY_OVERHEAD_BYTES, MemoryIdStore, Remembered
from modalgate.gateway.gate.media_ids import KEY_PREFIX
from modalgate.gateway.gate.pipeline import Decision
from modalgate.gateway.service.authz import authz_policy
from modalgate.policy import RuleMatcher, load_policy, parse_policy
from modalgate.validators.references import CachedMedia

RED, BLUE = noise_png(64, 48, 1), noise_png(64, 48, 2)
QWEN = "Qwen/Qwen2.5-VL-7B-Instruct"


async def _nothing(scope: Any, receive: Any, send: Any) -> None:  # the app behind: unused
    raise AssertionError("the decider alone is asked")


def gate(policy: str | None = None, engine: str = "vllm") -> ModalGate:
    loaded = parse_policy(f"extends: builtin\n{policy}", fmt="yaml") if policy else None
    return ModalGate(_nothing, policy=loaded, engine=engine, api_keys=())


def decide(gate: ModalGate, request: dict[str, Any], key: str | None = "key-a") -> Decision:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    path = "/inference/v1/generate" if "features" in request or "content_parts" in request else ""
    api = "token_in" if path else "chat"
    return asyncio.run(gate.decider.decide(orjson.dumps(request), api, None, None, headers))


def named(data: bytes | None, media_id: Any, key: str = "image_url") -> dict[str, Any]:
    """An image part with a ``uuid``; ``data`` None: a reference by id alone."""
    payload = {"url": data_url(data)} if data is not None else None
    return {"type": key, key: payload, "uuid": media_id}


def forwarded(decision: Decision) -> dict[str, Any]:
    assert decision.forwards, decision.verdict.violations
    return orjson.loads(decision.body)


def ids(decision: Decision) -> list[Any]:
    return [part.get("uuid") for part in forwarded(decision)["messages"][0]["content"]]


def refusal(decision: Decision) -> tuple[str, str | None]:
    assert not decision.forwards
    first = decision.verdict.violations[0]
    return first.code.value, first.param


def test_bind_gives_each_tenant_and_each_content_its_own_key():
    g = gate()
    a_red = ids(decide(g, chat(named(RED, "photo"))))[0]
    assert a_red.startswith(KEY_PREFIX) and a_red != "photo"
    assert ids(decide(g, chat(named(RED, "photo"))))[0] == a_red  # same tenant, id, bytes
    assert ids(decide(g, chat(named(RED, "photo")), key="key-b"))[0] != a_red
    a_blue = ids(decide(g, chat(named(BLUE, "photo"))))[0]
    assert a_blue not in (a_red, "photo")  # an id reused for other bytes: a new key
    assert ids(decide(g, chat(named(RED, "other"))))[0] != a_red


def test_a_reference_reaches_the_engine_as_the_key_its_fill_did():
    g = gate()
    (filled,) = ids(decide(g, chat(named(RED, "photo"))))
    decision = decide(g, chat({"type": "text", "text": "again"}, named(None, "photo")))
    assert ids(decision) == [None, filled]
    part = decision.verdict.parts[0]
    assert (part.source, part.modality, part.width, part.height, part.format) == (
        "cached",
        "image",
        64,
        48,
        "png",
    )


def test_the_latest_fill_of_an_id_is_the_one_a_reference_names():
    g = gate()
    decide(g, chat(named(RED, "photo")))
    (blue,) = ids(decide(g, chat(named(BLUE, "photo"))))
    assert ids(decide(g, chat(named(None, "photo")))) == [blue]


def test_a_reference_within_the_request_that_fills_it():
    g = gate()
    first, second = ids(decide(g, chat(named(RED, "photo"), named(None, "photo"))))
    assert first == second and first.startswith(KEY_PREFIX)


def test_another_tenants_reference_is_unknown_and_nothing_goes_on():
    g = gate()
    decide(g, chat(named(RED, "photo")))
    decision = decide(g, chat({"type": "text", "text": "hi"}, named(None, "photo")), key="key-b")
    assert refusal(decision) == ("unknown_media_id", "messages.[0].content.[1].uuid")
    assert decision.verdict.status == 400
    assert "'photo'" in decision.verdict.violations[0].message
    anonymous = decide(g, chat(named(None, "photo")), key=None)
    assert refusal(anonymous) == ("unknown_media_id", "messages.[0].content.[0].uuid")


def test_a_reference_to_an_id_never_sent_is_unknown():
    assert refusal(decide(gate(), chat(named(None, "never")))) == (
        "unknown_media_id",
        "messages.[0].content.[0].uuid",
    )


def test_a_refused_request_remembers_nothing():
    g = gate()
    refused = decide(g, chat(named(RED, "photo"), named(None, "unknown")))
    assert refusal(refused) == ("unknown_media_id", "messages.[0].content.[1].uuid")
    assert refusal(decide(g, chat(named(None, "photo"))))[0] == "unknown_media_id"


def test_a_reference_is_judged_as_what_it_names():
    g = gate()
    video = {"type": "video_url", "video_url": None, "uuid": "photo"}
    decide(g, chat(named(RED, "photo"), model=QWEN))
    assert refusal(decide(g, chat(video, model=QWEN))) == (
        "modality_mismatch",
        "messages.[0].content.[0].uuid",
    )
    # Under another model (another rule), the id names nothing this caller sent it.
    assert refusal(decide(g, chat(named(None, "photo"), model="kimi-k3")))[0] == (
        "unknown_media_id"
    )


def test_references_count_in_the_token_budget():
    budget = """
models:
  - name: budgeted
    accepts: [image]
    tokens: {family: fixed, tokens_per_image: 100}
    limits: {max_request_image_tokens: 250}
"""
    g = gate(budget)
    decide(g, chat(named(RED, "photo"), model="budgeted"))
    assert forwarded(decide(g, chat(*[named(None, "photo")] * 2, model="budgeted")))
    decision = decide(g, chat(*[named(None, "photo")] * 3, model="budgeted"))
    assert refusal(decision) == ("too_many_image_tokens", "messages.[0].content.[2].image_url")


def test_a_policy_change_of_the_rule_forgets_what_it_judged():
    rule = "models: [{name: m, accepts: [image], limits: {max_images: %d}}]"
    g = gate(rule % 4)
    decide(g, chat(named(RED, "photo"), model="m"))
    g.set_policy(parse_policy(f"extends: builtin\n{rule % 4}\nenforce: true", fmt="yaml"))
    assert forwarded(decide(g, chat(named(None, "photo"), model="m")))  # the rule is the same
    g.set_policy(parse_policy(f"extends: builtin\n{rule % 3}", fmt="yaml"))
    decision = decide(g, chat(named(None, "photo"), model="m"))
    assert refusal(decision) == ("unknown_media_id", "messages.[0].content.[0].uuid")
    assert "other limits" in decision.verdict.violations[0].message


def test_share_keys_identical_bytes_alike_across_tenants_but_not_references():
    g = gate("media_ids: {mode: share}")
    (a,) = ids(decide(g, chat(named(RED, "photo"))))
    assert ids(decide(g, chat(named(RED, "mine")), key="key-b")) == [a]
    assert ids(decide(g, chat(named(None, "photo")))) == [a]
    assert ids(decide(g, chat(named(BLUE, "photo"))))[0] != a
    assert refusal(decide(g, chat(named(None, "photo")), key="key-b"))[0] == "unknown_media_id"


def test_strip_drops_ids_and_refuses_references():
    g = gate("media_ids: {mode: strip}")
    part = {"type": "text", "image_url": {"url": data_url(RED)}, "uuid": "photo"}
    (sent,) = forwarded(decide(g, chat(part)))["messages"][0]["content"]
    # Read by its payload key because of the id (vLLM), the part keeps that reading.
    assert sent == {"type": "image_url", "image_url": {"url": data_url(RED)}}
    assert refusal(decide(g, chat(named(None, "photo")))) == (
        "media_id_not_allowed",
        "messages.[0].content.[0].uuid",
    )


def test_pass_forwards_the_clients_ids_as_sent():
    g = gate("media_ids: {mode: pass}")
    request = chat(named(RED, "photo"), named(None, "anything"))
    decision = decide(g, request)
    assert decision.body == orjson.dumps(request)


def test_a_rule_may_choose_its_own_mode():
    policy = """
models:
  - name: trusted
    accepts: [image]
    media_ids: pass
"""
    g = gate(policy)
    assert ids(decide(g, chat(named(RED, "photo"), model="trusted"))) == ["photo"]
    assert ids(decide(g, chat(named(RED, "photo"))))[0].startswith(KEY_PREFIX)


def test_refuse_where_the_body_cannot_be_rewritten():
    policy = authz_policy(load_policy())
    assert policy.media_ids.mode == "refuse"
    g = ModalGate(_nothing, policy=policy, engine="vllm", api_keys=())
    decision = decide(g, chat(named(RED, "photo"), named(None, "x")))
    assert [(v.code.value, v.param) for v in decision.verdict.violations] == [
        ("media_id_not_allowed", "messages.[0].content.[0].uuid"),
        ("media_id_not_allowed", "messages.[0].content.[1].uuid"),
    ]
    assert forwarded(decide(g, chat(image_part(data_url(RED)))))  # no id: as before


def test_a_number_for_a_uuid_is_the_id_vllm_reads_and_an_object_is_refused():
    g = gate()
    (number,) = ids(decide(g, chat(named(RED, 42))))
    assert ids(decide(g, chat(named(RED, "42")))) == [number]  # vLLM's str(uuid)
    decision = decide(g, chat(named(RED, {"id": 1})))
    assert refusal(decision) == ("invalid_request", "messages.[0].content.[0].uuid")


def test_parts_without_ids_go_on_untouched():
    request = chat(image_part(data_url(RED)))
    assert decide(gate(), request).body == orjson.dumps(request)


def test_the_tenant_header_names_the_tenant_where_the_policy_says():
    g = gate("media_ids: {tenant_header: X-Tenant}")
    headers_a = [(b"authorization", b"Bearer shared"), (b"x-tenant", b"a")]
    headers_b = [(b"authorization", b"Bearer shared"), (b"x-tenant", b"b")]
    body = orjson.dumps(chat(named(RED, "photo")))
    a = asyncio.run(g.decider.decide(body, "chat", None, None, headers_a))
    b = asyncio.run(g.decider.decide(body, "chat", None, None, headers_b))
    assert ids(a) != ids(b)


def test_token_in_hashes_and_parts_are_bound():
    g = gate("models: [{name: tok, accepts: [image, embeddings]}]")
    tensors = {"pixel_values": b64(b"\x00" * 64)}
    filled = {
        "model": "tok",
        "token_ids": [1, 2, 3],
        "features": {"mm_hashes": {"image": ["h1"]}, "kwargs_data": {"image": [tensors]}},
    }
    (bound,) = forwarded(decide(g, filled))["features"]["mm_hashes"]["image"]
    assert bound.startswith(KEY_PREFIX)
    reference = {**filled, "features": {"mm_hashes": {"image": ["h1"]}}}
    assert forwarded(decide(g, reference))["features"]["mm_hashes"]["image"] == [bound]
    assert refusal(decide(g, reference, key="key-b")) == (
        "unknown_media_id",
        "features.mm_hashes.image.[0]",
    )
    flat = {
        "model": "tok",
        "token_ids": [1],
        "content_parts": [{"type": "image_url", "url": data_url(RED), "uuid": "u"}],
    }
    (part,) = forwarded(decide(g, flat))["content_parts"]
    assert part["uuid"].startswith(KEY_PREFIX)


def test_sglang_hashes_are_dropped():
    g = gate(engine="sglang")
    part = {
        "type": "image_url",
        "image_url": {"url": data_url(RED), "content_hash": "sha256:" + "0" * 64},
    }
    (sent,) = forwarded(decide(g, chat(part)))["messages"][0]["content"]
    assert sent == image_part(data_url(RED))


# ---------------------------------------------------------------- the memory's bounds


def _remembered(key: str) -> Remembered:
    rule = RuleMatcher(load_policy()).resolve("kimi-k3")
    return Remembered(key, CachedMedia("image", rule, 100, 64, 48, 1, None, 1000, "png"))


def test_the_memory_is_bounded_by_entries_bytes_and_age():
    now = [0.0]
    store = MemoryIdStore(3, 10**9, 60.0, clock=lambda: now[0])
    asyncio.run(store.remember(b"t", "r", [(f"id{i}", _remembered(f"k{i}")) for i in range(5)]))
    assert len(store) == 3
    found = asyncio.run(store.recall(b"t", "r", ["id0", "id4"]))
    assert [f.key if f else None for f in found] == [None, "k4"]
    assert asyncio.run(store.recall(b"other", "r", ["id4"])) == [None]
    now[0] = 61.0
    assert asyncio.run(store.recall(b"t", "r", ["id4"])) == [None]
    by_bytes = MemoryIdStore(10**6, 3 * ENTRY_OVERHEAD_BYTES + 300, 60.0)
    asyncio.run(by_bytes.remember(b"t", "r", [(f"id{i}", _remembered(f"k{i}")) for i in range(9)]))
    assert len(by_bytes) == 3 and by_bytes.bytes <= by_bytes.max_bytes


def test_an_entry_costs_no_more_than_it_is_accounted():
    """What 20,000 entries keep alive (tracemalloc: the map, each entry's record and its
    67-character key; the client ids are not kept), against what the store accounts."""
    store = MemoryIdStore(10**6, 10**9, 3600.0)
    rule = RuleMatcher(load_policy()).resolve("kimi-k3")
    count = 20_000
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    fills = [
        (
            f"client-id-{i}",
            Remembered(f"{KEY_PREFIX}{i:064x}", CachedMedia("image", rule, 1000 + i)),
        )
        for i in range(count)
    ]
    asyncio.run(store.remember(b"tenant", "kimi-k3", fills))
    del fills
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    print(f"{kept / count:.0f} bytes kept per entry, {store.bytes / count:.0f} accounted")
    assert kept / count <= store.bytes / count


@pytest.mark.parametrize("mode", ["bind", "isolate", "share", "strip", "refuse", "pass"])
def test_every_mode_is_a_policy_value(mode):
    assert parse_policy(f"media_ids: {{mode: {mode}}}", fmt="yaml").media_ids.mode == mode


def test_isolate_gives_parts_without_an_id_one_bound_to_the_tenant():
    g = gate("media_ids: {mode: isolate}")
    a = forwarded(decide(g, chat(image_part(data_url(RED)))))["messages"][0]["content"][0]
    b = forwarded(decide(g, chat(image_part(data_url(RED))), key="key-b"))
    assert a["uuid"].startswith(KEY_PREFIX)
    assert b["messages"][0]["content"][0]["uuid"] not in (a["uuid"], None)
    assert ids(decide(g, chat(image_part(data_url(RED))))) == [a["uuid"]]  # same tenant, bytes
    # A part whose type is not its payload key would be read otherwise with an id: untouched.
    responses_like = {"type": "input_image", "image_url": data_url(RED), "detail": "auto"}
    assert "uuid" not in forwarded(decide(g, chat(responses_like)))["messages"][0]["content"][0]


def test_bind_leaves_parts_without_an_id_to_the_engines_content_hash():
    request = chat(image_part(data_url(RED)))
    assert decide(gate(), request, key="key-b").body == orjson.dumps(request)
