"""Stage one and the exits of the flow, one room per job.

- ``gate/``: the ASGI middleware (``ModalGate``) and the one decision it takes per
  request (``pipeline``: parse, validate, fall back, fetch, inline), path
  normalisation, the error responses it sends;
- ``upstream/``: the reverse proxy, its connection pool, the balancer over
  per-model routes, and the forwarder that picks a route and rewrites to embeddings;
- ``service/``: the gateway's own endpoints (models catalog, ``/v1/encode``,
  health) and the encoder-side embeds rewrite;
- ``observability/``: metrics, logs, request ids;
- ``http/``: ``modalgate serve``'s own HTTP/1.1 server (``http.server`` hosts it under
  uvicorn); it reads and answers bytes, and judges nothing;
- ``app.py`` assembles them (``create_app``), ``cli.py`` is ``modalgate``.
"""

from modalgate.gateway.gate.middleware import (
    DEFAULT_PATHS,
    DEFAULT_RESPONSES_PATHS,
    ModalGate,
    get_verdict,
)

__all__ = ["DEFAULT_PATHS", "DEFAULT_RESPONSES_PATHS", "ModalGate", "get_verdict"]
