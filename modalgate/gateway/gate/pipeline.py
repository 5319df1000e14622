"""The one decision every entry point takes: parse, validate, fall back, fetch, inline.

The middleware (and through it ``/v1/validate`` and ``/v1/encode``) and
``modalgate validate`` all call ``Decider.decide``, so a body gets the same
verdict wherever it arrives. Validation and rewrites are CPU work handed to
``run_cpu`` (inline for small bodies, a worker thread for big ones); fetching
remote media is the one I/O step, and an entry point may leave it out.
In shadow mode (``shadow.py``) a refusal the policy covers goes on anyway, reported.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from modalgate.errors import Violation
from modalgate.gateway.gate.media_ids import MediaIdentity
from modalgate.gateway.gate.remote_media import MediaStage, RunCpu, run_inline
from modalgate.gateway.gate.shadow import enforced, in_shadow_mode, lenient_matcher, may_shadow
from modalgate.policy import RuleMatcher
from modalgate.validators import Verdict, validate_body, with_fallback
from modalgate.validators.json_body import Location, rewrite_json_body
from modalgate.validators.request import Api, DialectOf, ServedModel
from modalgate.validators.verdict_cache import VerdictCache


@dataclass(frozen=True, slots=True)
class Decision:
    """The verdict, and the body to pass on: the client's own bytes unless a rewrite
    (a fallback's ``model``, inlined media) changed some values."""

    verdict: Verdict
    body: bytes  # the very object received when nothing was rewritten
    # Shadow mode: the verdict's refusal is reported, and the request goes on anyway.
    shadowed: bool = False

    @property
    def forwards(self) -> bool:
        return self.verdict.accepted or self.shadowed


Edits = list[tuple[Location, object]]


@dataclass(frozen=True, slots=True)
class Decider:
    matcher: RuleMatcher
    media: MediaStage | None  # None: remote media are judged by their URL alone
    served: ServedModel | None = None
    run_cpu: RunCpu = run_inline
    # Shadow mode (shadow.py): None as the policy says, False for every rule, True never.
    enforce: bool | None = None
    dialect: DialectOf | None = None  # how the server behind a rule reads content parts
    # Bodies under this many bytes may be validated by the caller on the spot, without
    # ``run_cpu`` (the middleware does, with its own threshold): 0, never.
    inline_below: int = 0
    # Client media ids rebound to the caller and the bytes (media_ids.py); None: as sent.
    identity: MediaIdentity | None = None
    # Media judged before, by their bytes (validators/verdict_cache.py); None: judge all.
    cache: VerdictCache | None = None

    async def decide(
        self,
        body: bytes,
        api: Api = "chat",
        verdict: Verdict | None = None,
        content_type: bytes | None = None,
        headers: Iterable[tuple[bytes, bytes]] = (),
    ) -> Decision:
        """The decision on ``body``; ``verdict``: its ``validate_body`` verdict, where the
        caller has it already; ``content_type``: the body's header (a form's boundary);
        ``headers``: the request's, which name the caller whose media ids are bound."""
        received = len(body)
        if verdict is None:
            verdict = await self.run_cpu(
                received,
                validate_body,
                body,
                self.matcher,
                api,
                self.served,
                self.dialect,
                content_type,
                self.cache,
            )
        edits: Edits = []
        # A fallback rewrites the JSON body's model: a form has none to rewrite.
        if (
            not verdict.accepted
            and verdict.rule is not None
            and verdict.rule.fallback
            and api != "audio_upload"
        ):
            routed = await self.run_cpu(
                received, with_fallback, verdict, self.matcher, received, self.dialect
            )
            # Where the fallback refuses too, a shadowed request goes on to the model it named.
            if routed.accepted or not may_shadow(verdict, self.enforce):
                verdict = routed
            if verdict.routed_from is not None and verdict.accepted:
                edits.append((("model",), verdict.model))
        if not verdict.accepted:
            # A refusal is shadowed only under the rule that judged the body as it would be
            # forwarded: a fallback's refusal judged the rewritten body, so where the rule
            # named (which enforces) routed it and the target refuses, that is the answer.
            if verdict.routed_from is None and may_shadow(verdict, self.enforce):
                return await self._shadowed(verdict, body, api, content_type, headers)
            return Decision(verdict, body)
        if verdict.remote_parts and self.media is not None:
            shadow = in_shadow_mode(verdict.rule, self.enforce)
            verdict, inlined = await self._fetched(verdict, shadow)
            edits += inlined
        shadowed = may_shadow(verdict, self.enforce)
        bound = await self._bound(verdict, headers) if verdict.accepted or shadowed else None
        if isinstance(bound, Verdict):  # an id that cannot go on: never shadowed
            return Decision(bound, body)
        if bound is not None:
            verdict, id_edits = bound
            edits += id_edits
        if (verdict.accepted or shadowed) and edits:
            # Only the edited values change; every other byte's meaning, numbers included,
            # goes on as the client sent it.
            grown = received + sum(p.inlined_size() for p in verdict.remote_parts)
            body = await self.run_cpu(grown, rewrite_json_body, body, edits)
        return Decision(verdict, body, shadowed)

    async def _bound(
        self, verdict: Verdict, headers: Iterable[tuple[bytes, bytes]]
    ) -> tuple[Verdict, Edits] | Verdict | None:
        """The verdict with its media ids bound and the edits writing them; a verdict
        refused for an id; None where no part carries one (nearly always)."""
        if self.identity is None or (
            not verdict.hash_params
            and all(part.media_id is None and part.digest is None for part in verdict.parts)
        ):
            return None
        tenant = self.identity.tenant_of(headers)
        bound, edits = await self.identity.bind(verdict, tenant, self.run_cpu)
        if bound.violations != verdict.violations:
            return bound
        return bound, edits

    async def _fetched(self, verdict: Verdict, shadow: bool) -> tuple[Verdict, Edits]:
        """``verdict`` once its remote media are fetched and checked, and the edits that
        inline them where the request goes on (accepted, or shadowed)."""
        assert self.media is not None
        verdict = await self.media.fetch(verdict, self.run_cpu)
        goes_on = verdict.accepted or (shadow and not enforced(verdict.violations))
        if not goes_on or not self.media.inline:
            return verdict, []
        inlined = self.media.inlined(verdict)
        if isinstance(inlined, Violation):
            return verdict.with_violations(inlined), []
        return verdict, list(inlined)

    async def _shadowed(
        self,
        verdict: Verdict,
        body: bytes,
        api: Api,
        content_type: bytes | None,
        headers: Iterable[tuple[bytes, bytes]],
    ) -> Decision:
        """``verdict``'s refusal shadowed, once the request passes what shadow mode never
        lets through (read under the lenient policy: every part, every URL fetched);
        else refused for that first."""
        received = len(body)
        lenient: Verdict = await self.run_cpu(
            received,
            validate_body,
            body,
            lenient_matcher(self.matcher),
            api,
            self.served,
            self.dialect,
            content_type,
        )
        edits: Edits = []
        if not enforced(lenient.violations) and lenient.remote_parts and self.media is not None:
            lenient, edits = await self._fetched(lenient, shadow=True)
        refusal = enforced(lenient.violations)
        if not refusal:
            bound = await self._bound(lenient, headers)
            if isinstance(bound, Verdict):
                refusal = enforced(bound.violations)
            elif bound is not None:
                edits += bound[1]
        if refusal:
            return Decision(replace(verdict, violations=(*refusal, *verdict.violations)), body)
        if edits:
            grown = received + sum(p.inlined_size() for p in lenient.remote_parts)
            body = await self.run_cpu(grown, rewrite_json_body, body, edits)
        return Decision(verdict, body, shadowed=True)
