"""The gate inside SGLang's own server, which has no ``--middleware`` flag.

    MODALGATE_ENGINE=sglang python -m modalgate.gateway.sglang --model-path MODEL [SGLANG ARGS]

starts SGLang as ``python -m sglang.launch_server`` does, with ModalGate added to its app
(``sglang.srt.entrypoints.http_server:app``, built when that module is imported), and
configured like ``ModalGate(app)`` anywhere: by the ``MODALGATE_*`` variables.

SGLang's multi-process tokenizer mode (``--tokenizer-worker-num N``) serves with N
workers that each import the app anew, by the import path in
``SGLANG_HTTP_SERVER_APP_PATH``; the launcher points that here (``APP_PATH``), so every
worker imports SGLang's app with the gate on it. The app is reached lazily (this
module's ``app`` attribute), so importing the module costs nothing where SGLang is
absent.
"""

from __future__ import annotations

import os
import sys
from typing import Any

APP_PATH = "modalgate.gateway.sglang:app"
SGLANG_APP_PATH_VARIABLE = "SGLANG_HTTP_SERVER_APP_PATH"
_gated: list[Any] = []  # SGLang's app once the gate is on it (one per process)


def gated_app() -> Any:
    """SGLang's app with ModalGate added (once per process: a worker imports anew)."""
    if not _gated:
        from sglang.srt.entrypoints.http_server import app

        from modalgate.gateway.gate.middleware import ModalGate

        app.add_middleware(ModalGate)
        _gated.append(app)
    return _gated[0]


def __getattr__(name: str) -> Any:
    if name == "app":
        return gated_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> None:
    """``python -m sglang.launch_server``'s own steps, the gate on the app first."""
    os.environ[SGLANG_APP_PATH_VARIABLE] = APP_PATH
    gated_app()
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
