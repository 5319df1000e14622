"""Validate a chat request body: one JSON parse, one walk, every violation named.

Pure and synchronous: bytes and a compiled policy in, a Verdict out. The walk
knows only what gates need (model, roles, content parts); every other field is
the server's business and passes untouched. Request shapes: Chat Completions
(``messages``, read as the server behind reads them: ``messages.py``), the
Responses API (``input``: a string, or items; every item that carries content or
an image is walked, and one of an unknown type that carries content is refused),
and the engines' other doors (``endpoints.py``).
The JSON is parsed once, duplicate keys refused (``json_body.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from modalgate.errors import (
    MAX_LISTED_VIOLATIONS,
    ErrorCode,
    Violation,
    path,
    payload_too_large,
)
from modalgate.policy.matching import ResolvedRule, RuleMatcher
from modalgate.policy.surface import JudgedKind
from modalgate.validators.admission import COUNT_MARGIN, CountExceeded, invalid
from modalgate.validators.anthropic import walk_anthropic
from modalgate.validators.dialects import (
    OPENAI,
    Dialect,
    dialect_for,
)
from modalgate.validators.doors import (
    walk_chat_batch,
    walk_embed_v2,
    walk_invocations,
    walk_media_lists,
    walk_ollama,
    walk_pooling,
    walk_score,
    walk_token_in,
    walk_vertex,
)
from modalgate.validators.endpoints import walk_completions, walk_generate, walk_pooling_input
from modalgate.validators.json_body import ASIDE_MIN_PAYLOAD, parse_json_body, payloads_aside
from modalgate.validators.media_checks import (
    budget_violations,
    cheap_violations,
    content_violations,
    probe_violations,
)
from modalgate.validators.messages import (
    check_embeds_mix,
    check_mm_kwargs,
    read_content_part,
    walk_message,
    walk_messages,
)
from modalgate.validators.parts import PART_KINDS
from modalgate.validators.upload import read_form, walk_upload
from modalgate.validators.verdict import (
    Verdict,
    VerdictBuilder,
    accepted,
    amended,
    refused,
    with_unparsed_request,
)
from modalgate.validators.verdict_cache import VerdictCache

_NAMES = {
    "image": "images",
    "video": "videos",
    "audio": "audio inputs",
    "file": "files",
    "embeddings": "embedding inputs",
}


# How a body is read: which paths carry which kind is policy (``endpoints``, and each
# engine's doors: policy/doors.yaml).
Api = JudgedKind
# OpenAI's and Anthropic's APIs require a model; SGLang's /generate has no such field,
# tokenize and the pooling doors make it optional.
_MODEL_REQUIRED = frozenset({"chat", "responses", "completions", "anthropic"})
# Bodies whose top-level ``modalities`` and ``audio`` ask for output (SGLang's native
# ``modalities`` is an input hint: not these).
_ASKS_OUTPUT = frozenset({"chat", "chat_batch", "responses", "invocations"})
# Bodies whose ``messages`` are not a chat conversation (read by their own walk).
_OWN_MESSAGES = frozenset({"anthropic", "chat_batch"})


def _ignoring_dialect(walk: Callable[[dict[str, Any], ResolvedRule, VerdictBuilder], None]):
    return lambda request, rule, verdict, _dialect: walk(request, rule, verdict)


_OTHER_WALKS = {
    "completions": _ignoring_dialect(walk_completions),
    "messages": _ignoring_dialect(walk_pooling_input),
    "generate": _ignoring_dialect(walk_generate),
    "anthropic": _ignoring_dialect(walk_anthropic),
    "chat_batch": walk_chat_batch,
    "score": walk_score,
    "embed_v2": walk_embed_v2,
    "pooling": walk_pooling,
    "token_in": walk_token_in,
    "invocations": walk_invocations,
    "vertex": walk_vertex,
    "media_lists": walk_media_lists,
    "ollama": walk_ollama,
    "audio_upload": walk_upload,
}
# (the name a request is judged as, the rule it resolved to) -> the model that really
# serves it, or None to judge it as named.
ServedModel = Callable[[str, ResolvedRule], "str | None"]
# The rule a request resolved to -> the dialect of the server that will read it (decided
# in gateway/ from settings and the upstream's /v1/models); a rule's own ``engine`` wins.
DialectOf = Callable[[ResolvedRule], Dialect]
# Responses API input items that carry content parts besides messages: tool outputs.
_OUTPUT_ITEMS = frozenset({"function_call_output", "custom_tool_call_output"})
# Items that never carry client media (calls the model made, its reasoning, references).
_CONTENTLESS_ITEMS = frozenset(
    {
        "reasoning",
        "function_call",
        "custom_tool_call",
        "computer_call",
        "web_search_call",
        "file_search_call",
        "code_interpreter_call",
        "image_generation_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "item_reference",
        "compaction",
    }
)
# Keys through which an item of another type could carry content to a server.
_CONTENT_KEYS = frozenset({"content", "output", "image_url", "file_data", "file_url", "input"})


def validate_body(
    body: bytes,
    matcher: RuleMatcher,
    api: Api = "chat",
    served: ServedModel | None = None,
    dialect: DialectOf | None = None,
    content_type: bytes | None = None,
    cache: VerdictCache | None = None,
) -> Verdict:
    """The whole check for one request body; ``content_type``: its header, which says how
    an audio upload's form is delimited; ``cache``: media judged before, by their bytes."""
    if api == "audio_upload":
        form = read_form(body, content_type)
        if isinstance(form, Violation):
            return refused(form, matcher.mode)
        return validate_request(form, matcher, len(body), api, served, dialect, cache=cache)
    if len(body) > ASIDE_MIN_PAYLOAD:
        verdict = _with_payloads_aside(body, matcher, api, served, dialect, cache)
        if verdict is not None:
            return verdict
    request = parse_json_body(body)
    if type(request) is dict:  # the common case first, arguments by position: cheaper
        return validate_request(request, matcher, len(body), api, served, dialect, cache=cache)
    if isinstance(request, Violation):
        return refused(request, matcher.mode)
    not_object = Violation(ErrorCode.INVALID_JSON, "the request body must be a JSON object")
    return refused(not_object, matcher.mode)


def _with_payloads_aside(
    body: bytes,
    matcher: RuleMatcher,
    api: Api,
    served: ServedModel | None,
    dialect: DialectOf | None,
    cache: VerdictCache | None,
) -> Verdict | None:
    """The verdict on ``body`` read with its long data URL payloads aside, where it accepts.

    ``None`` where the body is to be read whole instead: nothing was set aside, the
    skeleton does not parse, a payload was not taken where a data URL is read or did
    not decode strictly, or anything was refused (refusals are worded from the whole
    body). An accepted verdict proves the skeleton and the body differ only in those
    payloads (``json_body.payloads_aside``), so the whole body would be accepted
    too, with the same parts; its ``request`` is parsed when first read.
    """
    skeleton, aside = payloads_aside(body, cache.known_run if cache is not None else None)
    if not aside:
        return None
    request = parse_json_body(skeleton)
    if type(request) is not dict:
        return None
    verdict = validate_request(
        request, matcher, len(body), api, served, dialect, aside=aside, cache=cache
    )
    if aside or not verdict.accepted:
        return None
    return with_unparsed_request(verdict, body)


def validate_request(
    request: dict[str, Any],
    matcher: RuleMatcher,
    body_size: int | None = None,
    api: Api = "chat",
    served: ServedModel | None = None,
    dialect: DialectOf | None = None,
    *,
    aside: dict[str, memoryview | bytes] | None = None,
    cache: VerdictCache | None = None,
) -> Verdict:
    """Validate an already-parsed request; ``body_size`` enables the per-model body cap.

    ``dialect`` says how the server behind the rule reads chat content parts
    (``validators/dialects.py``); without one, and without an ``engine`` on the rule,
    the server is taken for a plain OpenAI-compatible one.

    ``served`` says which model really answers a request routed by its rule (an
    upstream that serves one model ignores the name, or serves its default): the
    request is judged as that model, whatever name it carries.

    ``aside``: payloads set aside from the body (``json_body.payloads_aside``); each
    data URL part whose payload is a token takes its bytes from there. Where a token is
    left once every part has taken its own, the verdict is returned unfinished, before
    the images are decoded: the caller reads the body whole instead.

    ``cache``: parts judged before (``verdict_cache.py``) take what was learned then.
    """
    model = request.get("model")
    named = model if isinstance(model, str) else None
    if model is not None and named is None:
        not_text = invalid("'model' must be a string", "model")
        return _refused(not_text, matcher, request, body_size, api)
    judged = model or matcher.policy.default_model or ""
    if not judged and api in _MODEL_REQUIRED:
        missing = invalid("'model' is required", "model")
        return _refused(missing, matcher, request, body_size, api)
    rule = matcher.resolve(judged)
    if served is not None:
        serving = served(judged, rule)
        if serving is not None and serving.casefold() != judged.casefold():
            judged, rule = serving, matcher.resolve(serving)
    judged_as = judged if judged and judged != model else None
    if not rule.known and matcher.refuses_unknown:
        shown = repr(judged[:100]) if judged else "(none given)"
        unknown = Violation(ErrorCode.UNKNOWN_MODEL, f"model: unknown model {shown}", "model")
        return _refused(unknown, matcher, request, body_size, api, named, rule, judged_as)
    if body_size is not None and body_size > rule.limits.max_body_bytes:
        too_large = payload_too_large(rule.limits.max_body_bytes)
        return _refused(too_large, matcher, request, body_size, api, named, rule, judged_as)
    if api == "responses" or (dialect is None and rule.engine is None):
        reader = OPENAI
    else:
        reader = _dialect_of(rule, dialect)
    if api in _ASKS_OUTPUT and ("modalities" in request or "audio" in request):
        output = _output_violation(request, rule, judged_as or named)
        if output is not None:
            return _refused(output, matcher, request, body_size, api, named, rule, judged_as)
    if api == "chat" and _plain_chat(request, reader):
        return accepted(matcher.mode, named, rule, request, api, judged_as, body_size or 0)
    verdict = VerdictBuilder(matcher.mode, named, request, api, body_size or 0, rule, judged_as)
    try:
        if api == "responses":
            _walk_input(request.get("input"), rule, verdict)
        elif api == "chat" or (api not in _OWN_MESSAGES and request.get("messages") is not None):
            messages = request.get("messages")
            if not isinstance(messages, list) or not (messages or reader.empty_messages):
                problem = "is required" if messages is None else "must be a non-empty array"
                verdict.violations.append(invalid(f"'messages' {problem}", "messages"))
                return verdict.build()
            check_mm_kwargs(request, reader, verdict)
            walk_messages(messages, rule, verdict, reader)
        if api in _OTHER_WALKS:
            _OTHER_WALKS[api](request, rule, verdict, reader)
    except CountExceeded:
        pass  # the walk stopped past a count limit: refused for it below
    if verdict.violations or not verdict.parts:
        return verdict.build()  # refused, or text only: nothing more to check
    if not reader.mixes_raw_and_embeds:
        check_embeds_mix(verdict, reader)
    _check_audio_in_video(request, rule, verdict, reader)
    if not verdict.violations:
        _check_counts(rule, verdict)
    if not verdict.violations:
        urls = matcher.policy.media_urls
        for part in verdict.parts:
            verdict.violations.extend(cheap_violations(part, rule, urls, aside))
        if aside:  # a token no data URL took: the caller reads the body whole; stop here
            return verdict.build()
    if not verdict.violations:
        for part in verdict.parts:
            verdict.violations.extend(probe_violations(part, rule, cache))
    if not verdict.violations:
        verdict.violations.extend(budget_violations(verdict.parts, rule))
    return verdict.build()


def _output_violation(
    request: dict[str, Any], rule: ResolvedRule, name: str | None
) -> Violation | None:
    """Output the model cannot produce: OpenAI's ``modalities`` and ``audio`` (the voice to
    answer in). vLLM and SGLang take both and answer in text anyway."""
    produces = ", ".join(sorted(rule.produces))
    who = (name or "this model")[:100]
    modalities = request.get("modalities")
    if isinstance(modalities, list):
        for i, modality in enumerate(modalities):
            if isinstance(modality, str) and modality not in rule.produces:
                where = path("modalities", i)
                return Violation(
                    ErrorCode.UNSUPPORTED_MODALITY,
                    f"{where}: {who} cannot produce {modality[:40]} output (produces: {produces})",
                    where,
                )
    if request.get("audio") is not None and "audio" not in rule.produces:
        return Violation(
            ErrorCode.UNSUPPORTED_MODALITY,
            f"audio: {who} cannot produce audio output (produces: {produces})",
            "audio",
        )
    return None


def _plain_chat(request: dict[str, Any], reader: Dialect) -> bool:
    """Whether a chat request is text only, as the walk below would find it: every message
    a plain one (``walk_messages``' first test), no per-request kwargs to refuse.

    The common request, judged here without a ``VerdictBuilder``, param paths or part
    reads (callgrind: a two-message chat body ~3,000 instructions against ~15,000);
    anything else, however small, goes the whole way.
    """
    messages = request.get("messages")
    if type(messages) is not list or reader.roles is not None:
        return False
    if not messages and not reader.empty_messages:
        return False
    try:
        for message in messages:
            # Subscripts, not ``get``: a third of the cost. A message without one of the
            # keys raises: not plain, so walked in full.
            if (
                type(message) is not dict
                or type(message["content"]) is not str
                or type(message["role"]) is not str
            ):
                return False
            # Two keys: role and content, so no reasoning key (one test, not two).
            if len(message) != 2 and ("reasoning" in message or "reasoning_content" in message):
                return False
    except KeyError:
        return False
    return reader.takes_mm_kwargs or not (
        request.get("mm_processor_kwargs") or request.get("media_io_kwargs")
    )


def _refused(
    violation: Violation,
    matcher: RuleMatcher,
    request: dict[str, Any],
    body_size: int | None,
    api: Api,
    named: str | None = None,
    rule: ResolvedRule | None = None,
    judged_as: str | None = None,
) -> Verdict:
    """A request refused before its walk (its model, its size)."""
    verdict = VerdictBuilder(matcher.mode, named, request, api, body_size or 0, rule, judged_as)
    verdict.violations.append(violation)
    return verdict.build()


def check_fetched(verdict: Verdict, fetched: dict[int, tuple[bytes, str | None]]) -> Verdict:
    """A new verdict for the bytes fetched after validation (``verdict.parts`` index ->
    data, content type): those parts get the content checks a data URL gets."""
    assert verdict.rule is not None
    parts = list(verdict.parts)
    violations = list(verdict.violations)
    for index, (data, mime) in fetched.items():
        draft = parts[index].draft()
        draft.data, draft.mime = data, mime
        violations += content_violations(draft, verdict.rule)
        parts[index] = draft.frozen()
    if not violations:
        violations += budget_violations(parts, verdict.rule)
    return amended(verdict, parts=tuple(parts), violations=tuple(violations))


def _dialect_of(rule: ResolvedRule, dialect: DialectOf | None) -> Dialect:
    if rule.engine is not None:
        return dialect_for(rule.engine)
    return dialect(rule) if dialect is not None else OPENAI


def _walk_input(items: Any, rule: ResolvedRule, verdict: VerdictBuilder) -> None:
    """The Responses API's ``input``: text, or items in order.

    Servers turn items into chat messages by their ``type`` first: a tool output is
    a tool message whose content is its ``output`` whatever ``role`` it also carries
    (vLLM's ``construct_chat_message_with_tool_call``); an item of a type they do
    not know is passed on as a message where it has a ``role``. So every item is
    read by its type, its ``content`` is walked too where it has a role (a server
    reading by role would read that), and an item of a type not known to carry
    none, but holding content anyway, is refused.
    """
    if isinstance(items, str):
        return
    if not isinstance(items, list):
        problem = "is required" if items is None else "must be a string or an array of items"
        verdict.violations.append(invalid(f"'input' {problem}", "input"))
        return
    for i, item in enumerate(items):
        if len(verdict.violations) >= MAX_LISTED_VIOLATIONS:
            return
        where = path("input", i)
        if not isinstance(item, dict):
            verdict.violations.append(invalid("each input item must be an object", where))
            continue
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            verdict.violations.append(invalid("'type' must be a string", path(where, "type")))
        elif kind == "message":
            walk_message(item, where, rule, verdict)
        elif kind in _OUTPUT_ITEMS:
            output = item.get("output")
            if isinstance(output, list):
                for j, part in enumerate(output):
                    read_content_part(part, path(where, "output", j), "tool", rule, verdict)
            _content_by_role(item, where, rule, verdict)
        elif kind == "computer_call_output":
            _read_screenshot(item.get("output"), path(where, "output"), rule, verdict)
            _content_by_role(item, where, rule, verdict)
        elif kind in PART_KINDS:  # a content part where an item goes: judged as one
            read_content_part(item, where, "user", rule, verdict)
            _content_by_role(item, where, rule, verdict)
        elif "role" in item:  # a type servers do not know, passed on as a message
            walk_message(item, where, rule, verdict)
        elif kind not in _CONTENTLESS_ITEMS and _CONTENT_KEYS.intersection(item):
            verdict.violations.append(
                invalid(
                    f"input items of type {kind[:40]!r} that carry content are not supported",
                    path(where, "type"),
                )
            )


def _content_by_role(
    item: dict[str, Any], where: str, rule: ResolvedRule, verdict: VerdictBuilder
) -> None:
    """A typed item's ``content`` where it also has a ``role``: walked as a message's."""
    if "role" in item and "content" in item:
        walk_message(item, where, rule, verdict)


def _read_screenshot(output: Any, where: str, rule: ResolvedRule, verdict: VerdictBuilder) -> None:
    """A computer-use screenshot: an image like any other, checked, fetched and screened."""
    if not isinstance(output, dict):
        verdict.violations.append(invalid("must be a computer_screenshot object", where))
        return
    if output.get("type") != "computer_screenshot":
        verdict.violations.append(
            invalid("'type' must be 'computer_screenshot'", path(where, "type"))
        )
        return
    read_content_part({**output, "type": "input_image"}, where, "tool", rule, verdict)


def _check_audio_in_video(
    request: dict[str, Any], rule: ResolvedRule, verdict: VerdictBuilder, dialect: Dialect
) -> None:
    """``use_audio_in_video`` makes each video URL an audio input too (vLLM reads it from
    ``mm_processor_kwargs``, SGLang from the top level): judged as audio as well, where
    the dialect's engine reads the flag."""
    flag = next((f for f in dialect.audio_in_video if _flag_set(request, f)), None)
    if flag is None:
        return
    videos = [p for p in verdict.parts if p.part_type == "video_url" and p.source != "cached"]
    if not videos:
        return
    if "audio" not in rule.accepts:
        verdict.unsupported.add("audio")
        name = (verdict.judged_as or verdict.model or "")[:100]
        verdict.violations.append(
            Violation(
                ErrorCode.UNSUPPORTED_MODALITY,
                f"{flag}: videos would carry their audio track, and audio input is not "
                f"supported by {name} (accepts: {', '.join(sorted(rule.accepts)) or 'text only'})",
                flag,
            )
        )
        return
    limit = rule.limits.max_audios
    audios = sum(1 for p in verdict.parts if p.modality == "audio") + len(videos)
    if limit is not None and audios > limit:
        verdict.violations.append(
            Violation(
                ErrorCode.TOO_MANY_MEDIA,
                f"{flag}: with each video's audio track the request has {audios} audio inputs;"
                f" at most {limit} allowed",
                flag,
            )
        )


def _flag_set(request: dict[str, Any], dotted: str) -> bool:
    holder: Any = request
    for key in dotted.split("."):
        holder = holder.get(key) if isinstance(holder, dict) else None
    return bool(holder)


def _check_counts(rule: ResolvedRule, verdict: VerdictBuilder) -> None:
    seen: dict[str, int] = {}
    for part in verdict.parts:
        count = seen[part.modality] = seen.get(part.modality, 0) + 1
        limit = rule.limits.max_count(part.modality)
        if limit is not None and count == limit + 1:
            total = sum(1 for p in verdict.parts if p.modality == part.modality)
            # Past the margin the walk stopped (``admission.CountExceeded``): more followed.
            sent = total if total <= limit + COUNT_MARGIN else f"more than {limit + COUNT_MARGIN}"
            name = _NAMES[part.modality]
            verdict.violations.append(
                Violation(
                    ErrorCode.TOO_MANY_MEDIA,
                    f"{part.param}: too many {name}: {sent} sent, at most {limit} allowed"
                    f" for {(verdict.model or 'this model')[:100]}",
                    part.param,
                )
            )
