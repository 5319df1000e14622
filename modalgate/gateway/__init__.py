"""Stage one and the exits of the flow: the ASGI middleware, the standalone app, the CLI."""

from modalgate.gateway.middleware import (
    DEFAULT_PATHS,
    DEFAULT_RESPONSES_PATHS,
    ModalGate,
    get_verdict,
)

__all__ = ["DEFAULT_PATHS", "DEFAULT_RESPONSES_PATHS", "ModalGate", "get_verdict"]
