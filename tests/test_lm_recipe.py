"""examples/lm/: the Llama-style trainer a reader copies (model.py, data.py, train.py).

Most runs are in-process, on the 8 simulated CPU devices of conftest.py, calling train.py's own
functions (a subprocess pays 5-9 s of start and compile); the runs that need several processes
(mpirun, srun) or 16 devices (tests/lm_compile_driver.py) are subprocesses. The corpus is
tokenized and packed once per session, into one shared data directory.
"""

import contextlib
import io
import os
import pathlib
import re
import signal
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "lm"))
import model as model_lib  # noqa: E402
import train  # noqa: E402

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
MESHES = [
    "data=8",
    "fsdp=8",
    "data=4,tensor=2",
    "fsdp=4,tensor=2",
    "data=2,fsdp=2,tensor=2",
]
SPEC = "data=2,fsdp=2,tensor=2"  # the mesh of the resume, mpirun and srun runs


@pytest.fixture(scope="session")
def dirs(tmp_path_factory):
    """One data directory (tokenizer and packed sequences, written by the first run) and one
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


def prepared(spec: str, schedule_steps: int):
    """main()'s objects for a mesh (one compile each): the learning rate schedule is that of a
    run of ``schedule_steps``; every run of at most 21 steps has the same one (warmup 20)."""
    key = (spec, max(schedule_steps, 21))
    if key not in _PREPARED:
        argv = [*COMMON, "--mesh", spec, "--steps", str(schedule_steps)]
        args = train.parse_args(argv)
        mesh = train.make_mesh(spec)
        config = model_lib.PRESETS[args.model]
        train.check_fits(config, mesh, args)
        model = model_lib.Transformer(config, jnp.float32, args.remat)
        tx = train.make_optimizer(args)
        with jax.set_mesh(mesh), nn.logical_axis_rules(train.RULES):
            shapes, init = train.abstract_state(model, tx, mesh, args.seq_len)
        step = train.make_train_step(jax.tree.map(lambda s: s.sharding, shapes), mesh)
        _PREPARED[key] = (mesh, model, tx, step, shapes, init)
    return _PREPARED[key]


def run_in_process(dirs, spec, steps, schedule_steps=10, checkpoint_dir=None) -> str:
    """train.train() as main() calls it; what it printed."""
    argv = [*COMMON, "--mesh", spec, "--steps", str(steps), "--data-dir", str(dirs["data"])]
    if checkpoint_dir:
        argv += ["--checkpoint-dir", str(checkpoint_dir), "--checkpoint-every", "10"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.train(train.parse_args(argv), *prepared(spec, schedule_steps))
    return out.getvalue()


def losses(stdout: str) -> dict[int, float]:
    return {
        int(s): float(v) for s, v in re.findall(r"^step (\d+) loss ([\d.]+) ", stdout, re.M)
    }


def environment(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "JAX_"))}
    env.update(ROOT_OK, JAX_NUM_CPU_DEVICES=str(devices), PATH=f"{BIN}:{env['PATH']}")
    return env


@pytest.fixture(scope="module")
def mesh_runs(dirs, tmp_path_factory):
    """10 steps on each mesh; the SPEC run checkpoints at step 10."""
    checkpoints = tmp_path_factory.mktemp("lm_checkpoints")
    runs = {
        spec: run_in_process(
            dirs, spec, 10, checkpoint_dir=checkpoints if spec == SPEC else None
        )
        for spec in MESHES
    }
    return runs, checkpoints


def test_every_mesh_gives_the_same_losses(mesh_runs):
    runs, _ = mesh_runs
    reference = losses(runs["data=8"])
    assert list(reference) == list(range(1, 11))
    assert reference[10] < reference[1] - 0.5  # it trains: 8.1594 -> 7.3823, measured
    for spec in MESHES[1:]:
        assert losses(runs[spec]) == pytest.approx(reference, rel=1e-4), spec


def test_a_resumed_run_continues_exactly(dirs, mesh_runs):
    """Stopped after its checkpoint at step 10 and rerun on the same directory, a run prints the
    losses of an uninterrupted run for steps 11-20: the model, the optimizer and the data
    iterator's position all came back."""
    runs, checkpoints = mesh_runs
    whole = run_in_process(dirs, SPEC, 20)
    resumed = run_in_process(dirs, SPEC, 20, checkpoint_dir=checkpoints)
    assert f"resumed from step 10 in {checkpoints}" in resumed
    assert list(losses(resumed)) == list(range(11, 21))
    expected = {s: v for s, v in losses(whole).items() if s > 10}
    assert losses(resumed) == expected  # to the printed 4 decimals
    assert {s: v for s, v in losses(whole).items() if s <= 10} == losses(runs[SPEC])
