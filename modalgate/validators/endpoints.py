"""The other doors into the same engine: completions, pooling-style bodies, SGLang's /generate.

A gate that checks only the chat path is bypassed through ``/tokenize`` or
``/v1/embeddings`` (vLLM reads chat-style ``messages`` there), ``/v1/completions``
(``prompt_embeds``) or SGLang's ``/generate`` (``image_data``, ``video_data``,
``audio_data``, ``input_embeds``). Each body kind names where its media sit; each
medium becomes a ``MediaPart`` and meets the same admission and content checks
as a chat content part.

SGLang reads a media string as a URL, a data URL, a file path on the server, or
bare base64. File paths are never passed: a string that is not a URL is judged
as base64 and refused if it is not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from modalgate.errors import MAX_LISTED_VIOLATIONS, path
from modalgate.policy.matching import ResolvedRule
from modalgate.validators.admission import admit, invalid
from modalgate.validators.parts import with_url
from modalgate.validators.verdict import PartDraft, VerdictBuilder

_GENERATE_MEDIA = (("image_data", "image"), ("video_data", "video"), ("audio_data", "audio"))
_POOLING_ITEM_KEYS = frozenset({"text", "image", "video"})
_URL_PREFIXES = ("http://", "https://", "data:", "file:")


def walk_completions(request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder) -> None:
    """``/v1/completions``: text or token prompts, and vLLM's ``prompt_embeds``."""
    embeds = request.get("prompt_embeds")
    if embeds is None:
        return
    items = embeds if isinstance(embeds, list) else [embeds]
    for index, item in enumerate(items):
        if len(verdict.violations) >= MAX_LISTED_VIOLATIONS:
            return
        where = path("prompt_embeds", index) if isinstance(embeds, list) else "prompt_embeds"
        if not isinstance(item, str):
            verdict.violations.append(invalid("must be a base64 string", where))
            continue
        admit_embeddings(where, "prompt_embeds", rule, verdict)


def walk_pooling_input(
    request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder
) -> None:
    """``input`` of embeddings and tokenize bodies: text or tokens, or SGLang's
    ``{"text", "image", "video"}`` items (an image or a video each). Objects of any other
    shape are refused: the gate cannot tell what a server would make of them."""
    items = request.get("input")
    if not isinstance(items, list):
        return
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            continue  # text or token ids
        if len(verdict.violations) >= MAX_LISTED_VIOLATIONS:
            return
        where = path("input", index)
        if not _POOLING_ITEM_KEYS.issuperset(item):
            verdict.violations.append(
                invalid("input objects may carry only 'text', 'image' and 'video'", where)
            )
            continue
        for modality in ("image", "video"):
            medium = item.get(modality)
            if medium is None:
                continue
            if not isinstance(medium, str):
                problem = invalid("must be a URL or base64 string", path(where, modality))
                verdict.violations.append(problem)
                continue
            _media_string(medium, path(where, modality), modality, "input", rule, verdict)


def walk_generate(
    request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder, root: str = ""
) -> None:
    """SGLang's native ``/generate``: one item, a list, or a list per prompt, per field.
    ``root``: where the fields sit (a Vertex instance: ``instances.[0]``)."""
    for field, modality in _GENERATE_MEDIA:
        value = request.get(field)
        if value is None:
            continue
        for where, item in _flattened(value, path(root, field) if root else field):
            if len(verdict.violations) >= MAX_LISTED_VIOLATIONS:
                return
            if isinstance(item, str):
                _media_string(item, where, modality, field, rule, verdict)
            elif item is not None:
                verdict.violations.append(
                    invalid(
                        "only URL, data URL or base64 strings are accepted here (not "
                        "precomputed or processor-output objects)",
                        where,
                    )
                )
    if request.get("input_embeds") is not None:
        where = path(root, "input_embeds") if root else "input_embeds"
        admit_embeddings(where, "input_embeds", rule, verdict)
    for field in _GENERATE_HASHES:
        if request.get(field) is not None:
            verdict.names_by_hash(path(root, field) if root else field)


# SGLang's caller-supplied media hashes: ``mm_hashes`` is never checked against the bytes.
_GENERATE_HASHES = ("mm_hashes", "mm_content_hashes")


def _flattened(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    """Each item with its param, made as the walk reaches it (it may stop early)."""
    if not isinstance(value, list):
        yield where, value
        return
    for i, item in enumerate(value):
        if isinstance(item, list):
            for j, inner in enumerate(item):
                yield path(where, i, j), inner
        else:
            yield path(where, i), item


def _media_string(
    value: str, where: str, modality: str, field: str, rule: ResolvedRule, verdict: VerdictBuilder
) -> None:
    part = PartDraft(param=where, part_type=field, modality=modality, role="user", source="url")
    part.type_param = where
    is_url = value[:8].lower().startswith(_URL_PREFIXES)
    part.inlinable = is_url  # a fetched URL becomes a data URL in the same place
    admit(with_url(part, value, where, bare_base64=not is_url), rule, verdict)


def admit_embeddings(where: str, field: str, rule: ResolvedRule, verdict: VerdictBuilder) -> None:
    """Client embeddings at ``where``: admitted only where the rule accepts ``embeddings``."""
    part = PartDraft(
        param=where, part_type=field, modality="embeddings", role="user", source="embeds"
    )
    part.payload_param = part.type_param = where
    admit(part, rule, verdict)
