"""What the gate decided about one request, for whoever observes it (metrics, logs).

The gate reports outcomes through a plain callback, so it knows nothing of
Prometheus or logging; the standalone app plugs both in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from modalgate.errors import Violation, status_of


@dataclass(frozen=True, slots=True)
class GateOutcome:
    accepted: bool
    violations: Sequence[Violation]
    model: str | None  # as the client sent it (may be anything: never a metric label)
    mode: str | None
    rule: str | None  # the matched rule's name, None for an unknown model: bounded, label-safe
    body_bytes: int
    seconds: float  # read + validate + fetch, up to the forward or the error
    path: str = ""
    routed_from: str | None = None  # the rule a fallback routed away from (``rule`` is the new)
    # Shadow mode: refused by the policy (``violations``, ``status``), forwarded anyway.
    shadowed: bool = False

    @classmethod
    def early_refusal(
        cls,
        violation: Violation,
        mode: str | None,
        path: str,
        body_bytes: int = 0,
        seconds: float = 0.0,
    ) -> GateOutcome:
        """A refusal made before any verdict (headers, method, body size): no model yet."""
        return cls(
            accepted=False,
            violations=(violation,),
            model=None,
            mode=mode,
            rule=None,
            body_bytes=body_bytes,
            seconds=seconds,
            path=path,
        )

    @property
    def status(self) -> int:
        return status_of(self.violations) if self.violations else 200

    @property
    def code(self) -> str | None:
        return str(self.violations[0].code) if self.violations else None

    @property
    def param(self) -> str | None:
        return self.violations[0].param if self.violations else None


OutcomeObserver = Callable[[GateOutcome], None]
