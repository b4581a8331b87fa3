"""A per-step deadline across processes: which process did not reach step k, and every process's stack.

JAX's heartbeat ends a job whose process died or stopped (its heartbeat thread stops with it), but
not one whose process is alive and stuck: sleeping, waiting on a file system, deadlocked in Python,
or blocked in a collective that the others never enter. Its heartbeat thread keeps beating, and the
job waits until the scheduler's time limit. :class:`StepWatchdog` adds a deadline per step, built
from JAX's own pieces: every process writes the step it reached into the coordination service's
key-value store (the one ``jax.distributed.initialize`` started), and a thread in every process
checks that its own step advances. When one has not for ``timeout_s`` seconds, that thread writes
a report (which processes did not reach the step the others wait at) under a key that every
process's thread polls; each prints the report and its own Python stack
(``faulthandler.dump_traceback``) and ends its process with status ``EXIT_STATUS``, so that
``mpirun`` or ``srun --kill-on-bad-exit=1`` ends the job. ``kill -USR2 <pid>`` dumps a process's
stack by hand (``faulthandler.register``).

The store is reached through ``jax._src.distributed.global_state.client``: JAX 0.10.2 exports only
``jax.distributed.initialize``, ``is_initialized`` and ``shutdown``, and this client
(``key_value_set``, ``key_value_try_get``, ``key_value_dir_get``) is the one private path this
package uses for it. Nothing else well kept does this: the coordination service's own heartbeat is
blind to a live process, and faulthandler's ``dump_traceback_later`` is per process, not per step.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Any, TextIO

EXIT_STATUS = 124  # what timeout(1) exits with when its deadline passes
PREFIX = "jaxdist_watchdog"


def coordination_client() -> Any:
    """The coordination service's client of this process, or ``None`` when JAX runs as one process."""
    from jax._src import distributed  # private: JAX 0.10.2 exports no key-value store

    return distributed.global_state.client


def report(steps: dict[int, int], num_processes: int, timeout_s: float) -> str:
    """Which processes did not reach the furthest step, from every process's last
    step."""
    ahead = max(steps.values(), default=0)
    behind = [p for p in range(num_processes) if steps.get(p, -1) < ahead]
    if not behind:
        return (
            f"watchdog: every process reached step {ahead} but none finished it within "
            f"{timeout_s:g} s: step {ahead} is stuck on all of them (a collective "
            "whose order or shape differs between processes, or a deadlock inside the "
            "step)"
        )
    where = ", ".join(
        f"process {p} at step {steps[p]}" if p in steps else f"process {p} at no step"
        for p in behind
    )
    waiting = [p for p in range(num_processes) if p not in behind]
    return (
        f"watchdog: process{'es' if len(behind) > 1 else ''} "
        f"{', '.join(map(str, behind))} did not reach step {ahead} within "
        f"{timeout_s:g} s ({where}); processes "
        f"{', '.join(map(str, waiting))} wait at step {ahead}"
    )


class StepWatchdog:
    """Ends the job when a process's step does not advance for ``timeout_s`` seconds; see the module docstring.

    Call :meth:`step` as each step begins; the deadline starts at the first call, so the first
    step's compilation counts (give it room, or call ``step`` after the first step). Every process
    of the job must create one with the same ``timeout_s``.
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        poll_s: float = 0.5,
        exit_status: int = EXIT_STATUS,
        client: Any = None,
        process_index: int | None = None,
        num_processes: int | None = None,
        stream: TextIO | None = None,
    ) -> None:
        import jax

        self.timeout_s, self.poll_s, self.exit_status = timeout_s, poll_s, exit_status
        self.client = coordination_client() if client is None else client
        if self.client is None:
            raise RuntimeError(
                "StepWatchdog needs jax.distributed.initialize() first (it uses the coordination "
                "service's key-value store)"
            )
        self.index = jax.process_index() if process_index is None else process_index
        self.count = jax.process_count() if num_processes is None else num_processes
        self.stream = sys.stderr if stream is None else stream
        self.last_step: int | None = None
        self.since = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="watchdog", daemon=True
        )

    def start(self) -> StepWatchdog:
        """Start the watching thread, and let ``kill -USR2`` dump this process's stacks."""
        faulthandler.register(signal.SIGUSR2, file=self.stream, all_threads=True)
        self._thread.start()
        return self

    def step(self, k: int) -> None:
        """This process has reached step ``k``."""
        self.client.key_value_set(
            f"{PREFIX}/step/{self.index}", str(k), allow_overwrite=True
        )
        self.last_step, self.since = k, time.monotonic()

    def stop(self) -> None:
        """Stop watching (at the end of training, before the final checkpoint and shutdown)."""
        self._stop.set()
        self._thread.join()
        faulthandler.unregister(signal.SIGUSR2)

    def __enter__(self) -> StepWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def steps(self) -> dict[int, int]:
        """Every process's last step, as written to the store."""
        entries = self.client.key_value_dir_get(f"{PREFIX}/step/")
        return {int(key.rsplit("/", 1)[1]): int(value) for key, value in entries}

    def _fired(self) -> str | None:
        try:
            return self.client.key_value_try_get(f"{PREFIX}/fired")
        except Exception:  # NOT_FOUND: nobody fired
            return None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            message = self._fired()
            late = (
                self.last_step is not None
                and time.monotonic() - self.since > self.timeout_s
            )
            if message is None and late:
                message = report(self.steps(), self.count, self.timeout_s)
                try:
                    self.client.key_value_set(f"{PREFIX}/fired", message)
                except Exception:  # another process fired first: print its report
                    message = self._fired() or message
            if message is not None:
                self._end(message)

    def _end(self, message: str) -> None:
        print(
            f"{message}\nprocess {self.index}'s Python stacks:",
            file=self.stream,
            flush=True,
        )
        faulthandler.dump_traceback(file=self.stream, all_threads=True)
        self.stream.flush()
        # the others' threads poll the report, and dump theirs
        time.sleep(2 * self.poll_s + 0.5)
        os._exit(self.exit_status)
