"""Which paths a gateway forwards, and how the gate reads each one's body: a compiled lookup."""

from __future__ import annotations

from collections.abc import Mapping

from modalgate.policy.surface import Endpoint, EndpointKind, EndpointSpec, kind_of


class EndpointTable:
    """Exact paths first, then the longest ``/prefix/*`` entry; None: not on the surface."""

    def __init__(self, endpoints: Mapping[str, EndpointSpec]) -> None:
        self.exact = {
            p.rstrip("/") or "/": kind_of(k) for p, k in endpoints.items() if not p.endswith("/*")
        }
        prefixes = [(p[:-1], kind_of(k)) for p, k in endpoints.items() if p.endswith("/*")]
        self.prefixes = sorted(prefixes, key=lambda item: -len(item[0]))
        # The methods each judged path takes its body on, where more than POST.
        self.methods = {
            p.rstrip("/") or "/": frozenset(k.methods)
            for p, k in endpoints.items()
            if isinstance(k, Endpoint)
        }

    def kind_of(self, path: str) -> EndpointKind | None:
        """``path`` must already be normalised (no dot segments, no repeated slashes)."""
        kind = self.exact.get(path.rstrip("/") or "/")
        if kind is not None:
            return kind
        for prefix, prefix_kind in self.prefixes:
            if path.startswith(prefix):
                return prefix_kind
        return None

    def body_methods(self, path: str) -> frozenset[str]:
        return self.methods.get(path.rstrip("/") or "/", _POST)


_POST = frozenset({"POST"})
