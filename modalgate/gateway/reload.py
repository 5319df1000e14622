"""Reloading the policy file while the gateway serves: on SIGHUP and when the file changes.

A reload is all or nothing. The new file is parsed and checked against what
this process can serve (its encoders) before anything is swapped; a file that
fails keeps the old policy in force, and the reason goes to the log and to a
metric. Requests in flight finish under the policy they started with.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.to_thread

from modalgate.policy import Policy, PolicyError, load_policy

CONFIGMAP_DATA = "..data"  # kubelet's atomic writer: the link it replaces on each update
logger = logging.getLogger("modalgate.reload")

PolicyCheck = Callable[[Policy], list[str]]  # problems that make a policy unusable here


class PolicyReloader:
    def __init__(
        self,
        path: str,
        apply: Callable[[Policy], None],
        *,
        check: PolicyCheck | None = None,
        on_result: Callable[[bool], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.apply = apply
        self.check = check
        self.on_result = on_result
        self._lock = anyio.Lock()  # a SIGHUP during a file-change reload waits its turn

    async def reload(self, reason: str) -> bool:
        async with self._lock:
            try:
                policy = await anyio.to_thread.run_sync(load_policy, self.path)
                problems = self.check(policy) if self.check is not None else []
                if problems:
                    raise PolicyError(str(self.path), [("", p) for p in problems])
            except PolicyError as exc:
                logger.error(
                    "policy reload refused; the previous policy stays in force",
                    extra={"fields": {"reason": reason, "problems": str(exc)[:2000]}},
                )
                self._report(False)
                return False
            self.apply(policy)
            logger.info(
                "policy reloaded",
                extra={"fields": {"reason": reason, "rules": len(policy.models)}},
            )
            self._report(True)
            return True

    def _report(self, ok: bool) -> None:
        if self.on_result is not None:
            self.on_result(ok)

    async def run(self, watch_file: bool = True) -> None:
        """Until cancelled: reload on SIGHUP (where the platform has it) and on file change."""
        async with anyio.create_task_group() as group:
            if hasattr(signal, "SIGHUP"):
                group.start_soon(self._on_sighup)
            if watch_file:
                group.start_soon(self._on_change)

    async def _on_sighup(self) -> None:
        try:
            with anyio.open_signal_receiver(signal.SIGHUP) as signals:
                async for _ in signals:
                    await self.reload("SIGHUP")
        except (RuntimeError, ValueError):
            # Not the main thread (an embedding server, a test's thread): file watching only.
            logger.debug("SIGHUP reload unavailable outside the main thread")

    async def _on_change(self) -> None:
        from watchfiles import awatch

        # The directory, not the file: editors and config managers replace files by rename;
        # a Kubernetes ConfigMap volume swaps its ``..data`` link to a new directory, and
        # the file is a link through it.
        directory, names = self.path.parent.resolve(), {self.path.name, CONFIGMAP_DATA}
        async for _ in awatch(
            directory,
            watch_filter=lambda change, changed: Path(changed).name in names,
            debounce=300,
            step=50,
            recursive=False,
        ):
            if self.path.exists():
                await self.reload("file changed")
