"""Where the test suite's time goes: by stage, by test and chapter, and by kind of work.

Runs the README's second command (``pytest``, then ``jupyter-book build .``), or with
``--ci`` the whole of ``.ci/run``, and prints:

- each stage's seconds (``--ci``: each ``== `` section of ``.ci/run``'s output);
- the slowest tests and chapters (setup, call and teardown together, as each ran on its
  worker), and the seconds per test module;
- the seconds every Python process of the run spent importing, tracing and compiling
  (JAX's own compile events, read from a persistent cache or not), and the rest, with
  its CPU seconds, by kind of process: pytest and its workers, the chapters' kernels,
  and the jobs the tests and chapters start (the LM recipe, ``mpirun`` and ``srun``
  jobs, examples);
- the CPU seconds ``pytest`` and every process it waited for used, as a share of what
  the cores could give over its wall time: below 100%, the cores sat idle.

Each process reports itself through a ``sitecustomize`` module this script puts first on
``PYTHONPATH``: it times the outermost ``import`` statements, listens to
``jax.monitoring``'s compile events once JAX is imported, and writes one line at exit. A
process killed by a signal writes nothing (a hang test's kernel, a timed-out job), so the
kinds' sums are lower bounds; the stages and tests are the wall clock.

    python benchmarks/suite_time.py                    # pytest, then the build
    python benchmarks/suite_time.py --ci               # .ci/run, stage by stage
    python benchmarks/suite_time.py --install /tmp/v   # a fresh venv first, timed
    python benchmarks/suite_time.py -- tests/test_zero.py -n 0   # pytest's arguments

A benchmark, not a test: it prints a table and asserts nothing. Quote its tables in a
closing note, so that the next change can see what it added.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Put first on PYTHONPATH, so that every Python process of the run reports itself.
SITECUSTOMIZE = r"""
import atexit, builtins, json, os, sys, threading, time

_started = time.perf_counter()
_times = {"import": 0.0, "trace": 0.0, "lower": 0.0, "compile": 0.0, "cached": 0.0}
_local = threading.local()
_import = builtins.__import__
_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cached",
}
_listening = []


def _on_event(event, seconds, **kwargs):
    kind = _EVENTS.get(event)
    if kind:
        _times[kind] += seconds


def _timed_import(name, globals=None, locals=None, fromlist=(), level=0):
    if getattr(_local, "depth", 0):
        return _import(name, globals, locals, fromlist, level)
    _local.depth = 1
    start = time.perf_counter()
    try:
        return _import(name, globals, locals, fromlist, level)
    finally:
        _times["import"] += time.perf_counter() - start
        _local.depth = 0
        if not _listening and "jax._src.monitoring" in sys.modules:
            _listening.append(True)
            sys.modules["jax._src.monitoring"].register_event_duration_secs_listener(
                _on_event
            )


builtins.__import__ = _timed_import


def _report():
    # The folder beside this file: a job whose environment was cleared still finds it.
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "records")
    record = dict(
        _times,
        pid=os.getpid(),
        argv=sys.argv[:4],
        seconds=time.perf_counter() - _started,
        cpu=time.process_time(),
        devices=os.environ.get("JAXDIST_NUM_DEVICES", ""),
        pytest="pytest" in sys.modules,
    )
    try:
        with open(os.path.join(folder, f"process-{os.getpid()}.json"), "w") as f:
            json.dump(record, f)
    except OSError:  # the run's folder is gone: nothing to report to
        pass


atexit.register(_report)
"""

# Loaded into pytest with -p (PYTEST_ADDOPTS): one line per test phase, from the controller.
PLUGIN = r"""
import json, os, sys

import pytest

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "records")
_last = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # On the worker: the seconds this phase spent tracing, lowering and compiling.
    outcome = yield
    times = getattr(sys.modules.get("sitecustomize"), "_times", {})
    spent = sum(times.get(k, 0.0) - _last.get(k, 0.0) for k in ("trace", "lower", "compile"))
    _last.update(times)
    outcome.get_result().user_properties.append(("compiling", spent))


def pytest_unconfigure(config):
    # A worker reports here too, before its atexit: in one full run a worker left no
    # record at exit (why is not known); atexit, if it runs, writes the same file.
    report = getattr(sys.modules.get("sitecustomize"), "_report", None)
    if report and os.environ.get("PYTEST_XDIST_WORKER"):
        report()


def pytest_runtest_logreport(report):
    # On the controller (or in a run without workers): one line per phase.
    if hasattr(report, "node") or not os.environ.get("PYTEST_XDIST_WORKER"):
        line = dict(
            nodeid=report.nodeid,
            when=report.when,
            seconds=report.duration,
            compiling=dict(report.user_properties).get("compiling", 0.0),
            devices=os.environ.get("JAXDIST_NUM_DEVICES", ""),
        )
        with open(os.path.join(FOLDER, f"tests-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
"""


def process_kind(record: dict) -> str:
    """Which part of the suite a process was: pytest's, a chapter's kernel, or a job.
    A job is any other process: the recipe (``python -m jaxdist_lm.train``, whose
    ``argv[0]`` at exit is the module's file, ``.../jaxdist_lm/train.py``), ``mpirun``
    and ``srun`` jobs, the examples."""
    if any("ipykernel" in arg for arg in record["argv"]):
        return "chapter kernels"
    if record["pytest"]:
        return "pytest and its workers"
    return "jobs and other processes"


def program(record: dict) -> str:
    """A job's program, to group its processes: the script or module it ran, as its
    folder and file (``python -m pkg`` as ``pkg``), or ``-c`` for a one-line command."""
    argv = record["argv"] or ["?"]
    path = pathlib.Path(argv[0])
    if path.name == "__main__.py":
        return path.parent.name
    if path.name == argv[0]:  # -c, or a name without a folder
        return argv[0]
    return f"{path.parent.name}/{path.name}"


def job_table(folder: pathlib.Path, top: int = 15) -> list[str]:
    """The jobs by program: how many processes ran it, their lifetime, CPU and
    importing seconds, the largest CPU first."""
    sums: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in folder.glob("process-*.json"):
        record = json.loads(path.read_text())
        if process_kind(record) != "jobs and other processes":
            continue
        s = sums[program(record)]
        s["processes"] += 1
        s["seconds"] += record["seconds"]
        s["cpu"] += record.get("cpu", 0.0)
        s["import"] += record["import"]
        s["compile"] += record["compile"]
    out = [
        "| processes | program | lifetime s | CPU s | importing | compiling |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    ranked = sorted(sums.items(), key=lambda item: -item[1]["cpu"])
    for name, s in ranked[:top]:
        out.append(
            f"| {s['processes']} | `{name}` | {s['seconds']:.1f} | {s['cpu']:.1f} "
            f"| {s['import']:.1f} | {s['compile']:.1f} |"
        )
    return out


def run_timed(command: list[str], env: dict[str, str]) -> list[tuple[float, str]]:
    """Run ``command``, echo its output, and return each line with its time."""
    lines = []
    start = time.perf_counter()
    with subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    ) as process:
        for line in process.stdout:
            sys.stdout.write(line)
            lines.append((time.perf_counter() - start, line.rstrip("\n")))
    lines.append((time.perf_counter() - start, f"(exit {process.returncode})"))
    return lines


def children_cpu() -> float:
    """CPU seconds (user and system) of this process's children and theirs, waited for."""
    times = os.times()
    return times.children_user + times.children_system


def stages(lines: list[tuple[float, str]], first: str) -> list[tuple[str, float]]:
    """Seconds from each ``== `` line of ``.ci/run`` to the next; before the first, ``first``."""
    marks = [(0.0, first)] + [
        (t, text[3:]) for t, text in lines if text.startswith("== ")
    ]
    ends = [t for t, _ in marks[1:]] + [lines[-1][0]]
    return [(name, end - t) for (t, name), end in zip(marks, ends)]


def test_table(folder: pathlib.Path, top: int) -> list[str]:
    """The slowest tests and chapters, and the seconds per module, per device count."""
    per_test = collections.Counter()
    compiling = collections.Counter()
    for path in folder.glob("tests-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            key = (record["nodeid"], record["devices"] or "8")
            per_test[key] += record["seconds"]
            compiling[key] += record["compiling"]
    out = [
        "| seconds | compiling in the test's own process | test or chapter (devices) |",
        "|---:|---:|---|",
    ]
    for (nodeid, devices), seconds in per_test.most_common(top):
        spent = compiling[nodeid, devices]
        out.append(f"| {seconds:.1f} | {spent:.1f} | `{nodeid}` ({devices}) |")
    per_module = collections.Counter()
    count = collections.Counter()
    for (nodeid, devices), seconds in per_test.items():
        per_module[(nodeid.split("::")[0], devices)] += seconds
        count[(nodeid.split("::")[0], devices)] += 1
    out += ["", "| seconds | tests | module or chapter (devices) |", "|---:|---:|---|"]
    for (module, devices), seconds in per_module.most_common():
        out.append(
            f"| {seconds:.1f} | {count[module, devices]} | `{module}` ({devices}) |"
        )
    total = sum(per_test.values())
    out.append(f"| {total:.1f} | {len(per_test)} | all, summed over the workers |")
    return out


def kind_table(folder: pathlib.Path) -> list[str]:
    """Seconds spent importing, tracing, lowering, compiling and otherwise, by process kind."""
    columns = ["import", "trace", "lower", "compile", "cached"]
    sums: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in folder.glob("process-*.json"):
        record = json.loads(path.read_text())
        kind = process_kind(record)
        sums[kind]["processes"] += 1
        sums[kind]["seconds"] += record["seconds"]
        sums[kind]["cpu"] += record.get("cpu", 0.0)
        for column in columns:
            sums[kind][column] += record[column]
    out = [
        "| processes | kind | lifetime s | CPU s | importing | tracing "
        "| lowering to HLO | compiling | of which cache reads | the rest |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, s in sorted(sums.items(), key=lambda item: -item[1]["seconds"]):
        rest = s["seconds"] - s["import"] - s["trace"] - s["lower"] - s["compile"]
        out.append(
            f"| {s['processes']} | {kind} | {s['seconds']:.1f} | {s['cpu']:.1f} "
            f"| {s['import']:.1f} "
            f"| {s['trace']:.1f} | {s['lower']:.1f} | {s['compile']:.1f} "
            f"| {s['cached']:.1f} | {rest:.1f} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ci", action="store_true", help="run .ci/run instead")
    parser.add_argument(
        "--install", metavar="DIR", help="time a fresh venv's install first"
    )
    parser.add_argument("--no-build", action="store_true", help="pytest only")
    parser.add_argument("--top", type=int, default=60, help="how many slowest tests")
    parser.add_argument(
        "--keep", metavar="DIR", help="copy each process's record into DIR"
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = parser.parse_args()

    env = dict(os.environ)
    timings: list[tuple[str, float]] = []
    if args.install:
        venv = pathlib.Path(args.install)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
        pip = [venv / "bin" / "python", "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "--upgrade", "pip"], check=True, cwd=ROOT)
        subprocess.run([*pip, "-r", "requirements.txt"], check=True, cwd=ROOT)
        timings.append(
            ("install: pip install -r requirements.txt", time.perf_counter() - start)
        )
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
        env["VIRTUAL_ENV"] = str(venv)

    with tempfile.TemporaryDirectory(prefix="suite_time_") as tmp:
        folder = pathlib.Path(tmp)
        (folder / "records").mkdir()
        (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
        (folder / "suite_time_plugin.py").write_text(PLUGIN)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(folder), env.get("PYTHONPATH", "")) if p
        )
        env["PYTEST_ADDOPTS"] = f"-p suite_time_plugin {env.get('PYTEST_ADDOPTS', '')}"
        if args.ci:
            lines = run_timed(["bash", ".ci/run"], env)
            timings += stages(
                lines, "install: a fresh venv, requirements.txt and parity"
            )
        else:
            before = children_cpu()
            lines = run_timed(["pytest", *args.pytest_args], env)
            timings.append(("pytest", lines[-1][0]))
            busy = (children_cpu() - before, lines[-1][0])
            if not args.no_build:
                lines = run_timed(["jupyter-book", "build", "."], env)
                timings.append(("jupyter-book build .", lines[-1][0]))

        print()
        print(
            f"## The suite's time: {os.cpu_count()} cores, {datetime.date.today()}, "
            f"python {sys.version.split()[0]}"
        )
        print()
        print("| seconds | stage |")
        print("|---:|---|")
        for name, seconds in timings:
            print(f"| {seconds:.0f} | {name} |")
        print(f"| {sum(s for _, s in timings):.0f} | all |")
        print()
        if not args.ci:
            cpu, wall = busy
            print(
                f"`pytest`'s processes used {cpu:.0f} CPU-seconds: "
                f"{cpu / (wall * os.cpu_count()):.0%} of {os.cpu_count()} cores "
                f"over its {wall:.0f} s (a daemon's, such as slurmd's, not counted)."
            )
            print()
        print("\n".join(test_table(folder / "records", args.top)))
        print()
        print(
            "Seconds by kind of work, summed over every Python process (lower bounds):"
        )
        print()
        print("\n".join(kind_table(folder / "records")))
        print()
        print("The jobs and other processes, by program:")
        print()
        print("\n".join(job_table(folder / "records")))
        if args.keep:
            shutil.copytree(folder / "records", args.keep, dirs_exist_ok=True)


if __name__ == "__main__":
    main()
