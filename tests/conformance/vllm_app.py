"""vLLM's own API server app, built by vLLM's own code path, with the gate mounted by
vLLM's own flag, served on 127.0.0.1: ``python vllm_app.py PORT [VLLM ARGS...]``.

Runs in ``.venv-conformance`` (with the repository on ``PYTHONPATH``), on the CPU and with
no model: ``make_arg_parser`` reads the arguments as ``vllm serve`` does (``--middleware
modalgate.ModalGate`` among them), ``build_app`` registers every router for the tasks
given and adds the middleware. No engine is started, so a request the gate passes reaches
a handler that has no engine to ask; the gate's own answers come before any handler runs.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the CUDA wheel, told it has no GPU

import uvicorn
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.entrypoints.launchers.app import build_app
from vllm.utils.argparse_utils import FlexibleArgumentParser

TASKS = ("generate", "embed", "classify", "transcription", "realtime", "render")


def main() -> None:
    port = int(sys.argv[1])
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[2:])
    app = build_app(args, supported_tasks=TASKS)
    mounted = [m.cls.__name__ for m in app.user_middleware]
    print("middleware, outermost first:", ", ".join(mounted), flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning")


if __name__ == "__main__":
    main()
