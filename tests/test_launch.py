"""The launcher: hostfiles, layouts, command lines, and real processes started, prefixed, stopped and reaped.

The processes here are small Python scripts that do not import JAX, so these tests are quick;
tests/test_multihost.py launches real JAX processes.
"""

import io
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxdist_lessons import devices, launch

# Prints what it got, optionally starts a grandchild, then behaves as its arguments say.
WORKER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    rank = int(os.environ["JAXDIST_PROCESS_ID"])
    env = {k: v for k, v in os.environ.items() if k.startswith("JAXDIST_")}
    print(json.dumps({"rank": rank, "pid": os.getpid(), "argv": sys.argv[1:], "env": env}), flush=True)
    if "grandchild" in sys.argv:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(json.dumps({"rank": rank, "pid": child.pid}), flush=True)
    if "fail" in sys.argv and rank == 1:
        time.sleep(1.5)  # time for the others to start their grandchildren
        print("rank 1 gives up", flush=True)
        sys.exit(3)
    if "hang" in sys.argv:
        time.sleep(600)
""")

# What ssh does: join its arguments with spaces and give them to a shell on the other host. The "other host"
# is a session of its own (so the launcher's signals to ssh's process group never reach it, as on a real
# remote host), and its stdin is a pipe that closes when this fake ssh ends, as sshd closes it when the
# connection drops.
FAKE_SSH = textwrap.dedent("""
    import os, subprocess, sys, threading
    print("fake ssh to", sys.argv[1], flush=True)
    remote = subprocess.Popen(["sh", "-c", " ".join(sys.argv[2:])], stdin=subprocess.PIPE,
                              start_new_session=True)
    def relay():
        while data := os.read(0, 4096):
            remote.stdin.write(data)
            remote.stdin.flush()
        remote.stdin.close()
    threading.Thread(target=relay, daemon=True).start()
    sys.exit(remote.wait())
""")


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return str(path)


def launch_cli(*args, timeout=60, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "jaxdist_lessons.launch", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def records(stdout):
    """The JSON lines of each rank, keyed by the rank prefix the launcher wrote."""
    out = []
    for line in stdout.splitlines():
        prefix, _, rest = line.partition("] ")
        if rest.startswith("{"):
            out.append((int(prefix.strip("[ ")), json.loads(rest)))
    return out


def alive(pid):
    """Whether ``pid`` is a running process (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_none_left(pids, within=5.0):
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "processes left behind"


# --- Hostfiles ----------------------------------------------------------------------------------


def test_parse_hostfile_reads_hosts_slots_and_comments():
    text = "# the cluster\nnode0 slots=2\n\nnode1   # one process\n10.0.0.7 slots=4\n"
    assert launch.parse_hostfile(text) == [
        launch.Host("node0", 2),
        launch.Host("node1", 1),
        launch.Host("10.0.0.7", 4),
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("node0 slots=0", "slots must be a positive integer, got '0'"),
        ("node0 slots=two", "slots must be a positive integer, got 'two'"),
        ("node0 cpus=2", "unknown option 'cpus=2'"),
        ("node0 2", "unknown option '2'"),
        ("node0;reboot", "'node0;reboot' is not a host name"),
        ("$(reboot)", "is not a host name"),
        ("-oProxyCommand=reboot", "not starting with '-'"),
        (
            "node0\nnode1\nnode0 slots=2",
            "hosts.txt:3: 'node0 slots=2': host 'node0' is listed twice",
        ),
        ("# nothing\n\n", "hosts.txt lists no hosts"),
    ],
)
def test_bad_hostfiles_are_rejected_with_the_line(text, message):
    with pytest.raises(launch.HostfileError) as error:
        launch.parse_hostfile(text, source="hosts.txt")
    assert message in str(error.value)


def test_missing_hostfile(tmp_path):
    with pytest.raises(launch.HostfileError, match="cannot read hostfile .*No such file"):
        launch.read_hostfile(str(tmp_path / "nope.txt"))


# --- Layouts --------------------------------------------------------------------------------------


def test_plan_fills_hosts_in_order():
    hosts = [launch.Host("a", 2), launch.Host("b", 2)]
    assert launch.plan(3, hosts) == [
        launch.Process(0, "a", 0),
        launch.Process(1, "a", 1),
        launch.Process(2, "b", 0),
    ]
    assert len(launch.plan(None, hosts)) == 4
    assert launch.plan(None) == [launch.Process(0, "localhost", 0)]
    assert [p.host for p in launch.plan(3)] == ["localhost"] * 3


@pytest.mark.parametrize(
    "num_processes, hosts, message",
    [
        (
            5,
            [launch.Host("a", 2), launch.Host("b", 2)],
            "5 processes do not fit in the 4 slots",
        ),
        (0, None, "--num-processes must be a positive integer, got 0"),
    ],
)
def test_impossible_layouts(num_processes, hosts, message):
    with pytest.raises(launch.LayoutError, match=message):
        launch.plan(num_processes, hosts)


def test_coordinator_address():
    local = launch.plan(2)
    host, port = launch.coordinator_address(None, local).split(":")
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert launch.coordinator_address("10.0.0.1:1234", local) == "10.0.0.1:1234"
    with pytest.raises(
        launch.LayoutError, match="remote hosts \\['node1'\\] cannot reach a coordinator"
    ):
        launch.coordinator_address(
            None, launch.plan(2, [launch.Host("localhost"), launch.Host("node1")])
        )
    for bad in ["1234", "node0:", "node0:99999", "node0:http", ":1234"]:
        with pytest.raises(launch.LayoutError, match="--coordinator"):
            launch.coordinator_address(bad, local)
    # Port 0: a port free on this machine, so only for a process 0 that runs here, at an address of this machine.
    host, port = launch.coordinator_address("127.0.0.1:0", local).split(":")
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    elsewhere = launch.plan(2, [launch.Host("node0"), launch.Host("localhost")])
    with pytest.raises(
        launch.LayoutError,
        match="port 0 means a port free on this machine, but process 0 runs on "
        "node0; give the port explicitly",
    ):
        launch.coordinator_address("node0:0", elsewhere)
    with pytest.raises(
        launch.LayoutError, match="cannot find a free port at 192.0.2.1 on this machine"
    ):
        launch.coordinator_address(
            "192.0.2.1:0", local
        )  # TEST-NET-1: an address no machine here has


def test_command_line_splits_at_the_program():
    p = launch.parser()
    assert launch.split_command_line(
        p, ["-n", "2", "-m", "mod", "--out", "x", "hello"]
    ) == (["-n", "2", "-m", "mod"], ["--out", "x", "hello"])
    assert launch.split_command_line(
        p, ["--timeout=3", "-d", "4", "train.py", "-n", "5"]
    ) == (["--timeout=3", "-d", "4"], ["train.py", "-n", "5"])
    assert launch.split_command_line(p, ["-n", "2", "--", "-weird.py"]) == (
        ["-n", "2"],
        ["-weird.py"],
    )


def test_exit_statuses_in_words():
    assert launch.describe_status(3) == "exited with status 3"
    assert launch.describe_status(-9) == "was killed by SIGKILL"


def test_the_devices_variable_is_the_one_setup_reads():
    assert launch.ENV_NUM_DEVICES == devices.ENV_VAR


def test_remote_commands_quote_every_argument():
    process = launch.Process(0, "node1", 0)
    argv = launch.process_command(
        ["train.py", "a b", "$HOME;x"],
        process,
        {"X": "1 2"},
        "/venv/bin/python",
        ["ssh", "-q"],
        "/my dir",
    )
    assert argv[:3] == ["ssh", "-q", "node1"] and len(argv) == 4
    watchdog = shlex.quote(launch.REMOTE_WATCHDOG)
    assert argv[3] == (
        f"cd '/my dir' && exec /venv/bin/python -c {watchdog} 3 env 'X=1 2' /venv/bin/python "
        "train.py 'a b' '$HOME;x'"
    )
    assert launch.process_command(
        ["t.py"], launch.Process(0, "localhost", 0), {}, "py", ["ssh"], "/"
    ) == ["py", "t.py"]


# --- Real processes -------------------------------------------------------------------------------


def test_every_process_gets_its_rank_and_prefixed_lines(worker):
    result = launch_cli("-n", "3", "-d", "2", worker, "an arg", "--flag")
    assert result.returncode == 0, result.stderr
    seen = records(result.stdout)
    assert sorted(rank for rank, _ in seen) == [0, 1, 2]
    coordinators = set()
    for prefix_rank, record in seen:
        assert record["rank"] == prefix_rank
        assert record["argv"] == ["an arg", "--flag"]
        env = record["env"]
        assert env["JAXDIST_NUM_PROCESSES"] == "3" and env["JAXDIST_NUM_DEVICES"] == "2"
        coordinators.add(env["JAXDIST_COORDINATOR"])
    [coordinator] = coordinators
    assert coordinator.startswith("127.0.0.1:")


# Prints whole lines to stdout while two threads write to stderr in pieces, as gloo does from C++.
CHATTY = textwrap.dedent("""
    import os, threading
    def chatter(name):
        for i in range(200):
            for piece in (f"[{name}] connected ", "to 7 peers", "\\n"):
                os.write(2, piece.encode())
    threads = [threading.Thread(target=chatter, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for i in range(200):
        print(f"line {i} of the program", flush=True)
    for t in threads:
        t.join()
""")


def test_stdout_and_stderr_stay_apart_so_lines_stay_whole(tmp_path):
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    result = launch_cli("-n", "2", str(script))
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        lines = [
            line for line in result.stdout.splitlines() if line.startswith(f"[{rank}] ")
        ]
        assert lines == [f"[{rank}] line {i} of the program" for i in range(200)]
        chatter = [
            line for line in result.stderr.splitlines() if line.startswith(f"[{rank}] ")
        ]
        assert (
            sum(line.count("connected") for line in chatter) == 400
        )  # every piece arrived, on stderr
    assert "connected" not in result.stdout


def test_local_processes_start_in_the_directory_run_is_given(tmp_path):
    script = tmp_path / "where.py"
    script.write_text("import os; print(os.getcwd())")
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    out, err = io.StringIO(), io.StringIO()
    result = launch.run(
        [str(script)], launch.plan(2), cwd=str(workdir), out=out, err=err, timeout=60
    )
    assert result.returncode == 0, err.getvalue()
    assert sorted(out.getvalue().splitlines()) == [f"[0] {workdir}", f"[1] {workdir}"]


def test_a_shortened_option_is_refused_not_taken_for_the_program(worker):
    result = launch_cli("--time", "5", worker)
    assert result.returncode == 2
    assert "unrecognized arguments: --time" in result.stderr


def test_a_reader_that_goes_away_does_not_hang_the_job(tmp_path):
    # `launch ... | head -1`: the launcher's stdout closes after one line, while the program still prints.
    script = tmp_path / "loud.py"
    script.write_text("for i in range(100_000):\n    print(f'line {i}')\n")
    launcher = [sys.executable, "-m", "jaxdist_lessons.launch", str(script)]
    result = subprocess.run(
        f"{shlex.join(launcher)} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
    )  # before the fix: the program blocked on a full pipe, forever
    assert result.stdout == "[0] line 0\n"


class ExitsRightAfterTheFailureCheck:
    """A job whose last process fails between the launcher's failure check and its "all done" check."""

    def __init__(self):
        self.popens, self.exits, self.checks = {0: None, 1: None}, [(0, 0)], 0

    def first_failure(self):
        self.checks += 1
        failure = next(((rank, code) for rank, code in self.exits if code), None)
        if self.checks == 1:
            self.exits.append((1, 3))  # rank 1 exits with status 3 just after this check
        return failure

    def running(self):
        return [rank for rank in self.popens if rank not in dict(self.exits)]


def test_a_process_that_fails_last_is_never_reported_as_success():
    processes = launch.plan(2)
    result = launch._wait(
        ExitsRightAfterTheFailureCheck(), processes, time.monotonic(), None
    )
    assert (result.returncode, result.failed_rank) == (3, 1)


def test_a_failing_process_stops_the_others_at_once(worker):
    start = time.monotonic()
    result = launch_cli("-n", "3", worker, "grandchild", "fail", "hang")
    elapsed = time.monotonic() - start
    assert result.returncode == 3, result.stderr
    assert elapsed < 30
    assert (
        "launch: rank 1 (on localhost) exited with status 3; stopping the 2 process(es) still running"
        in result.stderr
    )
    assert "[1] rank 1 gives up" in result.stderr  # its last lines are repeated at the end
    pids = [record["pid"] for _, record in records(result.stdout)]
    assert len(pids) >= 5  # 3 workers, and the grandchildren of those that got that far
    assert_none_left(pids)


def test_a_hung_job_is_stopped_by_the_timeout(worker):
    start = time.monotonic()
    result = launch_cli("-n", "2", "--timeout", "2", worker, "grandchild", "hang")
    elapsed = time.monotonic() - start
    assert result.returncode == launch.EXIT_TIMEOUT
    assert 2 <= elapsed < 15
    assert (
        "launch: timed out after 2 s with ranks [0, 1] still running; stopping them"
        in result.stderr
    )
    pids = [record["pid"] for _, record in records(result.stdout)]
    assert len(pids) == 4
    assert_none_left(pids)


def test_stopping_the_launcher_stops_the_job(worker):
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxdist_lessons.launch",
            "-n",
            "2",
            worker,
            "grandchild",
            "hang",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = []
    while len(pids) < 4:
        line = launcher.stdout.readline()
        assert line, "the launcher ended early"
        pids += [record["pid"] for _, record in records(line)]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    launcher.stdout.close()
    assert_none_left(pids)


def test_remote_hosts_go_through_the_remote_command(worker, tmp_path):
    fake_ssh = tmp_path / "fake_ssh.py"
    fake_ssh.write_text(FAKE_SSH)
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\nnode7 slots=2\n")
    tricky = "it's; echo INJECTED $HOME"
    result = launch_cli(
        "--hostfile",
        str(hostfile),
        "--coordinator",
        "node0:1234",
        "--remote-command",
        f"{sys.executable} {fake_ssh}",
        worker,
        tricky,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    seen = dict(records(result.stdout))
    assert sorted(seen) == [0, 1, 2]
    assert all(
        record["argv"] == [tricky] for record in seen.values()
    )  # arrived intact, nothing ran
    assert "INJECTED" not in result.stdout.replace(tricky, "")
    assert (
        result.stdout.count("fake ssh to node7") == 2
        and "fake ssh to localhost" not in result.stdout
    )
    assert {record["env"]["JAXDIST_PROCESS_ID"] for record in seen.values()} == {
        "0",
        "1",
        "2",
    }


@pytest.fixture
def fake_ssh(tmp_path):
    path = tmp_path / "fake_ssh.py"
    path.write_text(FAKE_SSH)
    return f"{sys.executable} {path}"


def test_killing_ssh_leaves_the_remote_program_running(fake_ssh):
    """The problem the watchdog solves, shown with the fake ssh: its remote program outlives it."""
    ssh = subprocess.Popen(
        [
            *shlex.split(fake_ssh),
            "node7",
            "exec",
            sys.executable,
            "-c",
            shlex.quote("import os, time; print(os.getpid(), flush=True); time.sleep(600)"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ssh.stdout.readline()  # "fake ssh to node7"
    remote = int(ssh.stdout.readline())
    os.killpg(ssh.pid, signal.SIGKILL)  # what the launcher does to a local process group
    ssh.wait()
    try:
        time.sleep(0.5)
        assert alive(remote)
    finally:
        os.kill(remote, signal.SIGKILL)
        ssh.stdin.close()
        ssh.stdout.close()


@pytest.mark.parametrize("stop", ["timeout", "failure", "launcher killed"])
def test_stopping_a_job_stops_its_remote_processes(worker, tmp_path, fake_ssh, stop):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("node7 slots=3\n")
    args = [
        "--hostfile",
        str(hostfile),
        "--coordinator",
        "node7:1234",
        "--remote-command",
        fake_ssh,
        "--grace",
        "1",
    ]
    if (
        stop == "launcher killed"
    ):  # SIGKILL: the launcher cannot clean up; its pipes to ssh close as it dies
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxdist_lessons.launch",
                *args,
                worker,
                "grandchild",
                "hang",
            ],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        pids = []
        while len(pids) < 6:
            line = launcher.stdout.readline()
            assert line, "the launcher ended early"
            pids += [record["pid"] for _, record in records(line)]
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()
    else:
        extra = ["--timeout", "3"] if stop == "timeout" else []
        result = launch_cli(
            *args,
            *extra,
            worker,
            "grandchild",
            "hang",
            *(["fail"] if stop == "failure" else []),
        )
        assert result.returncode == (launch.EXIT_TIMEOUT if stop == "timeout" else 3), (
            result.stderr
        )
        pids = [record["pid"] for _, record in records(result.stdout)]
        assert (
            len(pids) >= 5
        )  # 3 remote workers, and the grandchildren of those that got that far
    assert_none_left(pids, within=10.0)


def test_bind_addresses():
    assert launch.bind_address(None, "node0:1234") == (None, None)
    assert launch.bind_address("0.0.0.0:1234", "node0:1234") == ("0.0.0.0:1234", None)
    assert launch.bind_address("[::]:1234", "node0:1234") == ("[::]:1234", None)
    value, warning = launch.bind_address("0.0.0.0:99", "node0:1234")
    assert (
        value == "0.0.0.0:99"
        and "--bind port 99 is not the coordinator's port 1234" in warning
    )
    for bad, message in [
        ("0.0.0.0", "--bind must be HOST:PORT"),
        ("0.0.0.0:0", "from 1 to 65535"),
        ("a b:1", "--bind must be HOST:PORT"),
        ("0.0.0.0:x", "from 1 to 65535"),
    ]:
        with pytest.raises(launch.LayoutError, match=message):
            launch.bind_address(bad, "node0:1234")


def test_a_loopback_coordinator_with_remote_hosts_is_an_error():
    remote = launch.plan(2, [launch.Host("localhost"), launch.Host("node1")])
    for loopback in ["127.0.0.1:1234", "localhost:1234", "127.0.1.1:1234", "[::1]:1234"]:
        with pytest.raises(
            launch.LayoutError,
            match="loopback address, which the processes on remote hosts "
            "\\['node1'\\] cannot reach",
        ):
            launch.coordinator_address(loopback, remote)
    assert launch.coordinator_address("10.0.0.1:1234", remote) == "10.0.0.1:1234"
    assert launch.coordinator_address("127.0.0.1:1234", launch.plan(2)) == "127.0.0.1:1234"


def test_a_bind_port_that_differs_is_a_warning(worker):
    result = launch_cli(
        "-n", "1", "--coordinator", "127.0.0.1:1234", "--bind", "127.0.0.1:1235", worker
    )
    assert result.returncode == 0
    assert (
        "launch: warning: --bind port 1235 is not the coordinator's port 1234"
        in result.stderr
    )
    [(_, record)] = records(result.stdout)
    assert record["env"]["JAXDIST_COORDINATOR_BIND"] == "127.0.0.1:1235"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["-n", "5", "--hostfile", "{hostfile}", "x.py"],
            "5 processes do not fit in the 2 slots",
        ),
        (["--hostfile", "{tmp}/missing.txt", "x.py"], "cannot read hostfile"),
        (["--hostfile", "{badfile}", "x.py"], "slots must be a positive integer"),
        (
            ["-n", "2", "-d", "0", "x.py"],
            "--devices-per-process must be a positive integer, got 0",
        ),
        (["-n", "2", "--timeout", "-1", "x.py"], "--timeout must be a positive number"),
        (
            ["-n", "2", "--coordinator", "nowhere", "x.py"],
            "--coordinator must be HOST:PORT",
        ),
        (["-n", "2", "--bind", "everywhere", "x.py"], "--bind must be HOST:PORT"),
        (
            ["--hostfile", "{remote}", "--coordinator", "127.0.0.1:1234", "x.py"],
            "is a loopback address",
        ),
        (["-n", "2"], "give the program to run"),
    ],
)
def test_command_line_errors_exit_2_with_a_message(tmp_path, args, message):
    (tmp_path / "hosts.txt").write_text("localhost slots=2\n")
    (tmp_path / "bad.txt").write_text("localhost slots=-1\n")
    (tmp_path / "remote.txt").write_text("localhost\nnode1\n")
    names = {
        "hostfile": tmp_path / "hosts.txt",
        "badfile": tmp_path / "bad.txt",
        "tmp": tmp_path,
        "remote": tmp_path / "remote.txt",
    }
    result = launch_cli(*[a.format(**names) for a in args])
    assert result.returncode == launch.EXIT_USAGE
    assert message in result.stderr
    assert result.stdout == ""
