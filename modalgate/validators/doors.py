"""The engines' doors besides chat and responses whose bodies carry media in shapes of
their own: batch chat, scoring and reranking, Cohere's embed v2, pooling and classify,
token-in generation, SageMaker's ``/invocations``, SGLang's Vertex door, the decision
doors' URL lists, Ollama's base64 images.

Each reader was written from the engine's own request models (vLLM 0.33.0's
``entrypoints/**/protocol.py``, SGLang 0.5.23's ``openai/protocol.py``); each medium
becomes a ``MediaPart`` through the same part reader and ``admit`` as a chat content
part, so the same fault gets the same code wherever it is sent.
"""

from __future__ import annotations

from typing import Any

from modalgate.errors import MAX_LISTED_VIOLATIONS, ErrorCode, Violation, path
from modalgate.policy.matching import ResolvedRule
from modalgate.validators.admission import admit, invalid
from modalgate.validators.dialects import Dialect
from modalgate.validators.endpoints import (
    admit_embeddings,
    walk_completions,
    walk_generate,
    walk_pooling_input,
)
from modalgate.validators.messages import read_content_part, walk_messages
from modalgate.validators.parts import with_url
from modalgate.validators.verdict import PartDraft, VerdictBuilder

# vLLM's ScoreContentPartParam: the part types a scoring input's ``content`` may hold.
_SCORE_PART_TYPES = frozenset({"text", "image_url", "image_embeds", "video_url"})
# Every field a scoring or reranking body names its inputs by (vLLM's four score
# request shapes and its rerank; SGLang's query and items, documents).
_SCORE_FIELDS = ("data_1", "data_2", "queries", "documents", "items", "text_1", "text_2", "query")
# vLLM's token-in content part types (the rest it skips), and their modalities.
_FLAT_PART_TYPES = {"image_url": "image", "audio_url": "audio", "video_url": "video"}
# Keys SGLang reads precomputed embeddings from (lists of floats per input).
_SGLANG_OVERRIDES = ("embed_overrides", "query_embed_overrides", "item_embed_overrides")


def walk_chat_batch(
    request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder, dialect: Dialect
) -> None:
    """vLLM's ``/v1/chat/completions/batch``: ``messages`` is a list of conversations."""
    batch = request.get("messages")
    if not isinstance(batch, list) or not batch:
        verdict.violations.append(invalid("must be a non-empty array of conversations", "messages"))
        return
    for i, conversation in enumerate(batch):
        if len(verdict.violations) >= MAX_LISTED_VIOLATIONS:
            return
        if not isinstance(conversation, list) or not conversation:
            problem = "each conversation must be a non-empty array of messages"
            verdict.violations.append(invalid(problem, path("messages", i)))
            continue
        walk_messages(conversation, rule, verdict, dialect, root=path("messages", i))


def walk_score(
    request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder, dialect: Dialect
) -> None:
    """Scoring and reranking: each input a string (or token ids), or ``{"content": [parts]}``
    whose parts are text, images, image embeddings or videos; SGLang's embedding
    overrides are precomputed embeddings."""
    for field in _SCORE_FIELDS:
        value = request.get(field)
        if value is None:
            continue
        if field == "query" and isinstance(value, list):  # SGLang: one query's parts
            _score_parts(value, field, rule, verdict, dialect)
            continue
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if len(verdict.violations) >= MAX_LISTED_VIOLATIONS:
                return
            where = path(field, i) if isinstance(value, list) else field
            if isinstance(item, dict):  # vLLM: {"content": [parts]}
                content = item.get("content")
                if not isinstance(content, list):
                    problem = "must be an array of content parts"
                    verdict.violations.append(invalid(problem, path(where, "content")))
                    continue
                _score_parts(content, path(where, "content"), rule, verdict, dialect)
            elif isinstance(item, list) and field != "query":  # SGLang: a document's parts
                _score_parts(item, where, rule, verdict, dialect)
    _overrides(request, rule, verdict)


def _score_parts(
    content: list[Any], where: str, rule: ResolvedRule, verdict: VerdictBuilder, dialect: Dialect
) -> None:
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            continue  # text or token ids
        at = path(where, k)
        kind = part.get("type")
        if isinstance(kind, str) and kind not in _SCORE_PART_TYPES:
            verdict.violations.append(
                Violation(
                    ErrorCode.UNSUPPORTED_CONTENT_TYPE,
                    f"{path(at, 'type')}: {kind[:40]!r} parts are not taken in scoring inputs"
                    " (text, image_url, image_embeds, video_url are)",
                    path(at, "type"),
                )
            )
            continue
        read_content_part(part, at, "user", rule, verdict, dialect)


def _overrides(request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder) -> None:
    for field in _SGLANG_OVERRIDES:
        if request.get(field) is not None:
            admit_embeddings(field, field, rule, verdict)


def walk_embed_v2(
    request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder, dialect: Dialect
) -> None:
    """Cohere's ``/v2/embed``: ``images`` (data URLs), or ``inputs[].content`` parts
    (text or ``image_url`` objects)."""
    images = request.get("images")
    if isinstance(images, list):
        for i, image in enumerate(images):
            if len(verdict.violations) >= MAX_LISTED_VIOLATIONS:
                return
            where = path("images", i)
            if not isinstance(image, str):
                verdict.violations.append(invalid("must be a data URL string", where))
                continue
            _admit_url(image, where, where, "image", "image", rule, verdict)
    inputs = request.get("inputs")
    if isinstance(inputs, list):
        for i, item in enumerate(inputs):
            where = path("inputs", i)
            content = item.get("content") if isinstance(item, dict) else None
            if not isinstance(content, list):
                verdict.violations.append(
                    invalid("must be an array of content parts", path(where, "content"))
                )
                continue
            for k, part in enumerate(content):
                if len(verdict.violations) >= MAX_LISTED_VIOLATIONS:
                    return
                read_content_part(part, path(where, "content", k), "user", rule, verdict, dialect)


def _admit_url(
    url: str,
    url_at: str,
    where: str,
    part_type: str,
    modality: str,
    rule: ResolvedRule,
    verdict: VerdictBuilder,
    type_at: str | None = None,
    media_id: str | None = None,
) -> None:
    """A URL or data URL standing alone where a part goes: fetched bytes inline in its place;
    ``media_id``: the ``uuid`` beside it (vLLM's token-in parts)."""
    media = PartDraft(
        param=where, part_type=part_type, modality=modality, role="user", source="url"
    )
    media.type_param = type_at or where
    media.inlinable = True
    if media_id is not None:
        media.media_id, media.id_param = media_id, path(where, "uuid")
    admit(with_url(media, url, url_at), rule, verdict)


def walk_pooling(
    request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder, dialect: Dialect
) -> None:
    """vLLM's ``/pooling`` and ``/classify``: ``input`` (text, tokens, or SGLang-style
    items), ``messages`` (walked by the caller), or an IO-processor plugin's free-form
    ``data``, which the gate cannot read and so refuses."""
    walk_pooling_input(request, rule, verdict)
    if request.get("data") is not None:
        verdict.violations.append(
            invalid(
                "IO-processor plugin 'data' is not read by the gate, so it is not passed on",
                "data",
            )
        )


def walk_token_in(
    request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder, dialect: Dialect
) -> None:
    """vLLM's token-in ``/inference/v1/generate``: precomputed multimodal ``features``
    (processor outputs, by modality) or raw ``content_parts`` (flat URL parts)."""
    parts = request.get("content_parts")
    if isinstance(parts, list):
        for i, part in enumerate(parts):
            if len(verdict.violations) >= MAX_LISTED_VIOLATIONS:
                return
            _flat_part(part, path("content_parts", i), rule, verdict)
    elif parts is not None:
        verdict.violations.append(invalid("must be an array of content parts", "content_parts"))
    features = request.get("features")
    if features is None:
        return
    hashes = features.get("mm_hashes") if isinstance(features, dict) else None
    if not isinstance(hashes, dict):
        verdict.violations.append(invalid("must carry 'mm_hashes' by modality", "features"))
        return
    kwargs = features.get("kwargs_data")
    for modality, items in hashes.items():
        where = path("features", "mm_hashes", str(modality)[:40])
        if modality not in ("image", "video", "audio"):
            verdict.violations.append(
                Violation(
                    ErrorCode.UNSUPPORTED_MODALITY,
                    f"{where}: unknown modality {str(modality)[:40]!r}",
                    where,
                )
            )
            continue
        count = len(items) if isinstance(items, list) else 0
        tensors = kwargs.get(modality) if isinstance(kwargs, dict) else None
        for i in range(count):
            if len(verdict.violations) >= MAX_LISTED_VIOLATIONS:
                return
            data = tensors[i] if isinstance(tensors, list) and i < len(tensors) else None
            if not isinstance(items[i], str):
                verdict.violations.append(invalid("must be a string", path(where, i)))
                continue
            _feature(modality, where, i, data, items[i], rule, verdict)


def _flat_part(part: Any, where: str, rule: ResolvedRule, verdict: VerdictBuilder) -> None:
    """vLLM's token-in part: ``{"type": "image_url", "url": ..., "uuid": ...}``, the URL at the
    top (not in an ``image_url`` object); a part of another type is skipped by vLLM."""
    if not isinstance(part, dict):
        verdict.violations.append(invalid("each content part must be an object", where))
        return
    kind = part.get("type")
    modality = _FLAT_PART_TYPES.get(kind) if isinstance(kind, str) else None
    if modality is None:
        return
    url, media_id = part.get("url"), part.get("uuid")
    if media_id is not None and not isinstance(media_id, str):
        verdict.violations.append(invalid("'uuid' must be a string", path(where, "uuid")))
    elif url is None and media_id is not None:  # an item the engine cached before
        media = PartDraft(
            param=where, part_type=kind, modality=modality, role="user", source="cached"
        )
        media.type_param, media.payload_param = path(where, "type"), path(where, "url")
        media.media_id, media.id_param = media_id, path(where, "uuid")
        admit(media, rule, verdict)
    elif not isinstance(url, str):
        verdict.violations.append(invalid("must be a URL or data URL string", path(where, "url")))
    else:
        at = (where, kind, modality)
        _admit_url(url, path(where, "url"), *at, rule, verdict, path(where, "type"), media_id)


def _feature(
    modality: str,
    where: str,
    index: int,
    data: Any,
    media_hash: str,
    rule: ResolvedRule,
    verdict: VerdictBuilder,
) -> None:
    """One precomputed item: its modality must be one the model takes, and its tensors are
    client embeddings (``accepts: [embeddings]``, as vLLM's ``--enable-mm-embeds``). An
    item with no tensors refers to one the engine cached before: it counts as its modality."""
    at = path(where, index)
    if data is None:
        media = PartDraft(
            param=at, part_type="features", modality=modality, role="user", source="cached"
        )
        media.type_param = media.payload_param = at
        media.media_id, media.id_param = media_hash, at
        admit(media, rule, verdict)
        return
    if modality not in rule.accepts:
        media = PartDraft(
            param=at, part_type="features", modality=modality, role="user", source="embeds"
        )
        media.type_param = at
        admit(media, rule, verdict)  # refused for its modality, with the rule's message
        return
    media = PartDraft(
        param=at, part_type="features", modality="embeddings", role="user", source="embeds"
    )
    # The tensors sit apart from their hash; ``format`` names the modality they stand for
    # (what a later reference to the hash must claim).
    media.type_param, media.format = at, modality
    media.payload_param = path("features", "kwargs_data", modality, index)
    media.media_id, media.id_param = media_hash, at
    admit(media, rule, verdict)


def walk_vertex(
    request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder, dialect: Dialect
) -> None:
    """SGLang's ``/vertex_generate``: ``{"instances": [...], "parameters": {...}}``, each
    instance's ``image_data`` and embeddings, and ``parameters`` spread into the native
    generate request (so they may carry any of its media fields)."""
    instances = request.get("instances")
    if isinstance(instances, list):
        for i, instance in enumerate(instances):
            if isinstance(instance, dict):
                walk_generate(instance, rule, verdict, root=path("instances", i))
    parameters = request.get("parameters")
    if isinstance(parameters, dict):
        walk_generate(parameters, rule, verdict, root="parameters")


# The URL lists of vLLM's and SGLang's decision doors, with their modalities.
_MEDIA_LISTS = (("images", "image"), ("videos", "video"), ("audio", "audio"))


def walk_media_lists(
    request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder, dialect: Dialect
) -> None:
    """``/v1/systemone`` and ``/v1/decisions``: ``images``, ``videos`` and ``audio`` lists of
    URL or data URL strings, or (SGLang) image objects with a ``url``."""
    for field, modality in _MEDIA_LISTS:
        items = request.get(field)
        if items is None:
            continue
        if not isinstance(items, list):
            verdict.violations.append(invalid("must be an array", field))
            continue
        for i, item in enumerate(items):
            if len(verdict.violations) >= MAX_LISTED_VIOLATIONS:
                return
            where = path(field, i)
            url, url_at = item, where
            if isinstance(item, dict):
                url, url_at = item.get("url"), path(where, "url")
            if not isinstance(url, str):
                verdict.violations.append(invalid("must be a URL or data URL string", url_at))
                continue
            _admit_url(url, url_at, where, field, modality, rule, verdict)


def walk_ollama(
    request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder, dialect: Dialect
) -> None:
    """Ollama's ``/api/chat`` and ``/api/generate``: ``images`` of bare base64, on each
    message or on the request."""
    messages = request.get("messages")
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            if isinstance(message, dict):
                role = message.get("role")
                role = role if isinstance(role, str) else "user"
                _base64_images(
                    message.get("images"), path("messages", i, "images"), role, rule, verdict
                )
    _base64_images(request.get("images"), "images", "user", rule, verdict)


def _base64_images(
    images: Any, where: str, role: str, rule: ResolvedRule, verdict: VerdictBuilder
) -> None:
    if images is None:
        return
    if not isinstance(images, list):
        verdict.violations.append(invalid("must be an array of base64 strings", where))
        return
    for j, image in enumerate(images):
        if len(verdict.violations) >= MAX_LISTED_VIOLATIONS:
            return
        at = path(where, j)
        if not isinstance(image, str):
            verdict.violations.append(invalid("must be a base64 string", at))
            continue
        media = PartDraft(
            param=at, part_type="images", modality="image", role=role, source="base64"
        )
        media.type_param = media.payload_param = at
        media.payload = image
        admit(media, rule, verdict)


# Which readings a SageMaker ``/invocations`` body gets: the engine tries its request
# models in turn and takes the first that validates, so every reading whose keys the
# body has is judged (a superset of the one the engine picks).
def walk_invocations(
    request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder, dialect: Dialect
) -> None:
    """Chat-style ``messages`` are walked by the caller; the rest here."""
    if "prompt" in request or "prompt_embeds" in request:
        walk_completions(request, rule, verdict)
    if "input" in request or "data" in request:
        walk_pooling(request, rule, verdict, dialect)
    if any(field in request for field in _SCORE_FIELDS):
        walk_score(request, rule, verdict, dialect)
    if any(key in request for key in ("image_data", "video_data", "audio_data", "input_embeds")):
        walk_generate(request, rule, verdict)
    if "features" in request or "content_parts" in request:
        walk_token_in(request, rule, verdict, dialect)
