"""Surviving a cluster: preemption signals agreed by all processes, a deadline on
each step, and Orbax checkpoints of the model, the optimizer and the data iterator.
"""

import faulthandler
import os
import signal
import sys
import threading
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from layout import AXES


class Preemption:
    """Notes SIGTERM and SIGUSR1; all processes agree to stop at the same step.

    Each step, ``vote()`` launches a tiny program that takes the largest of every
    process's flag; ``agreed(vote)`` reads it a step later, when the next step is
    already queued, so agreeing costs no wait. Every process reads the same answer for
    the same step, so all stop at the same step, whichever got the signal.
    """

    def __init__(self, mesh):
        self.signal = None
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(
                signum, lambda s, _: setattr(self, "signal", signal.Signals(s).name)
            )
        self.sharding = NamedSharding(mesh, P(AXES))  # one flag per device
        self.largest = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))

    def vote(self) -> jax.Array:
        flags = np.full(jax.local_device_count(), self.signal is not None, np.int32)
        shape = (jax.device_count(),)
        return self.largest(
            jax.make_array_from_process_local_data(self.sharding, flags, shape)
        )

    @staticmethod
    def agreed(vote: jax.Array) -> bool:
        return bool(vote)

    def reason(self) -> str:
        return self.signal or "a preemption signal to another process"


def deadline_report(steps: dict[int, int], num_processes: int, seconds: float) -> str:
    """Which processes did not reach the furthest step, from each one's last step."""
    ahead = max(steps.values(), default=0)
    behind = [p for p in range(num_processes) if steps.get(p, -1) < ahead]
    if not behind:
        return (
            f"step timeout: every process reached step {ahead} and none went further "
            f"within {seconds:g} s (a collective whose order or shape differs between "
            "processes, or a deadlock inside the step)"
        )
    where = ", ".join(
        f"process {p} at step {steps[p]}" if p in steps else f"process {p} at no step"
        for p in behind
    )
    waiting = ", ".join(str(p) for p in range(num_processes) if p not in behind)
    return (
        f"step timeout: process{'es' if len(behind) > 1 else ''} "
        f"{', '.join(map(str, behind))} did not reach step {ahead} within "
        f"{seconds:g} s ({where}); processes {waiting} wait at step {ahead}"
    )


class StepDeadline:
    """--step-timeout: ends the job when this process's step has not advanced for
    ``seconds``.

    JAX's heartbeat ends a job whose process died, not one whose process is alive and
    stuck (asleep, on a file system, or in a collective the others never enter). Each
    process writes the step it reached into the key-value store of JAX's coordination
    service; a thread checks that its own step advances. The first to pass its deadline
    writes a report naming the processes behind (``deadline_report``) under a key every
    thread polls; each prints it and its Python stacks (faulthandler; ``kill -USR2
    <pid>`` does it by hand) and exits 124, which ``srun --kill-on-bad-exit=1`` or
    ``mpirun`` turns into the end of the job. Every process makes one with the same
    ``seconds``; the deadline starts at the first ``reached``. One process alone (no
    ``jax.distributed``) watches only itself. ``client``, ``process_index``,
    ``num_processes`` and ``stream`` are for tests.
    """

    KEY = "lm_deadline"

    def __init__(
        self,
        seconds: float,
        *,
        poll_s: float = 0.5,
        client=None,
        process_index: int | None = None,
        num_processes: int | None = None,
        stream=None,
    ):
        if client is None:
            # private: JAX 0.10.2 exports no key-value store
            from jax._src import distributed

            client = distributed.global_state.client
        self.client, self.seconds, self.poll_s = client, seconds, poll_s
        self.index = jax.process_index() if process_index is None else process_index
        self.count = jax.process_count() if num_processes is None else num_processes
        self.stream = sys.stderr if stream is None else stream
        self.step, self.since = None, time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> "StepDeadline":
        faulthandler.register(signal.SIGUSR2, file=self.stream, all_threads=True)
        self._thread.start()
        return self

    def reached(self, step: int) -> None:
        """This process has reached ``step``."""
        if self.client is not None:
            self.client.key_value_set(
                f"{self.KEY}/step/{self.index}", str(step), allow_overwrite=True
            )
        self.step, self.since = step, time.monotonic()

    def stop(self) -> None:
        """Stop watching: no more steps (before the last save and shutdown)."""
        self._stop.set()
        self._thread.join()
        faulthandler.unregister(signal.SIGUSR2)

    def steps(self) -> dict[int, int]:
        """Every process's last step, as written to the store."""
        if self.client is None:
            return {} if self.step is None else {self.index: self.step}
        entries = self.client.key_value_dir_get(f"{self.KEY}/step/")
        return {int(key.rsplit("/", 1)[1]): int(value) for key, value in entries}

    def _fired(self) -> str | None:
        try:
            return self.client.key_value_try_get(f"{self.KEY}/fired")
        except Exception:  # NOT_FOUND, or no store: nobody fired
            return None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            message = self._fired()
            late = (
                self.step is not None and time.monotonic() - self.since > self.seconds
            )
            if message is None and late:
                message = deadline_report(self.steps(), self.count, self.seconds)
                try:
                    self.client.key_value_set(f"{self.KEY}/fired", message)
                except Exception:  # another process fired first, or no store
                    message = self._fired() or message
            if message is not None:
                return self._end(message)

    def _end(self, message: str) -> None:
        print(f"{message}\nprocess {self.index}'s Python stacks:", file=self.stream)
        self.stream.flush()
        faulthandler.dump_traceback(file=self.stream, all_threads=True)
        self.stream.flush()
        time.sleep(2 * self.poll_s + 0.5)  # the others poll the report, dump theirs
        os._exit(124)


def checkpoint_manager(args) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=args.keep, save_interval_steps=args.checkpoint_every
    )
    return ocp.CheckpointManager(
        os.path.abspath(args.checkpoint_dir),
        options=options,
        item_handlers={
            "state": ocp.StandardCheckpointHandler(),
            "data": grain.checkpoint.CheckpointHandler(),
        },
    )


def restore(manager: ocp.CheckpointManager, shapes, batches):
    """The latest state, and the data iterator where that state left it."""
    step = manager.latest_step()
    data_item = grain.checkpoint.CheckpointRestore(batches)
    try:
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(shapes), data=data_item
            ),
        )
        return restored.state, restored.data
    # ValueError: Grain keeps one file per process, saved with another process count;
    # KeyError: no data item (convert.py from-hf's step 0)
    except (ValueError, KeyError):
        restored = manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(shapes))
        )
        # Global batch s is the same on any layout: start the data at the step.
        batches.set_state({"next_index": step})
        return restored.state, batches
