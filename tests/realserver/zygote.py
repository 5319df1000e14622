"""Starts ``transformers serve`` again in about a second, however often a body kills it.

The differential sends every corpus body straight to the model server, and some of
them kill it (a segfault in its PNG decoder). ``transformers serve`` takes ~15 s to
start on this machine, nearly all of it imports, so this process imports once and
forks a fresh server for each start: the child runs ``transformers.cli.serve.Serve``,
the very class the ``transformers serve`` command builds from its flags, and the
server forks its model's process in turn where it would spawn one (~7.7 s a restart
with spawn, ~1.1 s with fork).

Protocol, one line each way on stdin/stdout: ``start PORT LOG`` answers ``pid PID`` once
the child is forked (the caller polls ``/health``); ``quit`` ends the zygote.
"""

from __future__ import annotations

import os
import sys


def main(model_dir: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch  # noqa: F401  (imported before fork: the point of this process)
    import torchvision.io  # noqa: F401
    import transformers.cli.serve as serve_cli
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
    from transformers.cli.serving import chat_completion, model_manager, response, server  # noqa: F401

    # The model's own modules are imported lazily on first load: load once here.
    AutoConfig.from_pretrained(model_dir)
    AutoProcessor.from_pretrained(model_dir)
    AutoModelForImageTextToText.from_pretrained(model_dir)
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            return
        port, log = int(words[1]), words[2]
        pid = os.fork()
        if pid == 0:
            sys.stdin.close()
            os.setsid()
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(out, 1)
            os.dup2(out, 2)
            _fork_the_model_process()
            try:
                serve_cli.Serve(force_model=model_dir, device="cpu", port=port, host="127.0.0.1")
            finally:
                os._exit(0)
        print(f"pid {pid}", flush=True)
        # Reap children that died, so none lingers as a zombie.
        while True:
            try:
                done, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if done == 0:
                break


def _fork_the_model_process() -> None:
    """The server runs its model in a process of its own, started with ``spawn``: a fresh
    interpreter that imports torch and transformers again (~7 s here). Started with
    ``fork`` instead, it inherits this process's imports, and the model's code is the
    same: the very ``EngineClient.run_engine`` the server spawns."""
    import multiprocessing

    get_context = multiprocessing.get_context

    def fork_for_spawn(method: str | None = None) -> object:
        return get_context("fork" if method == "spawn" else method)

    multiprocessing.get_context = fork_for_spawn  # type: ignore[assignment]


if __name__ == "__main__":
    main(sys.argv[1])
