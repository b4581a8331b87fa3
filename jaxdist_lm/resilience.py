"""Surviving a cluster: preemption signals agreed by all processes, a deadline on
each step, and Orbax checkpoints of the model, the optimizer and the data iterator.
"""

import faulthandler
import functools
import logging
import os
import re
import signal
import sys
import threading
import time
import warnings

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .layout import AXES


class Preemption:
    """Notes SIGTERM and SIGUSR1; all processes agree to stop at the same step.

    ``vote()`` launches a tiny program that takes the largest of every process's flag;
    ``agreed(vote)`` reads it a step later, when the next step is queued: no wait.
    """

    def __init__(self, mesh):
        self.signal = None
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(
                signum, lambda s, _: setattr(self, "signal", signal.Signals(s).name)
            )
        # one flag per device
        self.sharding = NamedSharding(mesh, P(AXES))
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

    def farewell(self, step: int, checkpoint_dir: str | None) -> str:
        """The last line of a run stopped at ``step``: where it saved, if anywhere."""
        if checkpoint_dir:
            return f"{self.reason()}: saved step {step} in {checkpoint_dir}, exiting"
        nothing = "no --checkpoint-dir, nothing saved, exiting"
        return f"{self.reason()} at step {step}: {nothing}"


def deadline_report(
    steps: dict[int, int],
    num_processes: int,
    seconds: float,
    silent: dict[int, float] | None = None,
) -> str:
    """Which processes stopped running (``silent``: seconds since each one's heartbeat
    changed), and which did not reach the furthest of ``steps``."""
    silent = silent or {}
    ahead = max(steps.values(), default=0)
    stopped = sorted(silent)
    behind = [
        p for p in range(num_processes) if steps.get(p, -1) < ahead and p not in silent
    ]
    waiting = [p for p in range(num_processes) if p not in behind and p not in silent]
    if not stopped and not behind:
        return (
            f"step timeout: every process reached step {ahead} and none went further "
            f"within {seconds:g} s (a collective whose order or shape differs between "
            "processes, or a deadlock inside the step)"
        )
    clauses = []
    if stopped:
        quiet = round(min(silent.values()), 1)
        clauses.append(
            f"{_processes(stopped)} stopped running ({_where(stopped, steps)}; no "
            f"heartbeat for {quiet:g} s: paused by SIGSTOP, a debugger or a suspended "
            "VM, or blocked in the kernel on a file system or a driver)"
        )
    if behind:
        clauses.append(
            f"{_processes(behind)} did not reach step {ahead} within {seconds:g} s "
            f"({_where(behind, steps)})"
        )
    if waiting:
        verb = "wait" if len(waiting) > 1 else "waits"
        clauses.append(f"{_processes(waiting)} {verb} at step {ahead}")
    return "step timeout: " + "; ".join(clauses)


def _processes(indices: list[int]) -> str:
    """``process 1`` or ``processes 1, 3``."""
    return f"process{'es' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"


def _where(indices: list[int], steps: dict[int, int]) -> str:
    """``process 1 at step 2, process 3 at no step``."""
    return ", ".join(
        f"process {p} at step {steps[p]}" if p in steps else f"process {p} at no step"
        for p in indices
    )


class StepDeadline:
    """--step-timeout: ends the job (status 124) when this process's step has not
    advanced for ``seconds``, naming the processes stopped or behind. JAX's heartbeat
    ends a job whose process died, not one alive and stuck."""

    # Each process writes its step, and a heartbeat bumped every poll by a thread, into
    # the key-value store of JAX's coordination service. A stopped process's thread
    # stops with it; a process stuck in a collective keeps beating. The first to pass
    # its deadline writes a report under a key every thread polls; each prints it and
    # its Python stacks (``kill -USR2 <pid>`` does it by hand) and exits 124, which
    # srun --kill-on-bad-exit=1 or mpirun turns into the end of the job.
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
        # client, process_index, num_processes and stream: for tests
        if client is None:
            # Private: JAX 0.10.2 exports no key-value store. None without
            # jax.distributed: one process alone watches only itself.
            from jax._src import distributed

            client = distributed.global_state.client
        self.client, self.seconds, self.poll_s = client, seconds, poll_s
        self.index = jax.process_index() if process_index is None else process_index
        self.count = jax.process_count() if num_processes is None else num_processes
        self.stream = sys.stderr if stream is None else stream
        self.step, self.since = None, time.monotonic()
        # A live process's thread beats every poll: no beat for 3 polls and a quarter
        # of the deadline says it stopped. Listening over the deadline's second half
        # tells so from a deadline of 6 polls (3 s) up.
        self.quiet = max(3 * poll_s, seconds / 4)
        # process -> (its heartbeat, when this process's clock first read that value)
        self.heard: dict[int, tuple[str, float]] = {}
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

    def listen(self) -> None:
        """Read every process's heartbeat; note when each changed, on this clock."""
        now = time.monotonic()
        for key, value in self.client.key_value_dir_get(f"{self.KEY}/beat/"):
            index = int(key.rsplit("/", 1)[1])
            if self.heard.get(index, (None,))[0] != value:
                self.heard[index] = (value, now)

    def silent(self) -> dict[int, float]:
        """The other processes whose heartbeat has not changed for ``quiet`` seconds,
        and for how long, as far as this process listened."""
        now = time.monotonic()
        return {
            index: now - since
            for index, (_, since) in self.heard.items()
            if now - since >= self.quiet and index != self.index
        }

    def _beat(self, count: int) -> None:
        self.client.key_value_set(
            f"{self.KEY}/beat/{self.index}", str(count), allow_overwrite=True
        )

    def _fired(self) -> str | None:
        try:
            return self.client.key_value_try_get(f"{self.KEY}/fired")
        # NOT_FOUND, or no store: nobody fired
        except Exception:
            return None

    def _watch(self) -> None:
        beats = 0
        while not self._stop.wait(self.poll_s):
            if self.client is not None:
                beats += 1
                self._beat(beats)
            message = self._fired()
            idle = 0.0 if self.step is None else time.monotonic() - self.since
            # Listening costs one read of every heartbeat a poll: only in a slow step.
            if self.client is not None and idle > self.seconds / 2:
                self.listen()
            else:
                self.heard.clear()
            if message is None and idle > self.seconds:
                message = deadline_report(
                    self.steps(), self.count, self.seconds, self.silent()
                )
                try:
                    self.client.key_value_set(f"{self.KEY}/fired", message)
                # another process fired first, or no store
                except Exception:
                    message = self._fired() or message
            if message is not None:
                return self._end(message)

    def _end(self, message: str) -> None:
        print(f"{message}\nprocess {self.index}'s Python stacks:", file=self.stream)
        self.stream.flush()
        faulthandler.dump_traceback(file=self.stream, all_threads=True)
        self.stream.flush()
        # time for the others to poll the report and dump their stacks
        time.sleep(2 * self.poll_s + 0.5)
        os._exit(124)


def location(checkpoint_dir: str) -> str:
    """--checkpoint-dir as Orbax is given it: a URL (gs://bucket/run) as it is, a path
    made absolute."""
    return (
        checkpoint_dir if "://" in checkpoint_dir else os.path.abspath(checkpoint_dir)
    )


def checkpoint_manager(
    directory: str, keep: int = 3, every: int = 1
) -> ocp.CheckpointManager:
    """Orbax's manager of --checkpoint-dir ``directory``, keeping the last ``keep``
    steps saved every ``every``; a failed save or restore through it is said in one
    line (quiet_echoes), once for the process."""
    quiet_echoes()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        save_interval_steps=every,
        # A step's folders made before save() returns: a full disk fails there, at
        # once, not as a wait of 300 s for a folder that no thread will make.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
    )
    return ocp.CheckpointManager(
        location(directory),
        options=options,
        item_handlers={
            "state": ocp.StandardCheckpointHandler(),
            "data": grain.checkpoint.CheckpointHandler(),
        },
    )


class Unrestorable(Exception):
    """A checkpoint step that does not restore; the message says which part and why."""


def restore(manager: ocp.CheckpointManager, shapes, batches):
    """The newest step that restores: its state, and the data iterator where that
    state left it; a one-line SystemExit when none does."""
    # Each newer step that does not restore is moved to STEP.unrestorable, a name
    # Orbax does not list, so that no later save or --keep deletes its files.
    failed = []
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            restored, why = restore_step(manager, step, shapes, batches), None
        except Unrestorable as error:
            restored, why = None, str(error)
        # Every process takes the same step, or none does.
        if everywhere(why is None):
            set_aside(manager, failed)
            return restored
        failed.append((step, why or "another process's part does not restore"))
    newest, why = failed[0]
    before = len(failed) - 1
    earlier = {0: "", 1: "; nor does the step before it"}.get(
        before, f"; nor do the {before} steps before it"
    )
    raise SystemExit(
        f"no checkpoint step in {manager.directory} restores (step {newest}: {why}"
        f"{earlier}): check that --model and the other flags are the run's that saved "
        "them, or move the directory away to start from step 0"
    )


def restore_step(manager: ocp.CheckpointManager, step: int, shapes, batches):
    """``step``'s state and data iterator; Unrestorable if either does not restore."""
    # Without the tree's metadata file, Orbax reads the state as a plain dict and fails
    # on its structure: say which file is missing instead.
    state_dir = manager.directory / str(step) / "state"
    if state_dir.is_dir() and not (state_dir / "_METADATA").exists():
        raise Unrestorable("state: its _METADATA file is missing")
    state_only = ocp.args.Composite(state=ocp.args.StandardRestore(shapes))
    try:
        state = manager.restore(step, args=state_only).state
    # The devices' fault (out of memory), not the files': train.main's one line.
    except jax.errors.JaxRuntimeError:
        raise
    except Exception as error:
        raise Unrestorable(f"state: {short_reason(error)}") from None
    # Grain writes one file per process, named for the process count. No file for this
    # process: no data item (convert.py from-hf's step 0), or one saved with another
    # process count. Global batch s is the same on any layout: start the data at step s.
    grain_file = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    if not (manager.directory / str(step) / "data" / grain_file).exists():
        batches.set_state({"next_index": step})
        return state, batches
    data_only = ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(batches))
    try:
        return state, manager.restore(step, args=data_only).data
    except Exception as error:
        raise Unrestorable(f"data: {short_reason(error)}") from None


def everywhere(ok: bool) -> bool:
    """Whether ``ok`` holds on every process."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def set_aside(manager: ocp.CheckpointManager, failed: list[tuple[int, str]]) -> None:
    """Move each step that did not restore to STEP.unrestorable (process 0, once for
    all), and say so; the step before it restored."""
    for step, why in failed:
        if jax.process_index() != 0:
            continue
        path = manager.directory / str(step)
        moved, copies = path.with_name(f"{step}.unrestorable"), 1
        while moved.exists():
            copies += 1
            moved = path.with_name(f"{step}.unrestorable-{copies}")
        try:
            path.rename(moved)
        except OSError as error:
            raise SystemExit(
                f"checkpoint step {step} in {manager.directory} does not restore "
                f"({why}) and cannot be moved aside ({short_reason(error)}): move it "
                "away yourself and rerun"
            ) from None
        print(
            f"checkpoint step {step} in {manager.directory} does not restore ({why}): "
            f"moved to {moved.name}, falling back",
            flush=True,
        )
    if not failed:
        return
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("unrestorable steps moved")
    # Orbax lists the steps it found at the start: forget the moved ones.
    manager.reload()


def save(manager: ocp.CheckpointManager, step: int, state, batches) -> None:
    """Save ``step`` in the background, once the previous save has finished; a
    one-line SystemExit if it fails."""
    finish(manager)
    items = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(batches),
    )
    try:
        manager.save(step, force=True, args=items)
    except Exception as error:
        raise SystemExit(not_saved(manager, step, error)) from None


def finish(manager: ocp.CheckpointManager) -> None:
    """Wait for the save in the background; a one-line SystemExit if it failed."""
    # Orbax lists a step from the start of its save, and forgets it if the save fails.
    step = manager.latest_step()
    try:
        manager.wait_until_finished()
    except Exception as error:
        raise SystemExit(not_saved(manager, step, error)) from None


def not_saved(manager: ocp.CheckpointManager, step: int, error: Exception) -> str:
    """Which step did not save, where, why, and where a rerun starts."""
    last = manager.latest_step()
    then = (
        f"step {last} is the last saved there, where a rerun resumes"
        if last is not None
        else "no step is saved there yet"
    )
    return (
        f"checkpoint step {step} did not save in {manager.directory} "
        f"({short_reason(error)}): stopping; {then}"
    )


def short_reason(error: BaseException) -> str:
    """What went wrong in a few words: the operating system's words for a file's error,
    else the first line of the innermost cause."""
    while error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, OSError) and error.strerror:
        return error.strerror + (f": {error.filename}" if error.filename else "")
    text = str(error.args[0] if isinstance(error, KeyError) and error.args else error)
    # TensorStore's errors end with the OS's error number: [os_error_code='28'].
    if code := re.search(r"os_error_code='(\d+)'", text):
        return os.strerror(int(code[1]))
    # A first line that ends in a colon introduces the next (Orbax's tree mismatch).
    lines = text.strip().splitlines() or [type(error).__name__]
    shown = lines[:2] if lines[0].endswith(":") else lines[:1]
    line = " ".join(part.strip() for part in shown)
    line = line.split(" [tensorstore_spec", 1)[0].rstrip(":")
    return line if len(line) <= 400 else line[:397] + "..."


# Echoes of one failed save or restore, which the recipe says in one line: Orbax logs
# the traceback it raises to the caller, asyncio logs its writes that failed beside the
# first, TensorStore's callbacks reach an event loop the failure closed, and Orbax's
# unfinished reads and writes raise as they are collected (GeneratorExit), or as Python
# exits, or never started (the data item's thread, when the state's save fails at once).
ECHOES = ("Event loop is closed", "Python is likely shutting down")


def _not_an_echo(record: logging.LogRecord) -> bool:
    """Keep a log record unless it is Orbax's error with a traceback, or asyncio's
    about Orbax's tasks."""
    if record.levelno < logging.ERROR:
        return True
    if record.name == "asyncio":
        return "orbax" not in record.getMessage()
    return not ("orbax" in record.pathname and record.exc_info)


def _skip_echoes(unraisable, previous, echoes=ECHOES, closed=GeneratorExit) -> None:
    # Bound arguments only: at exit, this module's globals may be gone.
    error = unraisable.exc_value
    cause = getattr(error, "__cause__", None) or getattr(error, "__context__", None)
    collected = isinstance(cause, closed)
    if not collected and not any(echo in str(error) for echo in echoes):
        previous(unraisable)


def quiet_echoes() -> None:
    """Silence the echoes of a checkpoint's error (ECHOES); once per process."""
    for logger in ("absl", "asyncio"):
        logging.getLogger(logger).addFilter(_not_an_echo)
    warnings.filterwarnings(
        "ignore", "coroutine 'to_thread' was never awaited", RuntimeWarning
    )
    if getattr(sys.unraisablehook, "func", None) is not _skip_echoes:
        sys.unraisablehook = functools.partial(
            _skip_echoes, previous=sys.unraisablehook
        )
