"""The recipe's step deadline (``jaxdist_lm/resilience.py``): its report, and its thread
against a key-value store in memory.

Its run across real processes, where it ends a job, is chapter 07's hang lab (the ``sleep``
case); the recipe's own runs of ``--step-timeout`` (one process stuck, and one of two under
``mpirun`` stopped by SIGSTOP) are in ``test_lm_recipe.py``.
"""

import os
import re
import time

from jaxdist_lm import resilience


class FakeStore:
    """The three calls of the coordination service's client that the deadline uses."""

    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        if key in self.values and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.values[key] = value

    def key_value_try_get(self, key):
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.values[key]

    def key_value_dir_get(self, prefix):
        # list(): another process's thread may add its first heartbeat meanwhile
        return [(k, v) for k, v in list(self.values.items()) if k.startswith(prefix)]

    def stopped_at(self, index, step):
        """What a process stopped by SIGSTOP left: its step, and a heartbeat that no
        longer changes."""
        self.values[f"lm_deadline/step/{index}"] = str(step)
        self.values[f"lm_deadline/beat/{index}"] = "41"


def test_report_names_the_processes_behind():
    assert resilience.deadline_report({0: 3, 1: 2, 2: 3}, 4, 5) == (
        "step timeout: processes 1, 3 did not reach step 3 within 5 s (process 1 at step 2, "
        "process 3 at no step); processes 0, 2 wait at step 3"
    )


def test_report_says_when_every_process_is_stuck_in_the_same_step():
    assert resilience.deadline_report({0: 7, 1: 7}, 2, 2.5).startswith(
        "step timeout: every process reached step 7 and none went further within 2.5 s"
    )


STOPPED = (
    "paused by SIGSTOP, a debugger or a suspended VM, or blocked in the kernel on a "
    "file system or a driver)"
)


def test_report_names_the_stopped_processes_first():
    steps = {0: 4, 1: 3, 2: 2, 3: 4}
    assert resilience.deadline_report(steps, 5, 6, {1: 3.04, 4: 2.96}) == (
        "step timeout: processes 1, 4 stopped running (process 1 at step 3, process 4 "
        f"at no step; no heartbeat for 3 s: {STOPPED}; process 2 did not reach step 4 "
        "within 6 s (process 2 at step 2); processes 0, 3 wait at step 4"
    )
    # stopped in the step the others are in: not a deadlock
    assert resilience.deadline_report({0: 3, 1: 3}, 2, 6, {0: 2.5}) == (
        "step timeout: process 0 stopped running (process 0 at step 3; no heartbeat "
        f"for 2.5 s: {STOPPED}; process 1 waits at step 3"
    )


def watched(store, index, ended, log, seconds=0.3, num_processes=2):
    dog = resilience.StepDeadline(
        seconds,
        poll_s=0.05,
        client=store,
        process_index=index,
        num_processes=num_processes,
        stream=log.open("a"),  # faulthandler writes to a file descriptor
    )
    dog._end = ended.append  # record the report instead of ending the test's process
    return dog.start()


def wait_for(ended, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not ended and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_process_whose_step_stops_advancing_reports_and_the_others_follow(tmp_path):
    store, ended0, ended1 = FakeStore(), [], []
    log = tmp_path / "log"
    dog0, dog1 = watched(store, 0, ended0, log), watched(store, 1, ended1, log)
    for k in range(3):  # both advance: nothing fires
        dog0.reached(k), dog1.reached(k)
        time.sleep(0.1)
    assert not ended0 and not ended1
    dog0.reached(3)  # process 1 never reaches step 3
    wait_for(ended0), wait_for(ended1)
    expected = (
        "step timeout: process 1 did not reach step 3 within 0.3 s (process 1 at step 2); "
        "process 0 waits at step 3"
    )
    assert store.values["lm_deadline/fired"] == expected
    # process 1 read process 0's report
    assert expected in ended0 and expected in ended1
    dog0.stop(), dog1.stop()


def test_a_stopped_process_is_named_by_its_heartbeat_and_live_ones_are_not(tmp_path):
    store, ended0, ended1 = FakeStore(), [], []
    log = tmp_path / "log"
    # 0.6 s: the threads listen from 0.3 s; quiet after max(3 polls, 0.15 s)
    dog0 = watched(store, 0, ended0, log, seconds=0.6, num_processes=3)
    dog1 = watched(store, 1, ended1, log, seconds=0.6, num_processes=3)
    # processes 0 and 1 are alive and wait in step 4 for process 2, which is stopped
    store.stopped_at(2, 3)
    dog0.reached(3), dog1.reached(3)
    wait_for(ended0), wait_for(ended1)
    dog0.stop(), dog1.stop()
    fired = store.values["lm_deadline/fired"]
    assert re.fullmatch(
        r"step timeout: process 2 stopped running \(process 2 at step 3; no heartbeat "
        rf"for 0\.[3-9] s: {re.escape(STOPPED)}; processes 0, 1 wait at step 3",
        fired,
    ), fired
    assert fired in ended0 and fired in ended1


def test_the_deadline_starts_at_the_first_step(tmp_path):
    store, ended = FakeStore(), []
    dog = watched(store, 0, ended, tmp_path / "log")
    time.sleep(0.6)  # compiling, loading: no step yet
    dog.stop()
    assert not ended and "lm_deadline/fired" not in store.values


def test_one_process_alone_watches_itself(tmp_path):
    ended = []
    dog = resilience.StepDeadline(
        0.2,
        poll_s=0.05,
        process_index=0,
        num_processes=1,
        stream=(tmp_path / "log").open("a"),
    )
    assert dog.client is None  # no jax.distributed.initialize in this test's process
    dog._end = ended.append
    dog.start().reached(4)
    wait_for(ended)
    dog.stop()
    assert ended == [
        "step timeout: every process reached step 4 and none went further within 0.2 s "
        "(a collective whose order or shape differs between processes, or a deadlock "
        "inside the step)"
    ]


def test_a_bucket_is_given_to_orbax_as_it_is_and_a_path_made_absolute():
    """os.path.abspath would turn gs://bucket/run into CWD/gs:/bucket/run."""
    assert resilience.location("gs://bucket/run") == "gs://bucket/run"
    assert resilience.location("runs/a") == os.path.join(os.getcwd(), "runs", "a")
