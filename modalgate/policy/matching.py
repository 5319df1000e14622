"""Which rule governs a request's ``model`` in the gateway's mode.

Matching is case-insensitive. Among the rules that apply in the mode, the most
specific wins, compared in this order:

1. an exact hit (the rule's ``name`` or a ``match`` entry without wildcards)
   beats a glob hit;
2. a rule written for this mode beats a rule without a mode;
3. between globs, the one with more literal (non-wildcard) characters wins;
4. otherwise the rule that comes first in the file wins.

The answer for a model name is cached: names are few, requests are many.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from functools import lru_cache

from modalgate.policy.models import (
    EmbedsSpec,
    Limits,
    MediaIdMode,
    ModelRule,
    Policy,
    Role,
    TokenSpec,
    UpstreamTarget,
)
from modalgate.settings import EngineSpec

_WILDCARD = re.compile(r"[*?\[]")


@dataclass(frozen=True, slots=True)
class ResolvedRule:
    """What the validators need for one request: a rule with its limits merged."""

    name: str
    mode: str | None
    accepts: frozenset[str]
    limits: Limits
    media_roles: frozenset[Role]
    message: str | None = None
    tokens: TokenSpec | None = None
    encoder: str | None = None
    embeds: EmbedsSpec | None = None
    upstream: tuple[UpstreamTarget, ...] | None = None
    fallback: tuple[tuple[str, str], ...] = ()  # (modality, model) pairs: hashable
    known: bool = True
    engine: EngineSpec | None = None  # the rule's own server dialect (validators/dialects.py)
    enforce: bool = True  # False: its refusals are shadowed (the rule's, else the policy's)
    produces: frozenset[str] = frozenset({"text"})  # output modalities
    media_ids: MediaIdMode = "bind"  # how client media ids reach the server (policy.models)

    def fallback_for(self, modality: str) -> str | None:
        return dict(self.fallback).get(modality)


@dataclass(frozen=True, slots=True)
class _Pattern:
    rule_index: int
    exact: str | None
    glob: re.Pattern[str] | None
    literal_chars: int


class RuleMatcher:
    """Compiled once per (policy, mode); ``resolve`` is a cached lookup."""

    def __init__(self, policy: Policy, mode: str | None = None) -> None:
        self.policy = policy
        self.mode = mode
        # The rules of this mode, in file order: what every caller iterates.
        self.rules: tuple[ModelRule, ...] = tuple(
            r for r in policy.models if r.mode is None or r.mode == mode
        )
        self.refuses_unknown = policy.unknown_models == "reject" or (
            policy.unknown_models == "auto"
            and mode is not None
            and any(r.mode == mode for r in self.rules)
        )
        self._patterns = [
            _compile(index, pattern)
            for index, rule in enumerate(self.rules)
            for pattern in (rule.name, *rule.match)
        ]
        self._unknown = ResolvedRule(
            name="",
            mode=mode,
            accepts=frozenset({"image", "video", "audio", "file", "embeddings"}),
            limits=policy.limits,
            media_roles=frozenset(policy.media_roles),
            known=False,
            produces=frozenset({"text", "audio"}),
            enforce=policy.enforce,
            media_ids=policy.media_ids.mode,
        )
        self.resolve = lru_cache(maxsize=1024)(self._resolve)

    def _resolve(self, model: str) -> ResolvedRule:
        """The rule for ``model``; an unknown model gets the defaults with ``known=False``."""
        folded = model.casefold()
        best: tuple[int, int, int, int] | None = None
        best_rule: ModelRule | None = None
        for pattern in self._patterns:
            if pattern.exact is not None:
                if pattern.exact != folded:
                    continue
                tier = 1
            elif pattern.glob is not None and pattern.glob.fullmatch(folded):
                tier = 0
            else:
                continue
            rule = self.rules[pattern.rule_index]
            key = (tier, rule.mode is not None, pattern.literal_chars, -pattern.rule_index)
            if best is None or key > best:
                best, best_rule = key, rule
        if best_rule is None:
            return self._unknown
        return ResolvedRule(
            name=best_rule.name,
            mode=best_rule.mode,
            accepts=frozenset(best_rule.accepts),
            limits=self.policy.limits.merged(best_rule.limits),
            media_roles=frozenset(best_rule.media_roles or self.policy.media_roles),
            message=best_rule.message,
            tokens=best_rule.tokens,
            encoder=best_rule.encoder,
            embeds=best_rule.embeds,
            upstream=best_rule.upstream,
            fallback=tuple(sorted((best_rule.fallback or {}).items())),
            engine=best_rule.engine,
            enforce=self.policy.enforce if best_rule.enforce is None else best_rule.enforce,
            produces=frozenset(best_rule.produces),
            media_ids=best_rule.media_ids or self.policy.media_ids.mode,
        )


def _compile(index: int, pattern: str) -> _Pattern:
    folded = pattern.casefold()
    if not _WILDCARD.search(folded):
        return _Pattern(index, folded, None, len(folded))
    literal = len(_WILDCARD.sub("", folded.replace("[", "").replace("]", "")))
    return _Pattern(index, None, re.compile(fnmatch.translate(folded)), literal)
