"""jaxdist_lm/: the Llama-style trainer a reader copies (model.py, data.py, train.py).

Most runs are in-process, on the 8 simulated CPU devices of conftest.py, calling train.py's own
functions (a subprocess pays 5-9 s of start and compile); the runs that need several processes
(mpirun, srun) or 16 devices (tests/lm_compile_driver.py) are subprocesses. The corpus is
tokenized once per session, into one shared data directory.
"""

import contextlib
import dataclasses
import errno
import gc
import gzip
import io
import json
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from jaxdist_lm import compiled as lm_compiled
from jaxdist_lm import (
    data,
    model_config,
    resilience,
    train,
)
from jaxdist_lm import loss as loss_lib
from jaxdist_lm import model as model_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]

BIN = os.path.dirname(sys.executable)
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
COMMON = [
    "--model",
    "tiny",
    "--global-batch",
    "16",
    "--seq-len",
    "128",
    "--dtype",
    "float32",
]
# 8 rows of 32 tokens, for the tests that compare many steps on several meshes: at
# COMMON's 16 x 128 their steps took longer than their compiling (benchmarks/suite_time.py).
# argparse keeps a flag's last value, so SMALL's sizes override COMMON's.
SMALL_SIZES = ("--global-batch", "8", "--seq-len", "32")
SMALL = [*COMMON, *SMALL_SIZES]


def small_batches(seed: int, count: int, low: int = 0) -> list[np.ndarray]:
    """``count`` batches of SMALL's sizes: 8 rows of 33 token ids from ``low`` up."""
    rng = np.random.default_rng(seed)
    return [rng.integers(low, 2048, (8, 33), dtype=np.int32) for _ in range(count)]


# tiny with 2 layers and an MLP 96 wide, as a Hugging Face Llama config.json
# (--model-config), for the tests that train 8 experts on several meshes: tiny's experts
# have 4 layers x 8 x 3 x 128 x 384 = 4.7 M weights, these 2 x 8 x 3 x 128 x 96 = 0.6 M.
# At tiny's, the steps took longer than the compiling (test_lm_dropless.py's mesh test:
# 51 s with an empty compilation cache, 21 s at this shape; 2 busy cores, 2026-12-06).
SMALL_EXPERTS = {
    "vocab_size": 2048,
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "rms_norm_eps": 1e-5,
}


def small_experts(directory: pathlib.Path) -> list[str]:
    """SMALL's flags with SMALL_EXPERTS's shape, its config.json written in ``directory``."""
    path = directory / "small_experts.json"
    path.write_text(json.dumps(SMALL_EXPERTS))
    return [*SMALL, "--model-config", str(path)]


MESHES = [
    "data=8",
    "fsdp=8",
    "data=4,tensor=2",
    "data=2,fsdp=2,tensor=2",
]
SPEC = "data=2,fsdp=2,tensor=2"  # the mesh of the resume, mpirun and srun runs


@pytest.fixture(scope="session")
def dirs(tmp_path_factory):
    """One data directory (tokenizer and corpus token ids, written by the first run) and one
    compilation cache for the whole session."""
    top = tmp_path_factory.mktemp("lm")
    return {"data": top / "data", "cache": top / "jax_cache"}


@pytest.fixture(autouse=True)
def restore_signal_handlers():
    """train() installs SIGTERM and SIGUSR1 handlers (Preemption); give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


_PREPARED = {}


def prepared(spec: str, schedule_steps: int, extra: tuple[str, ...] = ()):
    """main()'s objects for a mesh (one compile each): the learning rate schedule is that of a
    run of ``schedule_steps``; every run of at most 21 steps has the same one (warmup 20).
    ``extra``: more flags (experts)."""
    key = (spec, max(schedule_steps, 21), extra)
    if key not in _PREPARED:
        argv = [*COMMON, "--mesh", spec, "--steps", str(schedule_steps), *extra]
        args = train.parse_args(argv)
        mesh, model, tx, step, shapes, init = train.setup(args)
        if spec == SPEC:
            step = compiled_at_default_level(step, shapes, mesh, args)
        _PREPARED[key] = (mesh, model, tx, step, shapes, init)
    return _PREPARED[key]


def compiled_at_default_level(step, shapes, mesh, args):
    """``step`` compiled at XLA's default backend optimisation level (2), not the tests' 0
    (conftest.py). SPEC's runs take 64 steps in all (the resume, the learning test),
    each about twice as fast at level 2, for a compile a few seconds longer. ``train()``
    calls the compiled step as it calls the jitted one."""
    # as compile_only lowers it
    lowered = lm_compiled.lower_step(step, shapes, args, mesh)
    return lowered.compile(compiler_options={"xla_backend_optimization_level": 2})


def run_in_process(
    dirs, spec, steps, schedule_steps=10, checkpoint_dir=None, extra=(), flags=()
) -> str:
    """train.train() as main() calls it; what it printed. ``extra``: flags that change
    the compiled step; ``flags``: flags that only the loop reads (--log-dir, ...)."""
    argv = [
        *COMMON,
        "--mesh",
        spec,
        "--steps",
        str(steps),
        "--data-dir",
        str(dirs["data"]),
        *extra,
        *flags,
    ]
    if checkpoint_dir:
        argv += ["--checkpoint-dir", str(checkpoint_dir), "--checkpoint-every", "10"]
    mesh, model, _, step, shapes, init = prepared(spec, schedule_steps, tuple(extra))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.train(train.parse_args(argv), mesh, model, step, shapes, init)
    return out.getvalue()


def losses(stdout: str) -> dict[int, float]:
    return {
        int(s): float(v)
        for s, v in re.findall(r"^step (\d+) loss ([\d.]+) ", stdout, re.M)
    }


def environment(devices: int) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "JAX_"))
    }
    env.update(ROOT_OK, JAX_NUM_CPU_DEVICES=str(devices), PATH=f"{BIN}:{env['PATH']}")
    return env


@pytest.fixture(scope="module")
def spec_run(dirs, tmp_path_factory):
    """10 steps on SPEC, checkpointed at step 10, its metrics logged (--log-dir), steps 6
    to 8 traced (--profile): what it printed, and the checkpoints' directory (the logs in
    lm_logs beside it, the trace in lm_profile)."""
    checkpoints = tmp_path_factory.mktemp("lm_checkpoints")
    flags = (
        *("--log-dir", str(checkpoints.parent / "lm_logs")),
        *("--profile", str(checkpoints.parent / "lm_profile")),
    )
    return run_in_process(dirs, SPEC, 10, checkpoint_dir=checkpoints, flags=flags), (
        checkpoints
    )


# Steps a run on another mesh takes to compare its losses with the reference's: the same
# learning rate schedule as the 10-step runs (prepared), and 4 Adam updates to drift apart.
COMPARED_STEPS = 4


def first(steps: int, run: dict[int, float]) -> dict[int, float]:
    return {s: v for s, v in run.items() if s <= steps}


@pytest.fixture(scope="module")
def mesh_runs(dirs, spec_run):
    """COMPARED_STEPS on every mesh but SPEC, whose 10 steps spec_run took."""
    runs = {
        spec: run_in_process(dirs, spec, COMPARED_STEPS)
        for spec in MESHES
        if spec != SPEC
    }
    return {**runs, SPEC: spec_run[0]}


def test_every_mesh_gives_the_same_losses(mesh_runs):
    reference = losses(mesh_runs["data=8"])
    spec = losses(mesh_runs[SPEC])
    assert list(spec) == list(range(1, 11))
    assert spec[10] < spec[1] - 0.5  # it trains: 8.2011 -> 7.3969, measured
    for mesh in MESHES:
        run = first(COMPARED_STEPS, losses(mesh_runs[mesh]))
        assert list(run) == list(range(1, COMPARED_STEPS + 1)), mesh
        assert run == pytest.approx(reference, rel=1e-4), mesh


# A mesh with a 'sequence' axis beside fsdp and tensor: the tokens in zigzag order, ring
# attention over the axis. Chapter 12_long_sequences runs data x sequence (data=2,sequence=4 at 8 devices).
CONTEXT_MESHES = ["fsdp=2,sequence=2,tensor=2"]
# 4 experts, top-2, capacity factor 2 = E / k: an expert has a slot for every token of a group.
# Chapter 13_experts runs them on data=8 and data=2,expert=4, and checks that the losses are the same.
EXPERTS = ("--experts", "4", "--top-k", "2", "--capacity-factor", "2")


def test_ring_attention_gives_the_losses_of_data_parallelism(dirs, mesh_runs):
    reference = first(COMPARED_STEPS, losses(mesh_runs["data=8"]))
    for spec in CONTEXT_MESHES:
        run = losses(run_in_process(dirs, spec, COMPARED_STEPS))
        assert run == pytest.approx(reference, rel=1e-4), spec


def test_the_compile_only_summary_reads_back_and_fits_the_page():
    """--compile-only's numbers, printed within the book's 88 columns even at 70B's
    byte counts, read back exactly (the benchmarks, the tests and chapters 10 and 13 read
    them with read_summary); a run without collectives says none."""
    sent = {"all-gather": 57_939_361_792, "all-reduce": 30_019_698_788, "all-to-all": 4}
    text = lm_compiled.format_summary(
        6_023_000_000, 12_455_123_456, 18_478_123_456, sent
    )
    assert max(len(line) for line in text.splitlines()) <= 88
    after = "\nin host memory (the program's memory space 5): ..."
    assert lm_compiled.read_summary("compiled 8b on fsdp=16\n" + text + after) == {
        "arguments": 6.023,
        "temporaries": 12.455,
        "total": 18.478,
        "collectives": sent,
    }
    alone = lm_compiled.format_summary(10**9, 0, 10**9, {})
    assert alone.splitlines()[1] == "collectives per device and step: none"
    assert lm_compiled.read_summary(alone)["collectives"] == {}
    with pytest.raises(ValueError, match="not --compile-only's summary"):
        lm_compiled.read_summary("per device: arguments 1.000 GB\nstep 1 loss 2.0")


def compiled_collectives(spec: str, extra: tuple[str, ...] = ()) -> dict[str, int]:
    """--compile-only's collective bytes per device, for tiny at COMMON's sizes."""
    args = train.parse_args([*COMMON, "--mesh", spec, *extra, "--compile-only"])
    mesh, _, _, step, shapes, _ = prepared(spec, 10, extra)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.compile_only(step, shapes, args, mesh)
    return lm_compiled.read_summary(out.getvalue())["collectives"]


def test_ring_and_expert_bytes_match_the_formulas():
    """Bytes per device in the compiled step (float32; tiny: L = 4 layers, D = 128, K = 2
    key/value heads of A = 32; batch 16 x 128 tokens), against what the layers send. Each
    layer runs three times: forward, remat's recomputation, backward."""
    c, B, T = model_config.PRESETS["tiny"], 16, 128
    L, K, A = c.num_layers, c.num_kv_heads, c.head_width
    # Ring attention over sequence=4, batch over data=2: each pass sends K and V of its own
    # T/4 tokens and B/2 rows n - 1 = 3 times. Measured 4,718,592 B.
    ring = compiled_collectives("data=2,sequence=4")
    n, rows, tokens = 4, B // 2, T // 4
    assert ring["collective-permute"] == L * 3 * (n - 1) * 2 * rows * tokens * K * A * 4
    # XLA reduces the gradients in two all-reduces, over 'sequence' and then over 'data',
    # twice the 5,247,492 B of data=8's one all-reduce, but for the embedding table's
    # (V x D x 4 B): the lookup's output is laid out as the table (model.LOOKUP, rows
    # over 'data' only), so it is gathered over 'sequence' (B/2 x T x D x 4 B) and the
    # table's gradient reduced over 'data' alone. Measured 9,446,408 and 524,288 B.
    table = c.vocab_size * c.width * 4
    data8 = compiled_collectives("data=8")["all-reduce"]
    assert ring["all-reduce"] == 2 * data8 - table
    assert ring["all-gather"] == rows * T * c.width * 4
    # Experts over expert=4, batch over data=2 x expert=4: each device's E x C slots of its
    # B/8 rows (one group of 128 tokens; C = 2 x 128 x 2 / 4 = 128) go out to the experts'
    # devices and come back: two all-to-alls a pass. Measured 12,582,912 B.
    moe = compiled_collectives("data=2,expert=4", EXPERTS)
    E, C = 4, 128
    assert moe["all-to-all"] == L * 3 * 2 * E * (B // 8) * C * c.width * 4


@pytest.fixture(scope="module")
def long_run(dirs):
    """50 steps on SPEC with the 50-step schedule: warmup 20, then cosine decay to step 50."""
    return losses(run_in_process(dirs, SPEC, 50, schedule_steps=50))


def test_a_resumed_run_continues_exactly(dirs, spec_run, long_run):
    """Stopped after its checkpoint at step 10 and rerun on the same directory, a run prints the
    losses of an uninterrupted run for steps 11-13: the model, the optimizer (3 Adam updates
    from the restored moments) and the data iterator's position all came back. The
    uninterrupted run is the 50-step one: its learning rate is the same until step 20 (warmup
    20 steps for any length), and so are its first 10 losses."""
    first, checkpoints = spec_run
    resumed = run_in_process(dirs, SPEC, 13, checkpoint_dir=checkpoints)
    assert f"resumed from step 10 in {checkpoints}" in resumed
    assert list(losses(resumed)) == [11, 12, 13]
    assert losses(resumed) == {s: long_run[s] for s in (11, 12, 13)}  # to 4 decimals
    assert {s: v for s, v in long_run.items() if s <= 10} == losses(first)


def run_saving(dirs, directory, steps: int, every: int = 1, flags=()) -> str:
    """run_in_process on SPEC with --checkpoint-dir ``directory``, saving every
    ``every`` steps (run_in_process's checkpoint_dir saves every 10)."""
    saving = ("--checkpoint-dir", str(directory), "--checkpoint-every", str(every))
    return run_in_process(dirs, SPEC, steps, flags=(*saving, *flags))


def files(directory: pathlib.Path) -> dict[str, bytes]:
    """Every file under ``directory``, by its relative path."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def largest_chunk(step: pathlib.Path) -> pathlib.Path:
    """The step's largest file of array data (OCDBT's)."""
    chunks = (step / "state" / "ocdbt.process_0" / "d").iterdir()
    return max(chunks, key=lambda p: p.stat().st_size)


def saved_by_two_processes(step: pathlib.Path) -> None:
    """Grain's file as a run of 2 processes names it: none for this process."""
    grain_file = step / "data" / "process_0-of-1.json"
    grain_file.rename(grain_file.with_name("process_0-of-2.json"))


# Ways step 3 of a checkpoint is damaged, and the reason the fallback line gives.
DAMAGES = {
    "a chunk cut short": (
        lambda ck: os.truncate(largest_chunk(ck / "3"), 1000),
        r"state: [A-Z_]+: Error reading .*",
    ),
    "a chunk deleted": (
        lambda ck: largest_chunk(ck / "3").unlink(),
        r"state: [A-Z_]+: Error reading .*",
    ),
    "the state's metadata deleted": (
        lambda ck: (ck / "3" / "state" / "_METADATA").unlink(),
        r"state: its _METADATA file is missing",
    ),
    "the state's manifest deleted": (
        lambda ck: (ck / "3" / "state" / "manifest.ocdbt").unlink(),
        r"state: NOT_FOUND: .* does not exist",
    ),
    "the data iterator garbled": (
        lambda ck: (ck / "3" / "data" / "process_0-of-1.json").write_text("{"),
        r"data: Expecting property name enclosed in double quotes: .*",
    ),
    # Step 2 then restores with no Grain file of this process's: its data starts at
    # step 2, which is the same batch.
    "the state deleted, step 2 saved by 2 processes": (
        lambda ck: [
            shutil.rmtree(ck / "3" / "state"),
            saved_by_two_processes(ck / "2"),
        ],
        re.escape("""state: Item "state" was not found in the checkpoint. """)
        + re.escape("Available items: ['data']"),
    ),
}


def test_a_damaged_checkpoint_falls_back_to_the_step_before(dirs, tmp_path):
    """Step 3 of a checkpoint damaged in each way of DAMAGES: a rerun to step 2 (no
    step to train) says so in one line, moves it to 3.unrestorable, files untouched, and
    resumes from step 2. Then the last, whose step 2 has no Grain file of this
    process's, trains step 3 with the undamaged run's loss, and --keep 1's clean-up
    leaves 3.unrestorable alone. When no step restores, one line and nothing moved."""
    saved = tmp_path / "saved"
    reference = losses(run_saving(dirs, saved, 3))
    for name, (damage, reason) in DAMAGES.items():
        checkpoints = tmp_path / name.replace(" ", "_").replace(",", "")
        shutil.copytree(saved, checkpoints)
        damage(checkpoints)
        damaged = files(checkpoints / "3")
        rerun = run_saving(dirs, checkpoints, 2)
        where = re.escape(str(checkpoints))
        line = (
            f"checkpoint step 3 in {where} does not restore \\({reason}\\): moved to "
            f"3\\.unrestorable, falling back\nresumed from step 2 in {where}\n"
        )
        assert re.match(line, rerun), (name, rerun)
        assert files(checkpoints / "3.unrestorable") == damaged, name
        assert {p.name for p in checkpoints.iterdir()} == {"1", "2", "3.unrestorable"}
    rerun = run_saving(dirs, checkpoints, 3, flags=("--keep", "1"))
    assert losses(rerun) == {3: reference[3]}
    assert sorted(p.name for p in checkpoints.iterdir()) == ["3", "3.unrestorable"]
    assert files(checkpoints / "3.unrestorable") == damaged
    for step in (1, 2, 3):
        (saved / str(step) / "state" / "_METADATA").unlink()
    kept = files(saved)
    expected = (
        f"no checkpoint step in {saved} restores (step 3: state: its _METADATA file is "
        "missing; nor do the 2 steps before it): check that --model and the other "
        "flags are the run's that saved them, or move the directory away to start from "
        "step 0"
    )
    with pytest.raises(SystemExit, match=f"^{re.escape(expected)}$"):
        run_saving(dirs, saved, 4)
    assert files(saved) == kept


class DiskFull:
    """A save's write that finds the disk full, in Orbax's background thread."""

    def result(self, timeout=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_failed_save_stops_in_one_line_and_keeps_the_last_step(
    dirs, tmp_path, monkeypatch, caplog
):
    """A save that fails in the background (step 2's) is said at the next save; one
    that fails at once (the rerun's step 2) there: one line, the OS's reason, no
    traceback logged, and step 1 kept."""
    # Futures an earlier test left unretrieved (a damaged checkpoint's reads) are
    # logged by asyncio when collected: collect them before this test counts errors.
    gc.collect()
    caplog.clear()
    handler = ocp.StandardCheckpointHandler
    real_save, saves = handler.async_save, []

    async def full_after_one(self, *args, **kwargs):
        """The first save writes; a later one finds the disk full as it finishes."""
        writes = await real_save(self, *args, **kwargs)
        saves.append(len(saves) + 1)
        return writes if saves == [1] else [*writes, DiskFull()]

    monkeypatch.setattr(handler, "async_save", full_after_one)
    reason = f"({os.strerror(errno.ENOSPC)}): stopping; step 1 is the last saved there"
    expected = (
        f"checkpoint step 2 did not save in {tmp_path} {reason}, where a rerun resumes"
    )
    with pytest.raises(SystemExit, match=f"^{re.escape(expected)}$"):
        run_saving(dirs, tmp_path, 3)

    async def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(handler, "async_save", full)
    with pytest.raises(SystemExit, match=f"^{re.escape(expected)}$"):
        run_saving(dirs, tmp_path, 3)
    assert saves == [1, 2] and (tmp_path / "1").is_dir()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_preemption_says_where_it_saved_or_that_nothing_was(
    dirs, tmp_path, monkeypatch
):
    """A real SIGTERM at the first step: the run stops at the agreed step and says in
    its last line where it saved, or that without --checkpoint-dir nothing was."""

    class SignalledAtOnce(train.Preemption):
        def vote(self):
            if self.signal is None:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().vote()

    monkeypatch.setattr(train, "Preemption", SignalledAtOnce)
    printed = run_in_process(dirs, SPEC, 5)
    [step] = re.findall(
        r"^SIGTERM at step (\d+): no --checkpoint-dir, nothing saved, exiting$",
        printed,
        re.M,
    )
    assert max(losses(printed)) == int(step)
    printed = run_saving(dirs, tmp_path, 5, every=10)
    pattern = rf"^SIGTERM: saved step (\d+) in {re.escape(str(tmp_path))}, exiting$"
    [step] = re.findall(pattern, printed, re.M)
    assert max(losses(printed)) == int(step)
    assert [p.name for p in tmp_path.iterdir()] == [step]


def test_tiny_learns_the_corpus(dirs, long_run):
    """50 steps (warmup 20, cosine decay to step 50) take the loss from ln(2048) = 7.6 (and
    8.20 at initialisation) below the entropy of the corpus's token frequencies (6.3044 nats):
    the model uses context, not just how common each token is. Measured: 8.2011 -> 5.6823."""
    values = long_run
    [source] = data.sources(str(dirs["data"]), 128, 2048)  # tokenized by the run
    tokens = np.concatenate([source[i][1:] for i in range(len(source))])  # the targets
    p = np.bincount(tokens, minlength=2048) / len(tokens)
    unigram = -np.sum(p[p > 0] * np.log(p[p > 0]))
    print(f"unigram entropy {unigram:.4f}; loss {values[1]} -> {values[50]}")
    assert values[1] == pytest.approx(8.2011, abs=1e-4)
    assert unigram == pytest.approx(6.3044, abs=1e-4)
    assert values[50] < 5.8 < unigram - 0.5


def test_bad_meshes_and_batches_say_why():
    with pytest.raises(SystemExit, match=r"^--mesh data=3 does not fit 8 devices$"):
        train.make_mesh("data=3")
    with pytest.raises(
        SystemExit, match=r"^--mesh data=2,tensor=2 has 4 devices, not the 8"
    ):
        train.make_mesh("data=2,tensor=2")
    with pytest.raises(SystemExit, match=r"^--mesh dp=8: expected axis=size with axes"):
        train.make_mesh("dp=8")

    def fits(*flags, mesh="data=8"):
        args = train.parse_args([*COMMON, "--mesh", mesh, *flags])
        train.check_fits(train.model_config_of(args), train.make_mesh(mesh), args)

    with pytest.raises(SystemExit) as raised:
        fits("--experts", "6", mesh="data=2,expert=4")
    assert str(raised.value) == (
        "--experts 6 does not split over expert=4; try --mesh data=4,expert=2 or "
        "--mesh data=2,fsdp=2,expert=2"
    )
    with pytest.raises(
        SystemExit, match=r"^--top-k 3 must be between 1 and --experts 2$"
    ):
        fits("--experts", "2", "--top-k", "3")
    with pytest.raises(
        SystemExit,
        match=r"^--seq-len 100 does not split over sequence=4 x 2 zigzag chunks = 8; ",
    ):
        fits("--seq-len", "100", mesh="data=2,sequence=4")
    with pytest.raises(
        SystemExit,
        match=r"^routing groups: 1 of 128 tokens \(--seq-len 128, --group-size 512\) "
        r"does not split over sequence=2; try --mesh data=8 or",
    ):
        fits("--experts", "4", mesh="data=4,sequence=2")
    # 2 groups: fits
    fits("--experts", "4", "--group-size", "64", mesh="data=4,sequence=2")
    with pytest.raises(
        SystemExit,
        match=r"^num_layers 4 does not split over pipeline=8; try --mesh pipeline=4,",
    ):
        fits("--grad-accum", "8", mesh="pipeline=8")
    with pytest.raises(
        SystemExit,
        match=r"^pipeline=2 needs at least 2 micro-batches: set --grad-accum",
    ):
        fits(mesh="pipeline=2,data=4")
    interleaved = ("--schedule", "interleaved", "--virtual-stages", "2")
    with pytest.raises(
        SystemExit,
        match=r"^num_layers 4 does not split over pipeline=4 x 2 virtual stages = 8; ",
    ):
        fits("--grad-accum", "4", *interleaved, mesh="pipeline=4,data=2")
    with pytest.raises(
        SystemExit,
        match=r"^--schedule interleaved runs micro-batches in groups of pipeline=2: "
        r"set --grad-accum to a multiple of 2$",
    ):
        fits(
            "--grad-accum",
            "3",
            "--global-batch",
            "24",
            *interleaved,
            mesh="pipeline=2,data=4",
        )
    with pytest.raises(
        SystemExit,
        match=r"^--virtual-stages 2 needs a pipeline axis and --schedule interleaved$",
    ):
        fits("--virtual-stages", "2", "--grad-accum", "2", mesh="pipeline=2,data=4")
    args = train.parse_args([*COMMON, "--global-batch", "6", "--mesh", "data=8"])
    with pytest.raises(SystemExit) as raised:
        train.check_fits(model_config.PRESETS["tiny"], train.make_mesh("data=8"), args)
    assert str(raised.value).startswith("--global-batch 6 does not split over data=8; ")
    accumulated = [*COMMON, "--global-batch", "24", "--grad-accum", "4"]
    args = train.parse_args([*accumulated, "--mesh", "data=8"])
    with pytest.raises(SystemExit) as raised:
        train.check_fits(model_config.PRESETS["tiny"], train.make_mesh("data=8"), args)
    assert str(raised.value).startswith(
        "--global-batch 24 in --grad-accum 4 micro-batches of 6 rows does not split "
        "over data=8; try --mesh "
    )


def test_each_process_reads_only_its_rows(dirs, spec_run):
    sources = data.sources(str(dirs["data"]), 128, 2048)  # tokenized by spec_run
    whole = data.batches(sources, 16, slice(0, 16), seed=0)
    halves = [
        data.batches(sources, 16, slice(0, 8), 0),
        data.batches(sources, 16, slice(8, 16), 0),
    ]
    for _ in range(5):
        expected = next(whole)
        assert expected.shape == (16, 129)
        np.testing.assert_array_equal(
            np.concatenate([next(h) for h in halves]), expected
        )
    with pytest.raises(ValueError, match="do not tile a global batch of 16"):
        data.batches(sources, 16, slice(0, 6), 0)


def test_a_readers_own_tokens_are_packed_and_read(tmp_path):
    """--data: a nanoGPT-style .bin of uint16 ids, or a .npy, read in place as records of
    seq_len + 1 tokens (tests/test_lm_data.py checks the rest: uint32, shards, mixtures,
    the evaluation split)."""
    # 100 ids below a vocabulary of 50
    tokens = (np.arange(100) * 7 % 50).astype(np.uint16)
    tokens.tofile(tmp_path / "mine.bin")
    np.save(tmp_path / "mine.npy", tokens.astype(np.int32))
    rows = tokens[:99].reshape(11, 9)  # 100 // (8 + 1) = 11 records of 9 tokens
    for name in ("mine.bin", "mine.npy"):
        sources = data.prepare(str(tmp_path), 8, 50, str(tmp_path / name), "uint16")
        batch = next(data.batches(sources, 11, slice(0, 11), seed=0))
        # shuffled, all there
        assert sorted(map(tuple, batch)) == sorted(map(tuple, rows))
    with pytest.raises(SystemExit, match="^token id 42 at position 6 of .*mine.bin is"):
        data.prepare(str(tmp_path), 8, 40, str(tmp_path / "mine.bin"), "uint16")


def test_model_flops_match_the_compiled_programs(dirs):
    """6 flops per matmul weight per token, plus attention's, against XLA's count for one
    training step's gradient (forward and backward) of the 125m preset. The layers are unrolled
    (cost_analysis counts a loop's body once) and not rematerialised (6N assumes no recompute)."""
    config = model_config.PRESETS["125m"]
    batch, seq_len = 1, 512
    model = model_lib.abstract(
        config, jnp.float32, "none", scan_unroll=config.num_layers
    )
    tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
    params = model_lib.params_of(model)  # shapes

    def loss(params, tokens):
        logits, _ = model_lib.with_params(model, params)(tokens[:, :-1])
        return loss_lib.cross_entropy(logits, tokens[:, 1:])

    # Arguments with no sharding: one device's program, whatever the device count.
    compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    counted = compiled.cost_analysis()["flops"]
    estimate = model_config.flops_per_token(config, seq_len) * batch * seq_len
    print(f"flops: estimate {estimate:.4e}, XLA {counted:.4e}")
    assert counted == pytest.approx(estimate, rel=0.02)  # measured: 0.4% apart


# What the two tests below compile on 16 simulated devices, in one process
# (tests/lm_compile_driver.py: JAX starts once): Llama 3 8B at sequence 2048, global batch
# 16, on three meshes; Llama 3.2 1B at sequence 4,096 on fsdp=8 x tensor=2, a global batch
# of 16 and one of 64 in 4 micro-batches (a run's flags after its mesh override these).
MESHES_8B = ["data=16", "fsdp=16", "fsdp=8,tensor=2"]
ONE_B = "fsdp=8,tensor=2 --model 1b --seq-len 4096"
RUNS_1B = [ONE_B, f"{ONE_B} --global-batch 64 --grad-accum 4"]


@pytest.fixture(scope="module")
def compiled_on_16(tmp_path_factory):
    """lm_compile_driver.py's JSON for MESHES_8B and RUNS_1B, by run."""
    cache = tmp_path_factory.mktemp("lm_compile_16")
    result = subprocess.run(
        [
            sys.executable,
            "tests/lm_compile_driver.py",
            *("16", "8b", "2048", "16", str(cache)),
            *MESHES_8B,
            *RUNS_1B,
        ],
        cwd=ROOT,
        env=environment(16),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_compile_only_at_8b_matches_the_formulas(compiled_on_16):
    """Llama 3 8B at sequence 2048, global batch 16, on 16 simulated devices (one process
    compiles the three meshes: compiled_on_16). Bytes are per device, float32."""
    config = model_config.PRESETS["8b"]
    params = model_config.count_params(config)
    assert params == 8_030_261_248
    V, D, L = config.vocab_size, config.width, config.num_layers
    layers = params - 2 * V * D - D  # the scanned layers' weights, norms included
    out_projection = L * config.num_heads * config.head_width * D
    measured = {}
    for spec in MESHES_8B:
        printed = compiled_on_16[spec]
        summary = printed["summary"]
        measured[spec] = {
            "arguments": summary["arguments"] * 1e9,
            "collectives": summary["collectives"],
            "all_gathers_by_axes": printed["all_gathers_by_axes"],
        }
    # Data parallelism: every device holds the weights and Adam's two moments, all fp32.
    assert measured["data=16"]["arguments"] == pytest.approx(params * 4 * 3, rel=0.05)
    # FSDP over 16: each device holds 1/16 of the weights and of Adam's two moments (fp32).
    fsdp = measured["fsdp=16"]
    assert fsdp["arguments"] == pytest.approx(params * 4 * 3 / 16, rel=0.05)
    # Data parallelism: one all-reduce of the fp32 gradients (and of the 4-byte loss).
    # Measured 32,121,044,996 B = 4 x params + 4.
    [(kind, sent)] = measured["data=16"]["collectives"].items()
    assert kind == "all-reduce" and sent == pytest.approx(4 * params, rel=1e-3)
    # FSDP: the layers' weights are gathered once in the forward pass and once in the backward
    # (remat recomputes the forward there), the output projection once, and the embedding table
    # never (its lookup moves tokens and activations instead: an all-to-all). Measured
    # 57,939,230,720 B (the formula's remainder: tokens and the final norm).
    assert fsdp["collectives"]["all-gather"] == pytest.approx(
        2 * 4 * layers + 4 * V * D, rel=1e-3
    )
    # XLA:CPU reduces the gradients with an all-reduce of every gradient but the embedding
    # table's (measured 30,019,698,788 B = 4 x (params - V x D) + 100); a GPU compile forms a
    # reduce-scatter instead.
    assert fsdp["collectives"]["all-reduce"] == pytest.approx(
        4 * (params - V * D), rel=1e-3
    )
    # FSDP x tensor: over the fsdp axis each device gathers its tensor half of every weight,
    # each layer weight once in the forward and once in the backward, not more, except the
    # attention's output projection, which XLA:CPU gathers a second time in the backward;
    # the output projection (unembed) is gathered in the forward and in the backward. Measured
    # 31,095,619,584 B; the all-gathers over 'tensor' are the sequence-parallel activations.
    gathers = measured["fsdp=8,tensor=2"]["all_gathers_by_axes"]
    assert set(gathers) == {"fsdp", "tensor"}
    assert gathers["fsdp"] == pytest.approx(
        4 * (2 * layers + out_projection + 2 * V * D) / 2, rel=1e-3
    )


def mpirun_train(dirs, *flags: str) -> list[str]:
    """train.py in 2 processes under mpirun, on the session's corpus and compilation cache."""
    shared = (
        "--data-dir",
        str(dirs["data"]),
        "--compilation-cache",
        str(dirs["cache"]),
    )
    return ["mpirun", "-np", "2", "python", "-m", "jaxdist_lm.train", *flags, *shared]


def signalled_run(
    command: list[str],
    tmp_path,
    notify,
    at: str = "step 1 loss",
    status: int = 0,
    timeout: float = 120,
) -> str:
    """Run ``command`` (4 devices a process), call ``notify(process)`` once a line starting
    with ``at`` is printed (step 1: the signal handlers are set by then), and return its
    output once it exits with ``status``; its stderr is in ``tmp_path / "stderr"``."""
    with open(tmp_path / "stderr", "w") as stderr:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=environment(4),
            text=True,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        lines = []
        try:
            for line in process.stdout:
                lines.append(line)
                if line.startswith(at):
                    notify(process)
            process.wait(timeout=timeout)
        finally:
            process.kill()
    stdout = "".join(lines)
    stderr = (tmp_path / "stderr").read_text()[-3000:]
    assert process.returncode == status, stdout + stderr
    return stdout


def test_sigusr1_to_mpirun_saves_and_a_rerun_resumes(dirs, spec_run, tmp_path):
    """2 processes x 4 devices under mpirun: the losses of 1 process x 8 devices; SIGUSR1 to
    mpirun reaches both processes, which agree on a step, save it and exit 0; a rerun resumes
    there, with the same losses.

    Then one process resumes the same checkpoint: Grain saved the data iterator per process
    (process_0-of-2.json, ...), so it finds no file of its own and starts the data at the step,
    which gives the same batches on any layout."""
    reference = losses(spec_run[0])
    checkpoints = tmp_path / "checkpoints"

    def command(steps):
        # --step-timeout: the deadline's key-value store, across processes
        return mpirun_train(
            dirs,
            *COMMON,
            *("--mesh", SPEC, "--steps", str(steps), "--step-timeout", "120"),
            *("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "10"),
        )

    stdout = signalled_run(
        command(20), tmp_path, lambda process: process.send_signal(signal.SIGUSR1)
    )
    [saved] = re.findall(
        rf"^SIGUSR1: saved step (\d+) in {re.escape(str(checkpoints))}, exiting$",
        stdout,
        re.M,
    )
    saved = int(saved)
    # signalled after step 1; the one-process resume reaches saved + 3
    assert 1 <= saved <= 7
    assert losses(stdout) == pytest.approx(
        {s: reference[s] for s in range(1, saved + 1)}, rel=1e-5
    )
    # Two more steps: a run of up to 21 steps has the 20-step run's learning rate schedule
    # (warmup 20, then decay over max(steps, 21)).
    rerun = subprocess.run(
        command(saved + 2),
        cwd=ROOT,
        env=environment(4),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    assert f"resumed from step {saved} in {checkpoints}" in rerun.stdout
    expected = {s: reference[s] for s in range(saved + 1, saved + 3)}
    assert losses(rerun.stdout) == pytest.approx(expected, rel=1e-5)
    alone = run_in_process(dirs, SPEC, saved + 3, checkpoint_dir=checkpoints)
    assert f"resumed from step {saved + 2} in {checkpoints}" in alone
    expected = {saved + 3: reference[saved + 3]}
    assert losses(alone) == pytest.approx(expected, rel=1e-5)


def test_srun_two_processes_and_scancel_sigterm(slurm, dirs, spec_run, tmp_path):
    """srun -n 2 (JAX's SLURM detection joins them): the losses of 1 process x 8 devices; the
    tasks get SIGTERM from scancel --signal=TERM, save at the next step and exit 0."""
    reference = losses(spec_run[0])
    name = f"jaxdist-lm-{os.getpid()}"
    command = [
        "srun",
        "--overcommit",
        "-n",
        "2",
        "-J",
        name,
        *("python", "-m", "jaxdist_lm.train"),
        *COMMON,
        "--mesh",
        SPEC,
        "--steps",
        "20",
        "--data-dir",
        str(dirs["data"]),
        "--checkpoint-dir",
        str(tmp_path / "checkpoints"),
        "--compilation-cache",
        str(dirs["cache"]),
    ]
    scancel = ["scancel", "--signal=TERM", "--name", name]
    stdout = signalled_run(
        command, tmp_path, lambda _: subprocess.run(scancel, check=True)
    )
    where = re.escape(str(tmp_path / "checkpoints"))
    [saved] = re.findall(
        rf"^SIGTERM: saved step (\d+) in {where}, exiting$", stdout, re.M
    )
    assert 1 <= int(saved) < 20
    expected = {s: reference[s] for s in range(1, min(int(saved), 10) + 1)}
    got = {s: v for s, v in losses(stdout).items() if s <= 10}
    assert got == pytest.approx(expected, rel=1e-5)


def test_step_timeout_ends_a_stuck_process_with_its_stack(tmp_path):
    """--step-timeout's thread: no step for 1 s after step 3 -> the message, the stack, status 124.
    The process imports resilience.py, where train.py's StepDeadline is, not all of
    train.py (2 s fewer of importing)."""
    assert train.StepDeadline is resilience.StepDeadline
    program = (
        "import time; from jaxdist_lm import resilience\n"
        "resilience.StepDeadline(1).start().reached(3)\n"
        "time.sleep(30)  # stuck\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 124, result.stderr[-2000:]
    assert (
        "step timeout: every process reached step 3 and none went further within 1 s "
        "(a collective whose order or shape differs between processes, or a deadlock "
        "inside the step)\nprocess 0's Python stacks:"
    ) in result.stderr
    assert 'File "<string>", line 3 in <module>' in result.stderr  # where it is stuck
    assert train.parse_args(["--step-timeout", "600"]).step_timeout == 600


def rank_pid(launcher: int, rank: int) -> int | None:
    """The process id of the launcher's child of MPI rank ``rank``, or ``None``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if parent == launcher and f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return int(pid)
    return None


def running(pid: int, program: str) -> bool:
    """Whether process ``pid`` still runs ``program`` (a zombie no longer does)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return program.encode() in f.read()
    except OSError:
        return False


def test_step_timeout_names_a_process_stopped_by_sigstop(dirs, tmp_path):
    """mpirun -np 2 --step-timeout 5: process 1, stopped by SIGSTOP once step 3 is printed,
    is named by its silent heartbeat, and process 0's deadline ends the job (status 124)."""
    command = mpirun_train(
        dirs, *SMALL, "--mesh", "data=8", "--steps", "1000", "--step-timeout", "5"
    )
    stopped = []

    def stop_rank_1(job):
        pid = rank_pid(job.pid, 1)
        assert pid, "mpirun has no child of rank 1"
        stopped.append(pid)
        os.kill(pid, signal.SIGSTOP)

    try:
        signalled_run(command, tmp_path, stop_rank_1, "step 3 loss", 124, timeout=60)
    finally:
        # mpirun ends the stopped process; if it did not, SIGKILL does
        left = bool(stopped) and running(stopped[0], "jaxdist_lm.train")
        if left:
            os.kill(stopped[0], signal.SIGKILL)
    output = (tmp_path / "stderr").read_text()
    assert stopped and not left, output[-3000:]
    assert re.search(
        r"^step timeout: process 1 stopped running \(process 1 at step \d+; no "
        r"heartbeat for [\d.]+ s: paused by SIGSTOP, a debugger or a suspended VM, "
        r"or blocked in the kernel on a file system or a driver\); process 0 waits at "
        r"step \d+\nprocess 0's Python stacks:$",
        output,
        re.M,
    ), output[-3000:]
    # stopped: process 1 printed nothing more
    assert "process 1's Python stacks:" not in output


def tensorboard_scalars(path: pathlib.Path) -> dict[str, dict[int, float]]:
    """The scalars of a TensorBoard event file, read with its own protocol buffers
    (tensorboardX's): a TFRecord file of Event messages (length, CRC, data, CRC)."""
    from tensorboardX.proto import event_pb2

    blob, offset, scalars = path.read_bytes(), 0, {}
    while offset < len(blob):
        (length,) = np.frombuffer(blob[offset : offset + 8], np.uint64)
        event = event_pb2.Event.FromString(
            blob[offset + 12 : offset + 12 + int(length)]
        )
        offset += 12 + int(length) + 4
        for value in event.summary.value:
            scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_metrics_go_to_json_lines_and_tensorboard(spec_run):
    """--log-dir: every step's numbers, at full precision, in metrics.jsonl and in
    TensorBoard's event file; the terminal's losses are the same numbers, rounded."""
    printed, checkpoints = spec_run
    logs = checkpoints.parent / "lm_logs"
    records = [
        json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == list(range(1, 11))
    assert set(records[0]) == {
        "step",
        "loss",
        "grad_norm",
        "tokens_per_s",
        "step_time_s",
    }
    assert {r["step"]: round(r["loss"], 4) for r in records} == losses(printed)
    [events] = logs.glob("events.out.tfevents.*")
    board = tensorboard_scalars(events)
    assert board["loss"] == pytest.approx(
        {r["step"]: r["loss"] for r in records}, rel=1e-7
    )
    assert set(board) == {"loss", "grad_norm", "tokens_per_s", "step_time_s"}


ACCUMULATED_MESHES = ["data=8", SPEC]  # one with 'tensor', and 'data' x 'fsdp'


@pytest.mark.parametrize("spec", ACCUMULATED_MESHES)
def test_gradient_accumulation_gives_the_steps_of_one_batch(spec):
    """--grad-accum 2: the global batch of 16 in two micro-batches of 8 (every other
    row), the gradients added up; its losses and gradient norms over 3 steps are those
    of the whole batch at once, in float32."""
    mesh, _, _, whole_step, shapes, init = prepared(spec, 10)
    args = train.parse_args(
        [*COMMON, "--mesh", spec, "--steps", "10", "--grad-accum", "2"]
    )
    _, _, _, accumulating_step, accumulating_shapes, accumulating_init = train.setup(
        args
    )
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 2048, (16, 129), dtype=np.int32) for _ in range(3)]
    runs = [
        steps_on(whole_step, shapes, init, mesh, batches),
        steps_on(
            accumulating_step, accumulating_shapes, accumulating_init, mesh, batches
        ),
    ]
    print(spec, runs)
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)


def steps_on(step, shapes, init, mesh, batches) -> np.ndarray:
    """Each batch's loss and gradient norm, one step after another from init."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(train.BATCH))
    state_shardings = jax.tree.map(lambda s: s.sharding, shapes)
    metrics = []
    with jax.set_mesh(mesh), nn.logical_axis_rules(train.RULES):
        state = jax.jit(init, out_shardings=state_shardings)(jax.random.key(0))
        for batch in batches:
            state, m = step(state, jax.device_put(batch, sharding))
            metrics.append([float(m["loss"]), float(m["grad_norm"])])
    return np.array(metrics)


def test_eod_id_masks_documents_the_same_on_a_ring():
    """--eod-id 0: rows of 33 random tokens, about 1 in 8 of them EOD (so about 5
    documents a row). data=8 (chunked attention) and data=2 x sequence=4 (ring attention
    on the zigzag, the document starts moved with the tokens) give the same losses and
    gradient norms over 3 steps; without --eod-id the same batches give others. An id
    outside the vocabulary stops with one line."""
    rng = np.random.default_rng(1)
    batches = [
        np.where(rng.random(batch.shape) < 1 / 8, 0, batch)
        for batch in small_batches(1, 3, low=1)
    ]
    runs = {}
    for spec in ("data=8", "data=2,sequence=4"):
        args = train.parse_args(
            [*SMALL, "--mesh", spec, "--steps", "10", "--eod-id", "0"]
        )
        mesh, _, _, step, shapes, init = train.setup(args)
        runs[spec, True] = steps_on(step, shapes, init, mesh, batches)
    # without --eod-id: SMALL on data=8, the step the pipeline test compares with
    mesh, _, _, step, shapes, init = prepared("data=8", 10, SMALL_SIZES)
    runs["data=8", False] = steps_on(step, shapes, init, mesh, batches)
    print(runs)
    masked = runs["data=8", True]
    np.testing.assert_allclose(runs["data=2,sequence=4", True], masked, rtol=1e-5)
    assert np.abs(runs["data=8", False][:, 0] - masked[:, 0]).min() > 1e-3
    args = train.parse_args([*COMMON, "--mesh", "data=8", "--eod-id", "2048"])
    message = "--eod-id 2048 is not a token id: the vocabulary has 2048 (0 to 2047)"
    with pytest.raises(SystemExit, match=f"^{re.escape(message)}$"):
        train.model_config_of(args)


# Steps each pipeline test compares with data=8's (the schedule is the 10-step runs'):
# the first step's gradients, then four updates that carry Adam's moments on. At O0 a
# pipeline's step on 8 simulated devices takes about 0.2 s even at SMALL's sizes.
PIPELINE_STEPS = 5
PIPELINES = [  # mesh, schedule: each with --grad-accum 4
    ("pipeline=2,fsdp=2,tensor=2", ["--schedule", "gpipe"]),
    ("pipeline=2,fsdp=2,tensor=2", ["--schedule", "1f1b"]),
    ("pipeline=4,data=2", ["--schedule", "1f1b"]),
]


def test_a_pipeline_gives_the_steps_of_data_parallelism():
    """--grad-accum 4: four micro-batches through 2 stages of 2 layers each (fsdp and
    tensor inside each stage) on GPipe and on 1F1B, and through 4 stages of one layer
    (data inside each) on 1F1B: over 5 steps, the losses and gradient norms of data=8
    taking the batch at once, in float32, to 1e-4. --compile-only prints the bubble:
    3 of 7 ticks idle for 4 stages and 4 micro-batches."""
    batches = small_batches(2, PIPELINE_STEPS)
    mesh, _, _, step, shapes, init = prepared("data=8", 10, SMALL_SIZES)
    expected = steps_on(step, shapes, init, mesh, batches)
    for spec, schedule in PIPELINES:
        flags = [*SMALL, "--mesh", spec, "--steps", "10", "--grad-accum", "4"]
        args = train.parse_args([*flags, *schedule])
        mesh, _, _, step, shapes, init = train.setup(args)
        layers = shapes.params["layers"]["attention"]["query"]
        assert layers.sharding.spec[0] == "pipeline", layers.sharding  # split in stages
        np.testing.assert_allclose(
            steps_on(step, shapes, init, mesh, batches),
            expected,
            rtol=1e-4,
            err_msg=f"{spec} {schedule}",
        )
    printed = io.StringIO()  # --compile-only's last line, for the last of them
    with contextlib.redirect_stdout(printed):
        lm_compiled.compile_only(step, shapes, args, mesh)
    assert printed.getvalue().splitlines()[-1] == (
        "pipeline: 1f1b, 4 stages x 4 micro-batches; idle 42.9% of the table's ticks, "
        "(P - 1) / (V M + P - 1) = 42.9%; at most 4 stage inputs kept per device"
    )


# The tiny preset with 8 layers, as a Hugging Face Llama config.json (--model-config).
EIGHT_LAYERS = {
    "vocab_size": 2048,
    "num_hidden_layers": 8,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 384,
    "rms_norm_eps": 1e-5,
}


def test_interleaved_stages_give_the_steps_of_data_parallelism(tmp_path):
    """An 8-layer model (--model-config) on pipeline=4,data=2 with --schedule
    interleaved --virtual-stages 2: each device runs 2 stages of one layer, on a ring.
    Over 5 steps of --grad-accum 4, the losses and gradient norms of data=8, to 1e-4.
    The bubble: 3 of 11 chunk ticks, as (P - 1) / (V M + P - 1) says."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(EIGHT_LAYERS))
    batches = small_batches(3, PIPELINE_STEPS)
    flags = [*SMALL, "--model-config", str(config), "--steps", "10"]
    runs = {}
    for spec, extra in (
        ("data=8", []),
        (
            "pipeline=4,data=2",
            ["--grad-accum", "4", "--schedule", "interleaved", "--virtual-stages", "2"],
        ),
    ):
        args = train.parse_args([*flags, "--mesh", spec, *extra])
        mesh, _, _, step, shapes, init = train.setup(args)
        runs[spec] = steps_on(step, shapes, init, mesh, batches)
    np.testing.assert_allclose(runs["pipeline=4,data=2"], runs["data=8"], rtol=1e-4)
    assert lm_compiled.bubble_line("interleaved", 4, 4, 2) == (
        "pipeline: interleaved, 4 x 2 stages x 4 micro-batches; idle 27.3% of the "
        "table's ticks, (P - 1) / (V M + P - 1) = 27.3%; at most 8 stage inputs "
        "kept per device"
    )


def test_the_8b_pipeline_table_is_current():
    """book/data/pipeline_memory.json (benchmarks/pipeline_memory.py, chapter 11_pipelines_mesh_shape) is
    the recipe's: its GPipe and 1F1B rows at 8 micro-batches compile again, on 32
    simulated devices, to the same argument and temporary bytes and collective bytes
    (in bfloat16, which XLA:CPU once could not compile for a pipeline)."""
    from jaxdist_lessons.planning import checking

    table = json.loads((ROOT / "book" / "data" / "pipeline_memory.json").read_text())
    rows = [
        r
        for r in table["rows"]
        if r["microbatches"] == 8 and r["schedule"] in ("gpipe", "1f1b")
    ]
    compiled = checking.compile_flags(32, [r["flags"] for r in rows], progress=False)
    for row, result in zip(rows, compiled, strict=True):
        kept = {k: row[k] for k in ("arguments", "temporaries", "collectives")}
        assert result == kept, row["schedule"]


def test_a_pipeline_checkpoint_resumes_on_another_mesh(dirs, long_run, tmp_path):
    """10 steps on pipeline=2,data=2,tensor=2 (--grad-accum 2) print SPEC's losses and
    save; data=8 resumes from that checkpoint (Orbax puts each stage's layers on every
    device) and prints the uninterrupted run's losses for steps 11-13."""
    spec = "pipeline=2,data=2,tensor=2"
    piped = run_in_process(
        dirs, spec, 10, checkpoint_dir=tmp_path, extra=("--grad-accum", "2")
    )
    first_ten = {s: long_run[s] for s in range(1, 11)}
    assert losses(piped) == pytest.approx(first_ten, rel=1e-4)
    resumed = run_in_process(dirs, "data=8", 13, checkpoint_dir=tmp_path)
    assert f"resumed from step 10 in {tmp_path}" in resumed
    then = {s: long_run[s] for s in (11, 12, 13)}
    assert losses(resumed) == pytest.approx(then, rel=1e-4)


def test_an_offloaded_optimizer_trains_resumes_and_sits_in_host_memory(
    dirs, long_run, tmp_path
):
    """--offload optimizer: 10 steps on fsdp=8 print the losses of the run without it
    and save; data=8, without offloading, resumes from that checkpoint with the
    uninterrupted run's losses for steps 11-13. The compiled step places exactly Adam's
    two moments (each device's shard of every weight, float32) and its two step
    counters in host memory, memory space 5 of its entry layout."""
    offload = ("--offload", "optimizer")
    saved = run_in_process(dirs, "fsdp=8", 10, checkpoint_dir=tmp_path, extra=offload)
    assert losses(saved) == pytest.approx(
        {s: long_run[s] for s in range(1, 11)}, rel=1e-4
    )
    resumed = run_in_process(dirs, "data=8", 13, checkpoint_dir=tmp_path)
    assert f"resumed from step 10 in {tmp_path}" in resumed
    assert losses(resumed) == pytest.approx(
        {s: long_run[s] for s in (11, 12, 13)}, rel=1e-4
    )
    mesh, _, _, step, shapes, _ = prepared("fsdp=8", 10, offload)
    args = train.parse_args([*COMMON, "--mesh", "fsdp=8", *offload])
    text = lm_compiled.lower_step(step, shapes, args, mesh).compile().as_text()
    local = sum(
        np.prod(s.sharding.shard_shape(s.shape)) * 4
        for s in jax.tree.leaves(shapes.params)
    )
    assert lm_compiled.host_argument_bytes(text) == 2 * local + 2 * 4


def test_offloaded_activations_train_the_same_and_go_to_host_in_the_gpu_program():
    """--offload activations on fsdp=4,tensor=2 with 2 micro-batches: the same 3 steps
    as without it. XLA:CPU's program places nothing in host memory; the program lowered
    for CUDA moves one value a layer there, the layer's input (a micro-batch of 8 rows,
    128 tokens, width 128), and --compile-only counts each device's shard of it
    (2 rows x 64 tokens, split over fsdp and tensor) for 4 layers and 2 micro-batches.
    Without the flag that program moves nothing; with --remat dots it stops."""
    rng = np.random.default_rng(7)
    batches = [rng.integers(0, 2048, (16, 129), dtype=np.int32) for _ in range(3)]
    flags = [*COMMON, "--mesh", "fsdp=4,tensor=2", "--grad-accum", "2"]
    runs, placed = [], []
    for extra in ((), ("--offload", "activations")):
        args = train.parse_args([*flags, *extra])
        mesh, _, _, step, shapes, init = train.setup(args)
        runs.append(steps_on(step, shapes, init, mesh, batches))
        cuda = lm_compiled.lower_step(step, shapes, args, mesh, "cuda").as_text()
        placed.append(lm_compiled.host_placements(cuda))
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-6)
    assert placed == [[], [("f32", (8, 128, 128))]]
    cpu = lm_compiled.lower_step(step, shapes, args, mesh).compile().as_text()
    assert "S(5)" not in cpu  # XLA:CPU's program: no host memory space
    line = lm_compiled.offloaded_activations(step, shapes, args, mesh)
    assert "f32[2,64,128] a device" in line
    assert f"= {2 * 64 * 128 * 4 * 4 * 2} B" in line, line
    with pytest.raises(SystemExit, match="needs --remat full and no pipeline"):
        train.setup(
            train.parse_args([*flags, "--offload", "activations", "--remat", "dots"])
        )


def test_zero1_splits_the_optimizer_over_data_and_trains_the_same():
    """--zero1 on data=8: the same 3 steps as data=8 without it; the compiled step's
    arguments are every state leaf's shard on one device (Adam's moments an eighth
    where a dimension splits by 8), and it gathers the updated weights."""
    rng = np.random.default_rng(6)
    batches = [rng.integers(0, 2048, (16, 129), dtype=np.int32) for _ in range(3)]
    runs, sent = [], []
    for extra in ((), ("--zero1",)):
        args = train.parse_args([*COMMON, "--mesh", "data=8", "--steps", "10", *extra])
        # without --zero1: the step of the runs on data=8 (prepared)
        mesh, _, _, step, shapes, init = (
            train.setup(args) if extra else prepared("data=8", 10)
        )
        runs.append(steps_on(step, shapes, init, mesh, batches))
        compiled = lm_compiled.lower_step(step, shapes, args, mesh).compile()
        shard = lambda s: np.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
        tokens = 16 // 8 * 129 * 4
        held = sum(shard(s) for s in jax.tree.leaves(shapes)) + tokens
        assert compiled.memory_analysis().argument_size_in_bytes == held
        sent.append(lm_compiled.collective_bytes(compiled.as_text()))
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-6)
    mu = [s for s in jax.tree.leaves(shapes.opt_state) if s.ndim][0]
    assert "data" in str(mu.sharding.spec), mu.sharding
    assert "all-gather" not in sent[0] and sent[1]["all-gather"] > 0, sent


def test_accumulation_reduces_over_data_once_and_fsdp_per_micro_batch():
    """The compiled step's bytes, tiny at a global batch of 32: on data=8, 4 micro-batches
    send what one batch does (each data replica adds up its own gradients; one all-reduce
    after the loop). On fsdp=8 the sum is split like the weights, so each micro-batch's
    gradient is reduced into it: 4 times the bytes (the whole-size unreduced sum that
    reducing once would need is what FSDP exists to avoid)."""

    def sent(spec: str, micro: int) -> dict[str, int]:
        flags = ("--global-batch", "32", "--grad-accum", str(micro))
        args = train.parse_args([*COMMON, "--mesh", spec, *flags, "--compile-only"])
        mesh, _, _, step, shapes, _ = train.setup(args)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            train.compile_only(step, shapes, args, mesh)
        return lm_compiled.read_summary(out.getvalue())["collectives"]

    assert sent("data=8", 4) == sent("data=8", 1)  # measured: all-reduce 5,247,492 B
    fsdp_1, fsdp_4 = sent("fsdp=8", 1), sent("fsdp=8", 4)
    assert fsdp_4["all-reduce"] == pytest.approx(4 * fsdp_1["all-reduce"], rel=1e-3)
    # and each micro-batch gathers the layers' weights again (the embedding table is not
    # gathered): measured 7,369,728 -> 26,280,960 B.
    assert 3 * fsdp_1["all-gather"] < fsdp_4["all-gather"] < 4 * fsdp_1["all-gather"]


def test_accumulation_at_1b_keeps_the_temporaries_of_one_micro_batch(compiled_on_16):
    """Llama 3.2 1B on 16 devices, fsdp=8 x tensor=2, sequences of 4,096 tokens: a global
    batch of 64 in 4 micro-batches needs at most 1.15 times the temporaries of a batch of
    16 (the micro-batch's size): the activations are one micro-batch's, plus the
    gradients' running sum, split like the weights (compiled_on_16's RUNS_1B). Measured
    11.128 -> 11.437 GB."""
    temporaries = [compiled_on_16[run]["summary"]["temporaries"] for run in RUNS_1B]
    print(f"temporaries {temporaries} GB")
    assert temporaries[1] <= 1.15 * temporaries[0]


def test_total_steps_sets_the_schedule_and_steps_where_to_stop():
    """--total-steps: a run stopped at step 10 of 50 follows the 50-step run's learning
    rate; without it, a 10-step run decays over 21 steps (warmup 20 + 1)."""

    def params_after(steps: int, *flags: str) -> float:
        args = train.parse_args(["--steps", str(steps), *flags])
        tx = train.make_optimizer(args)
        params = {"kernel": jnp.ones(())}
        state = tx.init(params)
        for _ in range(30):
            updates, state = tx.update({"kernel": jnp.ones(())}, state, params)
            params = optax.apply_updates(params, updates)
        return float(params["kernel"])

    assert params_after(10, "--total-steps", "50") == params_after(50)
    assert params_after(10) != params_after(50)


def test_mfu_knows_the_device_kinds_of_the_hardware_table():
    """train.py's peaks, by exact device_kind, are those of the book's hardware table."""
    from jaxdist_lessons import hardware

    for chip in hardware.CHIPS.values():
        for kind in chip.device_kinds:
            assert train.PEAK_FLOPS[kind] == chip.peak_bf16_flops, kind
    assert "NVIDIA H100" not in train.PEAK_FLOPS  # a prefix is no kind
    assert set(train.PEAK_FLOPS) == {
        kind for chip in hardware.CHIPS.values() for kind in chip.device_kinds
    }


def test_peak_memory_reads_the_devices_counts_and_none_on_xla_cpu():
    class Device:  # what a GPU's memory_stats() holds (among other counts)
        def __init__(self, peak):
            self.stats = {"peak_bytes_in_use": peak, "bytes_limit": 127_000_000_000}

        def memory_stats(self):
            return self.stats

    line = train.peak_memory([Device(31_400_000_000), Device(30_000_000_000)])
    assert line == (
        "peak memory per device 31.40 GB (of 127.00 GB JAX may use; memory_stats() "
        "31.40 GB)"
    )
    assert train.peak_memory(jax.local_devices()) is None  # XLA:CPU counts nothing


def test_a_signal_to_another_process_is_named_as_such():
    preemption = train.Preemption(train.make_mesh("data=8"))
    assert preemption.reason() == "a preemption signal to another process"
    assert not train.Preemption.agreed(preemption.vote())
    preemption.signal = "SIGTERM"
    assert preemption.reason() == "SIGTERM"
    assert train.Preemption.agreed(preemption.vote())


# Every preset at its full width, one or two layers deep, with a vocabulary of at most
# 8,192: the logits' scale at initialisation depends on the width and the embedding's
# initialisation, not on the vocabulary's size (each logit is one row of the table times
# the normed residual), and a uniform guess's loss is ln V at any V. The full tables
# (1b's 128,256 x 2,048, tied) took 35 s to draw and compile. The 70b preset's layer alone
# is 4 GB in float32, too much for CI's machine beside the other tests: it shares 8b's
# untied initialisation, whose logits' scale does not depend on the width (the
# unembedding's N(0, 1/D)).
INIT_PRESETS = {"tiny": 2, "125m": 2, "1b": 2, "8b": 1}
INIT_VOCABULARY = 8192


@pytest.mark.parametrize("name", sorted(INIT_PRESETS))
def test_each_preset_starts_near_a_uniform_guess(name):
    """The loss at initialisation is within 1 nat of ln V, the loss of a uniform guess
    (1b's tied embedding at N(0, 1) started at 609; model.embedding_stddev)."""
    preset = model_config.PRESETS[name]
    config = dataclasses.replace(
        preset,
        num_layers=INIT_PRESETS[name],
        vocab_size=min(preset.vocab_size, INIT_VOCABULARY),
    )
    model = model_lib.abstract(config, jnp.float32, "none")
    tokens = jax.random.randint(jax.random.key(1), (2, 65), 0, config.vocab_size)

    @jax.jit
    def first_loss(rng):
        logits, _ = model_lib.initialized(model, rng)(tokens[:, :-1])
        return loss_lib.cross_entropy(logits, tokens[:, 1:])

    # RBG keys: XLA's random bit generator draws 8b's 1.3 billion weights about five
    # times faster on a CPU than the default threefry; and at XLA's default backend level,
    # not the tests' 0, which draws them some 20 times slower (1b: 7 s against 153 s).
    rng = jax.random.key(0, impl="unsafe_rbg")
    options = {"xla_backend_optimization_level": 2}
    loss = float(first_loss.lower(rng).compile(compiler_options=options)(rng))
    print(f"{name}: loss {loss:.3f}, ln V {np.log(config.vocab_size):.3f}")
    assert abs(loss - np.log(config.vocab_size)) < 1.0


def test_profile_writes_one_trace_per_process(dirs, spec_run, tmp_path):
    """--profile DIR traces steps 6 to 8 into DIR/process_<index>: two processes on one
    host no longer write the same file (jax.profiler names a trace by host). spec_run's
    10 steps trace them; a run of 7 ends inside the traced steps, and writes its trace
    still."""
    traced = spec_run[1].parent / "lm_profile"
    run_in_process(dirs, SPEC, 7, flags=("--profile", str(tmp_path / "seven")))
    for where in (traced, tmp_path / "seven"):
        assert [p.name for p in where.iterdir()] == ["process_0"]
        traces = list((where / "process_0").rglob("*.xplane.pb"))
        assert len(traces) == 1 and traces[0].stat().st_size > 0, traces
    # each traced step is marked for the profiler's per-step analysis (XProf's overview)
    [chrome] = (traced / "process_0").rglob("*.trace.json.gz")
    events = json.loads(gzip.decompress(chrome.read_bytes()))["traceEvents"]
    marked = [e["args"]["step_num"] for e in events if e.get("name") == "train"]
    assert marked == ["6", "7", "8"], marked
