"""Encoder-side rewrite ("EPD at the door"): accepted images leave as ``image_embeds`` parts.

For a rule with ``embeds``, the gateway encodes every image of an accepted request with
its encoder adapter and replaces each image part, in place, by the part vLLM takes with
``--enable-mm-embeds``, so the upstream never runs its own vision tower on it::

    {"type": "image_embeds", "image_embeds": B64}                       # string form
    {"type": "image_embeds", "image_embeds": {"image_embeds": B64,      # dict form
                                              "image_grid_thw": B64}}   # (Qwen2-VL family)

``B64`` is base64 of ``torch.save(tensor)`` (what vLLM's ``tensor2base64`` writes and
``torch.load(weights_only=True)`` reads): the embedding ``[tokens, hidden]`` per image,
the grid a ``(3,)`` int64 ``t, h, w`` tensor. See docs/embeds.md for the sources.

The rewrite is all or nothing: on any violation there are no edits, so the upstream never
sees raw images and embeddings mixed (vLLM refuses that mix).

torch is optional (the ``encoder`` extra): it is imported inside the functions that need
it, so importing this module costs nothing on a gateway that never rewrites.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import pybase64

from modalgate.encoder_adapter.protocol import EncoderAdapter
from modalgate.errors import ErrorCode, Violation
from modalgate.gateway.gate.middleware import parsed_request
from modalgate.policy.models import EmbedsSpec, ModelRule
from modalgate.validators.json_body import Location, location_of
from modalgate.validators.verdict import MediaPart, Verdict

if TYPE_CHECKING:
    import torch

    from modalgate.encoder_adapter.protocol import Encoded

__all__ = [
    "Embedded",
    "EmbedsSpec",
    "embeds_image_part",
    "rewrite_to_embeds",
    "tensor_to_b64",
    "unserved_embeds",
]

logger = logging.getLogger("modalgate.embeds")


def tensor_to_b64(tensor: torch.Tensor, dtype: str | None = None) -> str:
    """Base64 of ``torch.save(tensor)`` on the CPU, cast to ``dtype`` (a torch dtype name).

    A tensor that views a larger storage (one image's rows of a batch output) is copied
    first: ``torch.save`` writes the whole storage, which would send every image's
    embedding with each part.
    """
    import torch

    target = getattr(torch, dtype, None) if dtype is not None else tensor.dtype
    if not isinstance(target, torch.dtype):
        raise ValueError(f"not a torch dtype: {dtype!r}")
    out = tensor.detach().to(device="cpu", dtype=target).contiguous()
    if out.untyped_storage().nbytes() != out.numel() * out.element_size():
        out = out.clone()
    with io.BytesIO() as buffer:
        torch.save(out, buffer)
        return pybase64.b64encode(buffer.getbuffer()).decode("ascii")


def embeds_image_part(
    embedding: torch.Tensor,
    grid_thw: Sequence[int] | None,
    spec: EmbedsSpec,
    uuid: str | None = None,
) -> dict[str, Any]:
    """One vLLM ``image_embeds`` content part for one image (CPU work: call it in a thread)."""
    payload: str | dict[str, str] = tensor_to_b64(embedding, spec.dtype)
    if spec.grid_key is not None:
        if grid_thw is None or len(grid_thw) != 3:
            raise ValueError("this rule's embeds need the image's t, h, w grid")
        import torch

        grid = torch.tensor([int(v) for v in grid_thw], dtype=torch.int64)
        payload = {spec.embeds_key: payload, spec.grid_key: tensor_to_b64(grid)}
    elif spec.embeds_key != "image_embeds":
        payload = {spec.embeds_key: payload}  # a dict form without a grid
    part: dict[str, Any] = {"type": "image_embeds", "image_embeds": payload}
    if uuid is not None:
        part["uuid"] = uuid  # the client's cache key for the image stays its cache key
    return part


@dataclass(frozen=True, slots=True)
class Embedded:
    """The violations (each with the part's param), or, when there are none, each image
    part's place in the request and the ``image_embeds`` part that goes there instead."""

    violations: list[Violation]
    edits: list[tuple[Location, dict[str, Any]]]


async def rewrite_to_embeds(
    verdict: Verdict, adapter: EncoderAdapter, spec: EmbedsSpec
) -> Embedded:
    """The ``image_embeds`` part for every image part of the request; nothing is changed
    in place (the caller writes the edits into the body it forwards).

    All images go to the adapter in one ``encode`` call (it batches and caches them).
    ``batching.Overloaded`` propagates: the caller answers 503 with Retry-After.
    Serialising the tensors (megabytes each) runs in a worker thread. Call it after
    remote images were fetched: a part without bytes cannot be encoded.
    """
    request = await parsed_request(verdict)
    if request is None or not verdict.accepted:
        raise ValueError("rewrite_to_embeds needs an accepted verdict with its request")
    images = [part for part in verdict.parts if part.modality == "image"]
    if not images:
        return Embedded([], [])
    slots: list[tuple[list[Any], int]] = []
    problems: list[Violation] = []
    for part in images:
        slot = _slot(request, part.param)
        param = part.payload_param or part.param
        if not part.has_content:
            problems.append(
                Violation(
                    ErrorCode.INVALID_REQUEST,
                    f"{param}: only inline or fetched images can be encoded here (not file ids"
                    " or unfetched URLs)",
                    param,
                )
            )
        elif slot is None:  # the verdict does not describe this request: our bug
            logger.error("image part %s not found in the request", part.param)
            problems.append(Violation(ErrorCode.ENCODER_ERROR, f"{param}: cannot encode", param))
        else:
            slots.append(slot)
    if problems:
        return Embedded(problems, [])
    results = await adapter.encode(await image_bytes(images))
    problems = [
        problem
        for part, result in zip(images, results, strict=True)
        if (problem := _problem(result, part, spec)) is not None
    ]
    if problems:
        return Embedded(problems, [])
    # The id the gate bound (``gate/media_ids.py``), never the client's own.
    uuids = [part.media_id for part in images]
    embedded = await anyio.to_thread.run_sync(_build_parts, results, uuids, spec)
    places = [location_of(part.param) for part in images]
    return Embedded([], list(zip(places, embedded, strict=True)))


def unserved_embeds(
    rules: Iterable[ModelRule], encoders: Collection[str], *, default: bool
) -> list[str]:
    """Startup check: one line per rule whose ``embeds`` no loaded encoder can serve.

    ``rules`` are the rules of the gateway's mode (``RuleMatcher.rules``); ``encoders``
    the ``NAME[:ARG]`` specs loaded for rules; ``default`` says whether ``serve
    --encoder`` gave one for rules without their own. Empty means ready.
    """
    lines = []
    for rule in rules:
        if rule.embeds is None:
            continue
        if rule.encoder is not None and rule.encoder not in encoders:
            lines.append(f"rule {rule.name!r}: 'embeds' needs encoder {rule.encoder!r}, not loaded")
        elif rule.encoder is None and not default:
            lines.append(
                f"rule {rule.name!r}: 'embeds' needs an encoder: give the rule 'encoder:'"
                " or start with --encoder"
            )
    return lines


def _slot(request: dict[str, Any], param: str) -> tuple[list[Any], int] | None:
    """The list holding the part at ``param`` (``messages.[0].content.[2]``) and its index."""
    node: Any = request
    steps = param.split(".")
    for step in steps[:-1]:
        node = _step(node, step)
        if node is None:
            return None
    last = steps[-1]
    if not (isinstance(node, list) and last.startswith("[") and last.endswith("]")):
        return None
    index = int(last[1:-1])
    if not 0 <= index < len(node) or not isinstance(node[index], dict):
        return None
    return node, index


def _step(node: Any, step: str) -> Any:
    if step.startswith("[") and step.endswith("]"):
        index = int(step[1:-1])
        return node[index] if isinstance(node, list) and 0 <= index < len(node) else None
    return node.get(step) if isinstance(node, dict) else None


def _problem(result: Encoded, part: MediaPart, spec: EmbedsSpec) -> Violation | None:
    """The result's own error, or one for an embedding vLLM would mis-take; with the param."""
    param = part.payload_param or part.param
    if result.error is not None:
        return Violation(result.error.code, f"{param}: {result.error.message}", param)
    embedding = result.embedding
    shape = tuple(getattr(embedding, "shape", ()))
    wrong = (
        embedding is None
        or len(shape) != 2
        or (spec.hidden_size is not None and shape[1] != spec.hidden_size)
        or (spec.grid_key is not None and result.grid_thw is None)
    )
    if not wrong:
        return None
    logger.error(
        "encoder output for %s does not fit the rule: shape %s, hidden_size %s, grid %s",
        part.param,
        shape,
        spec.hidden_size,
        result.grid_thw,
    )
    return Violation(
        ErrorCode.ENCODER_ERROR, f"{param}: the encoder's output does not fit this model", param
    )


def _build_parts(
    results: Sequence[Encoded], uuids: Sequence[str | None], spec: EmbedsSpec
) -> list[dict[str, Any]]:
    return [
        embeds_image_part(result.embedding, result.grid_thw, spec, uuid)
        for result, uuid in zip(results, uuids, strict=True)
    ]


async def image_bytes(images: Sequence[MediaPart]) -> list[bytes]:
    """The images' decoded bytes for an encoder: a payload the verdict cache spared from
    decoding (``MediaPart.content``) is decoded here, in a worker thread, not on the loop."""
    if all(part.data is not None for part in images):
        return [part.data or b"" for part in images]
    return await anyio.to_thread.run_sync(lambda: [part.content() or b"" for part in images])
