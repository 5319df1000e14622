"""The Anthropic Messages API (``/v1/messages``, ``count_tokens``, ``render``), read as vLLM
and SGLang read it.

Both engines turn each ``image`` block into an ``image_url`` part (a ``base64`` source
becomes ``data:<media_type>;base64,<data>``, a ``url`` source its URL, a source without
``type`` is read as base64), and each ``image`` inside a user's ``tool_result`` into an
image of a message that follows the tool's. So every image block is one media part
here, checked like any image, its param the block's own path. A ``document`` block
with bytes (Anthropic's PDFs) is a file; one of text is text. In an assistant's
``tool_result`` the engines flatten the content to text: nothing there reaches a vision
tower.
"""

from __future__ import annotations

from typing import Any

from modalgate.errors import MAX_LISTED_VIOLATIONS, ErrorCode, Violation, path
from modalgate.policy.matching import ResolvedRule
from modalgate.validators.admission import admit, invalid
from modalgate.validators.parts import with_url
from modalgate.validators.verdict import PartDraft, VerdictBuilder

# Blocks that carry no client media (text, tool calls, reasoning, tool changes).
_TEXT_BLOCKS = frozenset(
    {
        "text",
        "tool_use",
        "tool_reference",
        "thinking",
        "redacted_thinking",
        "tool_addition",
        "tool_removal",
        "server_tool_use",
        "web_search_tool_result",
        "search_result",
        "container_upload",
    }
)
_MEDIA_BLOCKS = {"image": "image", "document": "file"}
_ROLES = frozenset({"user", "assistant", "system"})


def walk_anthropic(request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder) -> None:
    """``system`` (text blocks; an image there is media in a role that carries none),
    then every message's blocks."""
    system = request.get("system")
    if isinstance(system, list):
        _blocks(system, "system", "system", rule, verdict)
    messages = request.get("messages")
    if not isinstance(messages, list):
        problem = "is required" if messages is None else "must be an array"
        verdict.violations.append(invalid(f"'messages' {problem}", "messages"))
        return
    for i, message in enumerate(messages):
        if len(verdict.violations) >= MAX_LISTED_VIOLATIONS:
            return
        where = path("messages", i)
        if not isinstance(message, dict):
            verdict.violations.append(invalid("each message must be an object", where))
            continue
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            problem = "must be one of assistant, system, user"
            verdict.violations.append(invalid(f"'role' {problem}", path(where, "role")))
            continue
        content = message.get("content")
        if isinstance(content, list):
            _blocks(content, path(where, "content"), role, rule, verdict)
        elif not isinstance(content, str):
            problem = "must be a string or an array of content blocks"
            verdict.violations.append(invalid(problem, path(where, "content")))


def _blocks(
    blocks: list[Any], where: str, role: str, rule: ResolvedRule, verdict: VerdictBuilder
) -> None:
    for j, block in enumerate(blocks):
        if len(verdict.violations) >= MAX_LISTED_VIOLATIONS:
            return
        at = path(where, j)
        if not isinstance(block, dict):
            verdict.violations.append(invalid("each content block must be an object", at))
            continue
        kind = block.get("type")
        if not isinstance(kind, str):
            verdict.violations.append(invalid("'type' must be a string", path(at, "type")))
        elif kind in _MEDIA_BLOCKS:
            _media_block(block, at, role, _MEDIA_BLOCKS[kind], rule, verdict)
        elif kind == "tool_result":
            content = block.get("content")
            if role == "user" and isinstance(content, list):
                _tool_result(content, path(at, "content"), rule, verdict)
        elif kind not in _TEXT_BLOCKS:
            verdict.violations.append(
                Violation(
                    ErrorCode.UNSUPPORTED_CONTENT_TYPE,
                    f"{path(at, 'type')}: unknown content block type {kind[:40]!r}",
                    path(at, "type"),
                )
            )


def _tool_result(
    content: list[Any], where: str, rule: ResolvedRule, verdict: VerdictBuilder
) -> None:
    """A user's tool result: its images become a message of their own downstream."""
    for k, item in enumerate(content):
        kind = item.get("type") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind in _MEDIA_BLOCKS:
            modality = _MEDIA_BLOCKS[kind]
            _media_block(item, path(where, k), "tool", modality, rule, verdict)


def _media_block(
    block: dict[str, Any],
    where: str,
    role: str,
    modality: str,
    rule: ResolvedRule,
    verdict: VerdictBuilder,
) -> None:
    media = PartDraft(
        param=where, part_type=block["type"], modality=modality, role=role, source="url"
    )
    media.type_param = path(where, "type")
    source = block.get("source")
    source_at = path(where, "source")
    if not isinstance(source, dict):
        verdict.violations.append(invalid("must be an object", source_at))
        return
    kind = source.get("type", "base64")
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str):
            verdict.violations.append(invalid("must be a string", path(source_at, "url")))
            return
        media.inlinable = False  # a url source has no slot for bytes: fetched, not inlined
        admit(with_url(media, url, path(source_at, "url")), rule, verdict)
        return
    if kind == "base64":
        problem = _base64_source(source, source_at, modality, media)
        if problem is not None:
            verdict.violations.append(problem)
            return
        admit(media, rule, verdict)
        return
    if kind == "file" and isinstance(source.get("file_id"), str):
        media.source, media.payload_param = "file_id", path(source_at, "file_id")
        admit(media, rule, verdict)
        return
    if modality == "file" and kind in ("text", "content"):
        return  # a document of text: text, whatever block carries it
    shown = kind[:40] if isinstance(kind, str) else kind
    verdict.violations.append(invalid(f"unknown source type {shown!r}", path(source_at, "type")))


def _base64_source(
    source: dict[str, Any], where: str, modality: str, media: PartDraft
) -> Violation | None:
    data, media_type = source.get("data"), source.get("media_type", "image/jpeg")
    if not isinstance(data, str):
        return invalid("must be a base64 string", path(where, "data"))
    if not isinstance(media_type, str):
        return invalid("must be a string", path(where, "media_type"))
    family = media_type.split("/", 1)[0].strip().lower()
    if modality == "image" and family != "image":
        return Violation(
            ErrorCode.MODALITY_MISMATCH,
            f"{path(where, 'media_type')}: {media_type[:60]!r} is not an image type, but the"
            " block is an image",
            path(where, "media_type"),
        )
    media.source, media.payload = "base64", data
    media.mime = media_type.lower()
    media.payload_param = path(where, "data")
    return None
