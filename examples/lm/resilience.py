"""Surviving a cluster: preemption signals agreed by all processes, a deadline on
each step, and Orbax checkpoints of the model, the optimizer and the data iterator.
"""

import contextlib
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


class StepDeadline:
    """--step-timeout: a thread ends the job when this process's step has not advanced
    for ``seconds``. Each process writes its step into the key-value store of JAX's
    coordination service; the first to pass its deadline names the processes behind,
    and every process prints its Python stacks (faulthandler; ``kill -USR2 <pid>`` does
    it by hand) and exits 124."""

    def __init__(self, seconds: float):
        # private: JAX 0.10.2 exports no key-value store
        from jax._src import distributed

        self.client, self.seconds = distributed.global_state.client, seconds
        self.step, self.since = None, time.monotonic()
        faulthandler.register(signal.SIGUSR2, all_threads=True)
        threading.Thread(target=self._watch, daemon=True).start()

    def reached(self, step: int) -> None:
        if self.client is not None:
            self.client.key_value_set(
                f"lm_deadline/step/{jax.process_index()}",
                str(step),
                allow_overwrite=True,
            )
        self.step, self.since = step, time.monotonic()

    def _fired(self):
        try:
            return (
                self.client.key_value_try_get("lm_deadline/fired")
                if self.client
                else None
            )
        except Exception:  # NOT_FOUND
            return None

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            message = self._fired()
            late = (
                self.step is not None and time.monotonic() - self.since > self.seconds
            )
            if message is None and late:
                entries = (
                    self.client.key_value_dir_get("lm_deadline/step/")
                    if self.client
                    else []
                )
                steps = {int(k.rsplit("/", 1)[1]): int(v) for k, v in entries} or {
                    0: self.step
                }
                ahead = max(steps.values())
                behind = [
                    p for p in range(jax.process_count()) if steps.get(p, -1) < ahead
                ]
                message = (
                    f"step timeout: processes {behind} did not finish step {ahead} "
                    f"within {self.seconds:g} s"
                    if behind
                    else f"step timeout: step {ahead + 1} "
                    f"did not finish within {self.seconds:g} s on any process"
                )
                # another process may have fired first
                with contextlib.suppress(Exception):
                    self.client and self.client.key_value_set(
                        "lm_deadline/fired", message
                    )
            if message is not None:
                print(
                    f"{message}; process {jax.process_index()}'s stacks:",
                    file=sys.stderr,
                    flush=True,
                )
                faulthandler.dump_traceback(all_threads=True)
                time.sleep(1.5)  # the others poll the message and dump theirs
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
