"""Chat messages and their content parts, read in the dialect of the server behind.

``walk_messages`` goes through ``messages`` as the engine reads them
(``dialects.py``): roles, content present or not, vLLM's own message type or
OpenAI's (``vllm_union.py``), and each part through ``parts.py`` into the
verdict being built. The Responses API reads its content parts here too
(``read_content_part``), in the ``openai`` dialect.
"""

from __future__ import annotations

from typing import Any

from modalgate.errors import MAX_LISTED_VIOLATIONS, Violation, path
from modalgate.policy.matching import ResolvedRule
from modalgate.validators.admission import admit, invalid
from modalgate.validators.dialects import EMBEDS_MODALITY, OPENAI, Dialect
from modalgate.validators.parts import PART_KINDS, part_type_of, read_part
from modalgate.validators.verdict import VerdictBuilder
from modalgate.validators.vllm_union import message_path


def walk_messages(
    messages: list[Any],
    rule: ResolvedRule,
    verdict: VerdictBuilder,
    dialect: Dialect,
    root: str = "messages",
) -> None:
    """``root``: where the list sits (a batch's conversation: ``messages.[2]``)."""
    violations = verdict.violations
    for i, message in enumerate(messages):
        if len(violations) >= MAX_LISTED_VIOLATIONS:
            return
        # The common case first, before any param path is built: plain text content.
        if (
            isinstance(message, dict)
            and isinstance(message.get("content"), str)
            and isinstance(message.get("role"), str)
            and "reasoning" not in message
            and "reasoning_content" not in message
            and dialect.roles is None
        ):
            continue
        walk_message(message, path(root, i), rule, verdict, dialect)


def walk_message(
    message: Any,
    where: str,
    rule: ResolvedRule,
    verdict: VerdictBuilder,
    dialect: Dialect = OPENAI,
) -> None:
    violations = verdict.violations
    if not isinstance(message, dict):
        violations.append(invalid("each message must be an object", where))
        return
    role = message.get("role")
    if not isinstance(role, str):
        violations.append(invalid("'role' must be a string", path(where, "role")))
        return
    if dialect.roles is not None:
        # Read as the engine reads it: SGLang lower-cases every role but one it takes.
        spoken = role.lower()
        if spoken not in dialect.roles:
            roles = ", ".join(sorted(dialect.roles))
            violations.append(
                invalid(f"{dialect.engine} takes the roles {roles}", path(where, "role"))
            )
            return
        if spoken != role and spoken in dialect.exact_roles:
            shown = f"{dialect.engine} takes the role {spoken!r} in lower case only"
            violations.append(invalid(shown, path(where, "role")))
            return
        role = spoken
    for key, form in dialect.reasoning.items():
        reasoning = message.get(key)
        if reasoning is None or isinstance(reasoning, str):
            continue
        if form == "text_or_parts" and isinstance(reasoning, list):  # judged as content
            for j, part in enumerate(reasoning):
                if len(violations) >= MAX_LISTED_VIOLATIONS:
                    return
                read_content_part(part, path(where, key, j), role, rule, verdict, dialect)
        elif (
            form == "text_or_embeds_part"
            and isinstance(reasoning, dict)
            and reasoning.get("type") == "prompt_embeds"
        ):
            read_content_part(reasoning, path(where, key), role, rule, verdict, dialect)
        else:
            violations.append(invalid(f"'{key}' must be a string", path(where, key)))
    content = message.get("content")
    if isinstance(content, str):
        return
    if content is None:
        if "content" not in message:
            required = role in dialect.content_required
        else:
            allowed = dialect.null_content
            required = role in dialect.content_required if allowed is None else role not in allowed
        if required:
            violations.append(invalid("'content' is required", path(where, "content")))
        return
    if not isinstance(content, list):
        violations.append(
            invalid(
                "'content' must be a string or an array of content parts",
                path(where, "content"),
            )
        )
        return
    if dialect.fallback is not None:  # vLLM: its own message type, or OpenAI's
        reading, blamed = message_path(role, content)
        if reading == "refused" and blamed is not None:
            part_at = path(where, "content", blamed)
            specific = _specific_refusal(content[blamed], part_at, role, dialect)
            violations.append(
                specific
                if specific is not None
                else invalid(
                    f"{dialect.engine} takes no such content part in a {role[:40]!r} message"
                    " (alone, or with only such parts, it is read as OpenAI's)",
                    part_at,
                )
            )
            return
        if reading == "openai":
            dialect = dialect.fallback
    if not content and role == "user" and not dialect.empty_user_content:
        violations.append(invalid("'content' must not be an empty array", path(where, "content")))
        return
    for j, part in enumerate(content):
        if _is_plain_text(part):
            continue
        read_content_part(part, path(where, "content", j), role, rule, verdict, dialect)
        if len(violations) >= MAX_LISTED_VIOLATIONS:
            return


def _specific_refusal(part: Any, where: str, role: str, dialect: Dialect) -> Violation | None:
    """What the engine's own reading finds wrong with a part it refuses, if it says."""
    if not isinstance(part, dict):
        return None
    typed = part_type_of(part, where, dialect)
    if isinstance(typed, Violation):
        return typed
    read = read_part(typed, part, where, role, dialect)
    return read if isinstance(read, Violation) else None


def _is_plain_text(part: Any) -> bool:
    return (
        isinstance(part, dict)
        and len(part) == 2
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
    )


def read_content_part(
    part: Any,
    where: str,
    role: str,
    rule: ResolvedRule,
    verdict: VerdictBuilder,
    dialect: Dialect = OPENAI,
) -> None:
    if isinstance(part, str) and dialect.bare_string_parts:
        return
    if not isinstance(part, dict):
        verdict.violations.append(invalid("each content part must be an object", where))
        return
    typed = part_type_of(part, where, dialect)
    if isinstance(typed, Violation):
        verdict.violations.append(typed)
        return
    read = read_part(typed, part, where, role, dialect)
    if read is None:
        return
    if isinstance(read, Violation):
        verdict.violations.append(read)
        return
    read.type_param = typed.param
    admit(read, rule, verdict)
    payload = part.get(PART_KINDS[typed.name].key)
    if isinstance(payload, dict) and "content_hash" in payload:  # SGLang's, on image_url
        verdict.names_by_hash(path(where, PART_KINDS[typed.name].key, "content_hash"))


def check_mm_kwargs(request: dict[str, Any], dialect: Dialect, verdict: VerdictBuilder) -> None:
    """vLLM refuses per-request processor and media-loading kwargs unless trusted."""
    if dialect.takes_mm_kwargs:
        return
    for key in ("mm_processor_kwargs", "media_io_kwargs"):
        if request.get(key):
            verdict.violations.append(
                invalid(
                    f"per-request '{key}' are refused by this {dialect.engine} server (it"
                    " was not started with --trust-request-mm-kwargs)",
                    key,
                )
            )


def check_embeds_mix(verdict: VerdictBuilder, dialect: Dialect) -> None:
    """vLLM refuses raw media and precomputed embeddings of one modality together."""
    embedded = {
        EMBEDS_MODALITY[p.part_type]: p for p in verdict.parts if p.part_type in EMBEDS_MODALITY
    }
    for part in verdict.parts:
        if part.modality in embedded:
            other = embedded.pop(part.modality)
            verdict.violations.append(
                invalid(
                    f"{dialect.engine} takes {part.modality} inputs either raw or as"
                    f" embeddings, not both in one request (see {other.param})",
                    part.param,
                )
            )
