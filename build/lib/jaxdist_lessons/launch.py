"""Start one copy of a program per process, for JAX's multi-controller runtime (chapter 8).

The launcher the article imagined as ``python -m jax.distributed.launch``, which does not exist::

    python -m jaxdist_lessons.launch --num-processes 2 --devices-per-process 4 train.py --lr 0.1
    python -m jaxdist_lessons.launch -n 2 -d 4 -m jaxdist_lessons.multihost_demo hello
    python -m jaxdist_lessons.launch --hostfile hosts.txt --coordinator host0:1234 train.py

Every process gets the coordinator's address, the process count and its own id in its
environment (``JAXDIST_COORDINATOR``, ``JAXDIST_NUM_PROCESSES``, ``JAXDIST_PROCESS_ID``; and
``JAXDIST_NUM_DEVICES``, the simulated CPU devices per process), which
``jaxdist_lessons.multihost.initialize()`` reads. Output lines are prefixed with their rank
(a process's stdout goes to the launcher's stdout, its stderr to the launcher's stderr). If
one process fails, the others are stopped and the launcher exits with that process's status,
printing its last lines; ``--timeout`` stops a job that hangs (exit status 124).

Each process runs in its own process group, so stopping it also stops anything it started.
Hosts in a hostfile other than this one are reached through ``--remote-command`` (``ssh`` by
default); every argument travels as a list element, never through a local shell. Killing a
local ``ssh`` does not stop the program it started on the other host, so there the program
runs under a small watchdog (``REMOTE_WATCHDOG``) that stops it, and everything it started,
when its standard input closes: when the launcher closes it, or when ``ssh`` or the launcher
dies. (So do not pass ``ssh -n``, which closes it at once.)

This module uses only the standard library: the launcher itself never imports JAX.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import ipaddress
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

ENV_COORDINATOR = "JAXDIST_COORDINATOR"
ENV_COORDINATOR_BIND = "JAXDIST_COORDINATOR_BIND"
ENV_NUM_PROCESSES = "JAXDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXDIST_PROCESS_ID"
ENV_NUM_DEVICES = "JAXDIST_NUM_DEVICES"  # the same variable devices.setup() reads

EXIT_TIMEOUT = 124  # what coreutils' `timeout` returns
EXIT_USAGE = 2  # what argparse returns
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# Host names and addresses only: no spaces, quotes, `;`, `$`, and no leading `-` (ssh would read an option).
_HOST_RE = re.compile(r"^(?!-)[A-Za-z0-9_.:@\[\]%-]+$")


class HostfileError(ValueError):
    """A hostfile that cannot be read or has a malformed line; the message names the file and line."""


class LayoutError(ValueError):
    """A layout of processes, hosts and devices that cannot be started; the message says what would work."""


@dataclasses.dataclass(frozen=True)
class Host:
    """A line of a hostfile: a host name and how many processes it runs."""

    name: str
    slots: int = 1


@dataclasses.dataclass(frozen=True)
class Process:
    """One process of the job: its rank (JAX's process id), its host, and its index on that host."""

    rank: int
    host: str
    local_rank: int


# --- Hostfiles and layouts ----------------------------------------------------------------------


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Hosts from hostfile text: ``name [slots=N]`` per line; ``#`` starts a comment; blank lines are skipped."""
    hosts: list[Host] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *options = line.split()
        where = f"{source}:{lineno}: {raw.strip()!r}"
        if not _HOST_RE.match(name):
            raise HostfileError(
                f"{where}: {name!r} is not a host name or address (letters, digits, '.', '-', "
                "':', '_', '@'; not starting with '-')"
            )
        slots = 1
        for option in options:
            key, sep, value = option.partition("=")
            if key != "slots" or not sep:
                raise HostfileError(
                    f"{where}: unknown option {option!r}; a line is `host` or `host slots=N`"
                )
            if not value.isdigit() or int(value) < 1:
                raise HostfileError(
                    f"{where}: slots must be a positive integer, got {value!r}"
                )
            slots = int(value)
        if any(h.name == name for h in hosts):
            raise HostfileError(
                f"{where}: host {name!r} is listed twice; list it once with slots=N"
            )
        hosts.append(Host(name, slots))
    if not hosts:
        raise HostfileError(
            f"{source} lists no hosts: write one host per line, e.g. `node0 slots=2`"
        )
    return hosts


def read_hostfile(path: str) -> list[Host]:
    """``parse_hostfile`` on the file at ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise HostfileError(f"cannot read hostfile {path!r}: {err.strerror}") from None
    return parse_hostfile(text, source=path)


def plan(num_processes: int | None, hosts: Sequence[Host] | None = None) -> list[Process]:
    """Ranks in order, filling each host's slots before the next; without hosts, all on this machine."""
    if num_processes is not None and (
        isinstance(num_processes, bool)
        or not isinstance(num_processes, int)
        or num_processes < 1
    ):
        raise LayoutError(
            f"--num-processes must be a positive integer, got {num_processes!r}"
        )
    if hosts is None:
        hosts = [Host("localhost", num_processes or 1)]
    total = sum(h.slots for h in hosts)
    num_processes = total if num_processes is None else num_processes
    if num_processes > total:
        listing = ", ".join(f"{h.name} slots={h.slots}" for h in hosts)
        raise LayoutError(
            f"{num_processes} processes do not fit in the {total} slots of the hostfile ({listing}): "
            f"ask for at most {total} processes, or add hosts or slots"
        )
    processes = []
    for host in hosts:
        for local_rank in range(host.slots):
            if len(processes) < num_processes:
                processes.append(Process(len(processes), host.name, local_rank))
    return processes


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine (then its processes start here, without ssh)."""
    return host in LOCAL_NAMES or host == socket.gethostname()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost``, ``127.x.x.x``, ``::1``), which only this machine reaches."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_port(value: str, option: str) -> tuple[str, str]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not _HOST_RE.match(host):
        raise LayoutError(
            f"{option} must be HOST:PORT (for example 127.0.0.1:1234), got {value!r}"
        )
    return host, port


def coordinator_address(value: str | None, processes: Sequence[Process]) -> str:
    """``HOST:PORT`` for the coordinator: ``value`` checked, or 127.0.0.1 on a free port for a local job."""
    remote = sorted({p.host for p in processes if not is_local(p.host)})
    if value is None:
        if remote:
            raise LayoutError(
                f"remote hosts {remote} cannot reach a coordinator on 127.0.0.1: pass --coordinator "
                f"HOST:PORT with an address of the first host ({processes[0].host}) they can reach"
            )
        return f"127.0.0.1:{free_port()}"
    host, port = _host_port(value, "--coordinator")
    if remote and is_loopback(host):
        raise LayoutError(
            f"--coordinator {value} is a loopback address, which the processes on remote hosts "
            f"{remote} cannot reach: give an address of the first host ({processes[0].host}) "
            "that they can reach"
        )
    if (
        port == "0"
    ):  # a port free here: only meaningful when process 0, whose coordinator binds it, runs here
        if not is_local(processes[0].host):
            raise LayoutError(
                f"--coordinator {value}: port 0 means a port free on this machine, but process 0 runs "
                f"on {processes[0].host}; give the port explicitly"
            )
        try:
            return f"{host}:{free_port(host)}"
        except OSError as error:
            raise LayoutError(
                f"--coordinator {value}: cannot find a free port at {host} on this machine ({error}); "
                "give an address of this machine, or the port explicitly"
            ) from error
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise LayoutError(
            f"--coordinator port must be a number from 1 to 65535 (or 0 for a free one), got {port!r}"
        )
    return value


def bind_address(value: str | None, coordinator: str) -> tuple[str | None, str | None]:
    """``(value checked, a warning or None)`` for ``--bind``, the ``HOST:PORT`` the coordinator listens on."""
    if value is None:
        return None, None
    _, port = _host_port(value, "--bind")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise LayoutError(f"--bind port must be a number from 1 to 65535, got {port!r}")
    coordinator_port = coordinator.rpartition(":")[2]
    if port != coordinator_port:
        return value, (
            f"--bind port {port} is not the coordinator's port {coordinator_port}, to which the other "
            "processes connect: they reach it only if something forwards one to the other"
        )
    return value, None


# --- Commands and environments ------------------------------------------------------------------


def process_env(
    process: Process,
    num_processes: int,
    devices_per_process: int | None,
    coordinator: str,
    bind: str | None,
) -> dict[str, str]:
    """The variables a process needs to join the job (``multihost.initialize()`` reads them)."""
    env = {
        ENV_COORDINATOR: coordinator,
        ENV_NUM_PROCESSES: str(num_processes),
        ENV_PROCESS_ID: str(process.rank),
        "PYTHONUNBUFFERED": "1",
    }  # lines reach the launcher as they are printed, not when a buffer fills
    if devices_per_process is not None:
        env[ENV_NUM_DEVICES] = str(devices_per_process)
    if bind is not None:
        env[ENV_COORDINATOR_BIND] = bind
    return env


# Runs on a remote host as `python -c REMOTE_WATCHDOG GRACE program...`: starts the program in a process group
# of its own and stops that group (SIGTERM, then SIGKILL after GRACE seconds) when stdin closes, which happens
# when the launcher closes it or when ssh or the launcher dies; then exits with the program's status.
REMOTE_WATCHDOG = """\
import os, signal, subprocess, sys, threading, time
grace = float(sys.argv[1])
child = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, start_new_session=True)
def stop(*_):
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
def watch():
    while os.read(0, 4096):
        pass
    stop()
threading.Thread(target=watch, daemon=True).start()
for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(sig, lambda *_: threading.Thread(target=stop).start())
code = child.wait()
try:
    os.killpg(child.pid, signal.SIGKILL)  # whatever the program started and left behind
except ProcessLookupError:
    pass
sys.exit(128 - code if code < 0 else code)
"""


def process_command(
    program: Sequence[str],
    process: Process,
    env: dict[str, str],
    python: str,
    remote_command: Sequence[str],
    cwd: str,
    grace: float = 3.0,
) -> list[str]:
    """The argument list that starts ``program`` for ``process``: directly here, or through ``remote_command``.

    On a remote host the program runs under ``REMOTE_WATCHDOG``, which stops it when its stdin closes.
    """
    if is_local(process.host):
        return [python, *program]
    # ssh joins its arguments into one string for the remote shell: quote every piece of it.
    assignments = [f"{k}={v}" for k, v in env.items()]
    parts = [
        python,
        "-c",
        REMOTE_WATCHDOG,
        f"{grace:g}",
        "env",
        *assignments,
        python,
        *program,
    ]
    return [
        *remote_command,
        process.host,
        f"cd {shlex.quote(cwd)} && exec {shlex.join(parts)}",
    ]


# --- Running ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    """How a job ended: the launcher's exit status, the rank that failed first (if any), and why."""

    returncode: int
    failed_rank: int | None = None
    reason: str = "all processes exited with status 0"


def _status(returncode: int) -> int:
    """A child's exit status as a shell reports it: 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_status(returncode: int) -> str:
    """A ``Popen.returncode`` in words: "exited with status 3", "was killed by SIGKILL"."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


class _Job:
    """Running processes, their output threads and tails; ``stop()`` leaves none of them behind."""

    def __init__(
        self,
        commands: list[tuple[Process, list[str], dict[str, str]]],
        out: IO[str],
        err: IO[str],
        tail_lines: int,
        cwd: str,
    ):
        # A remote process gets a pipe as stdin, kept open and never written: its watchdog stops it when it closes.
        self.lock = threading.Lock()
        width = len(str(len(commands) - 1))
        self.prefix = {p.rank: f"[{p.rank:>{width}}] " for p, _, _ in commands}
        self.tails = {p.rank: collections.deque(maxlen=tail_lines) for p, _, _ in commands}
        self.popens: dict[int, subprocess.Popen] = {}
        self.threads: list[threading.Thread] = []
        self.exits: list[
            tuple[int, int]
        ] = []  # (rank, returncode) in the order the processes ended
        try:
            for process, argv, env in commands:
                # A session of its own: killing the group also kills whatever the process started.
                stdin = subprocess.DEVNULL if is_local(process.host) else subprocess.PIPE
                # A remote command changes directory on its host; a local process starts in ``cwd`` here.
                popen = subprocess.Popen(
                    argv,
                    env={**os.environ, **env},
                    stdin=stdin,
                    cwd=cwd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
                self.popens[process.rank] = popen
                # Two pipes, not one: native libraries write to stderr in pieces, from several threads (gloo too,
                # once multihost.native_stdout_to_stderr sends it there); on one pipe those pieces would land in
                # the middle of the program's stdout lines.
                for stream, sink in ((popen.stdout, out), (popen.stderr, err)):
                    thread = threading.Thread(
                        target=self._pump, args=(process.rank, stream, sink), daemon=True
                    )
                    thread.start()
                    self.threads.append(thread)
                # One waiter per process records exits in the order they happen, so that the process that
                # failed first is blamed, not one that the failure brought down a moment later.
                threading.Thread(
                    target=self._wait_for, args=(process.rank, popen), daemon=True
                ).start()
        except BaseException:
            self.stop(grace=0)
            raise

    def _pump(self, rank: int, stream: IO[bytes], sink: IO[str]) -> None:
        """Copy whole lines from one of a process's pipes to ``sink``, prefixed with its rank."""
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            with self.lock:
                self.tails[rank].append(line)
                try:
                    sink.write(self.prefix[rank] + line + "\n")
                    sink.flush()
                except (BrokenPipeError, ValueError):
                    # The reader went away (``launch ... | head``). Keep draining the pipe: a process whose
                    # output nobody reads blocks once the pipe is full, and the job would never end.
                    pass
        stream.close()

    def _wait_for(self, rank: int, popen: subprocess.Popen) -> None:
        code = popen.wait()
        with self.lock:
            self.exits.append((rank, code))

    def first_failure(self) -> tuple[int, int] | None:
        with self.lock:
            return next(((rank, code) for rank, code in self.exits if code), None)

    def running(self) -> list[int]:
        return [rank for rank, p in self.popens.items() if p.poll() is None]

    def stop(self, grace: float) -> None:
        """Close remote stdins, SIGTERM every process group, SIGKILL what is left after ``grace`` s, then reap."""
        for popen in self.popens.values():
            if popen.stdin is not None:
                # A remote watchdog stops its program now, while ssh still runs.
                with contextlib.suppress(OSError):
                    popen.stdin.close()
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            for popen in self.popens.values():
                # killpg also reaches children of processes that already exited.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(popen.pid, sig)
            deadline = time.monotonic() + wait
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.02)
        for thread in self.threads:
            thread.join(timeout=5.0)


def run(
    program: Sequence[str],
    processes: Sequence[Process],
    *,
    devices_per_process: int | None = None,
    coordinator: str | None = None,
    bind: str | None = None,
    timeout: float | None = None,
    python: str = sys.executable,
    remote_command: Sequence[str] = ("ssh",),
    cwd: str | None = None,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
    tail_lines: int = 20,
    grace: float = 3.0,
) -> Result:
    """Run ``program`` (``[script, args...]`` or ``['-m', module, args...]``) once per process; wait for all.

    Stops every process when one fails or ``timeout`` seconds pass, and says why on ``err``.
    """
    out, err = out or sys.stdout, err or sys.stderr
    cwd = os.getcwd() if cwd is None else cwd
    coordinator = coordinator_address(coordinator, processes)
    commands = []
    for process in processes:
        env = process_env(process, len(processes), devices_per_process, coordinator, bind)
        commands.append(
            (
                process,
                process_command(program, process, env, python, remote_command, cwd, grace),
                env,
            )
        )
    start = time.monotonic()
    job = _Job(commands, out, err, tail_lines, cwd)
    try:
        result = _wait(job, processes, start, timeout)
    finally:  # also on KeyboardInterrupt: never leave a process behind
        job.stop(grace)
    if result.failed_rank is not None or result.returncode == EXIT_TIMEOUT:
        _report(err, result, job)
    return result


def _wait(
    job: _Job, processes: Sequence[Process], start: float, timeout: float | None
) -> Result:
    hosts = {p.rank: p.host for p in processes}
    while True:
        # Read "all done" before the failures: exits are only ever added, so when every process had ended
        # before this check, the failure check below has seen every exit code.
        done = len(job.exits) == len(job.popens)
        failure = job.first_failure()
        if failure is not None:
            rank, code = failure
            others = len(job.running())
            return Result(
                _status(code),
                rank,
                f"rank {rank} (on {hosts[rank]}) {describe_status(code)}; "
                f"stopping the {others} process(es) still running",
            )
        if done:
            return Result(0)
        if timeout is not None and time.monotonic() - start > timeout:
            return Result(
                EXIT_TIMEOUT,
                None,
                f"timed out after {timeout:g} s with ranks {job.running()} still running; stopping them",
            )
        time.sleep(0.02)


def _report(err: IO[str], result: Result, job: _Job) -> None:
    lines = [f"launch: {result.reason}"]
    ranks = [result.failed_rank] if result.failed_rank is not None else sorted(job.tails)
    for rank in ranks:
        tail = list(job.tails[rank])
        lines.append(f"launch: last {len(tail)} line(s) of rank {rank}:")
        lines.extend(f"  {job.prefix[rank]}{line}" for line in tail)
    err.write("\n".join(lines) + "\n")
    err.flush()


# --- Command line -------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    """The command line: options first, then ``script.py args...`` or ``-m module args...``."""
    p = argparse.ArgumentParser(
        allow_abbrev=False,  # `--time 5` must not pass for --timeout: split_command_line knows full names only
        prog="python -m jaxdist_lessons.launch",
        description="Run a JAX program once per process and join them with jax.distributed.",
        epilog="Each process finds its coordinator, the process count and its id in the environment "
        f"({ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}; {ENV_NUM_DEVICES} with "
        "--devices-per-process); jaxdist_lessons.multihost.initialize() reads them.",
    )
    p.add_argument(
        "-n",
        "--num-processes",
        type=int,
        help="processes to start (default: the hostfile's slots, or 1)",
    )
    p.add_argument(
        "-d",
        "--devices-per-process",
        type=int,
        help=f"simulated CPU devices in each process (sets {ENV_NUM_DEVICES})",
    )
    p.add_argument(
        "--hostfile",
        help="one host per line, `name [slots=N]`; other hosts are reached over ssh",
    )
    p.add_argument(
        "--coordinator",
        help="HOST:PORT of process 0's coordinator (default 127.0.0.1 on a free port)",
    )
    p.add_argument(
        "--bind",
        help="HOST:PORT the coordinator listens on (default: the coordinator address, so "
        "a local job listens on loopback only; 0.0.0.0:PORT for all interfaces)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        help="stop every process after this many seconds (exit status 124)",
    )
    p.add_argument(
        "--remote-command",
        default="ssh",
        help="how to reach a remote host, split like a shell would (default: %(default)r); "
        "the launcher appends the host and the command, which stops when its stdin closes "
        "(so not 'ssh -n')",
    )
    p.add_argument(
        "--python",
        default=sys.executable,
        help="the Python that runs the program (default: this one)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=3.0,
        help="seconds between SIGTERM and SIGKILL when stopping processes (default: %(default)g)",
    )
    p.add_argument(
        "--tail",
        type=int,
        default=20,
        help="lines of a failed process to repeat at the end",
    )
    p.add_argument(
        "-m",
        dest="module",
        help="run a module, as python -m does; what follows is its arguments",
    )
    p.add_argument(
        "program",
        nargs="*",
        help="script.py and its arguments (after the launcher's options)",
    )
    return p


def split_command_line(
    p: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[list[str], list[str]]:
    """``(launcher options, program)``: the program starts at the first script name or at ``-m module``.

    Everything after it belongs to the program, options included, as with ``python``.
    """
    takes_value = {
        s
        for a in p._actions
        if a.nargs is None and a.option_strings
        for s in a.option_strings
    }
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if token == "-m":
            return list(argv[: i + 2]), list(argv[i + 2 :])
        if not token.startswith("-") or token == "-":
            return list(argv[:i]), list(argv[i:])
        i += 2 if token in takes_value and "=" not in token else 1
    return list(argv), []


def main(argv: Sequence[str] | None = None) -> int:
    """The command line's entry point; returns the exit status."""
    p = parser()
    options, program = split_command_line(p, sys.argv[1:] if argv is None else argv)
    args = p.parse_args(options)
    if args.module is not None:
        program = ["-m", args.module, *program]
    elif not program:
        p.error("give the program to run: script.py [args...] or -m module [args...]")
    try:
        if args.devices_per_process is not None and args.devices_per_process < 1:
            raise LayoutError(
                f"--devices-per-process must be a positive integer, got {args.devices_per_process}"
            )
        if args.grace < 0 or args.tail < 0:
            raise LayoutError(
                f"--grace and --tail cannot be negative, got {args.grace:g} and {args.tail}"
            )
        if args.timeout is not None and args.timeout <= 0:
            raise LayoutError(
                f"--timeout must be a positive number of seconds, got {args.timeout:g}"
            )
        hosts = read_hostfile(args.hostfile) if args.hostfile else None
        processes = plan(args.num_processes, hosts)
        remote_command = shlex.split(args.remote_command)
        if not remote_command:
            raise LayoutError(
                "--remote-command is empty: give the command that reaches a host, e.g. 'ssh'"
            )
        coordinator = coordinator_address(args.coordinator, processes)
        bind, warning = bind_address(args.bind, coordinator)
    except (HostfileError, LayoutError) as error:
        print(f"launch: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if warning:
        print(f"launch: warning: {warning}", file=sys.stderr)
    # Turn SIGTERM into an exception so that run() stops the job on its way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    result = run(
        program,
        processes,
        devices_per_process=args.devices_per_process,
        coordinator=coordinator,
        bind=bind,
        timeout=args.timeout,
        python=args.python,
        remote_command=remote_command,
        tail_lines=args.tail,
        grace=args.grace,
    )
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
