"""Train a Llama-style decoder on a mesh: pipeline, data, fsdp, expert, sequence, tensor

    python -m jaxdist_lm.train --model tiny --mesh data=2,fsdp=2,tensor=2 --steps 200 \
        --global-batch 16 --seq-len 128 --num-devices 8
    JAX_NUM_CPU_DEVICES=4 mpirun -np 2 python -m jaxdist_lm.train --model tiny ...
    srun --ntasks-per-node=8 --gpus-per-node=8 python -m jaxdist_lm.train --model 1b
    python -m jaxdist_lm.train --model 8b --mesh fsdp=8,tensor=2 --seq-len 2048 \
        --global-batch 16 --num-devices 16 --compile-only  # memory, bytes: no hardware
    python -m jaxdist_lm.train --model 8b --mesh fsdp=64,tensor=4 --seq-len 2048 \
        --global-batch 256 --compile-only --topology v5e:16x16  # libtpu, no TPU
    python -m jaxdist_lm.train --model tiny --mesh data=2,sequence=4  # ring attention
    python -m jaxdist_lm.train --model tiny --experts 8 --top-k 2 --mesh expert=4 ...
    python -m jaxdist_lm.train --model tiny --mesh pipeline=2,data=4 --grad-accum 4 \
        --schedule interleaved --virtual-stages 2  # GPipe, 1F1B or interleaved 1F1B

command_line.py reads the command line into run_config.py's RunConfig (every flag, typed
and frozen); this file sets up and runs the loop. __init__.py lists the other modules.

It needs JAX, Flax, Optax, Orbax, Grain and NumPy; tokenizers for the default corpus,
tensorboardX for --log-dir.
Each step prints its loss, tokens per second, step time and MFU. Checkpoints hold the
model, the optimizer and the data iterator: a rerun continues with the exact next batch.
SIGTERM or SIGUSR1 save at the next step boundary and exit 0; a refusal is one line.
"""

import dataclasses
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import data, model_config
from . import model as model_lib
from .command_line import PROFILED, parse_args
from .compiled import compile_only, out_of_memory, step_bytes
from .layout import BATCH, RULES, check_fits, make_mesh, process_rows
from .mesh_spec import lookup
from .metrics import PEAK_FLOPS, MetricsLog, peak_memory
from .optimizer import make_optimizer
from .resilience import (
    Preemption,
    StepDeadline,
    checkpoint_manager,
    finish,
    restore,
    save,
)
from .run_config import RunConfig
from .step import abstract_state, make_eval_step, make_train_step


# Join only when a launcher started several processes. With none, initialize() still
# looks for a cluster, and on a TPU VM it asks the Cloud metadata server, which fails or
# hangs where there is none. JAX's detection reads these variables (jax/_src/clusters/).
def join_processes() -> bool:
    """Join the job's other processes if a launcher started several; say whether."""
    env = os.environ
    mpi = int(env.get("OMPI_COMM_WORLD_SIZE", 1)) > 1  # Open MPI's mpirun
    tpu_hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES", "")
    several = (
        mpi
        # srun; an salloc shell or a batch script has SLURM_NTASKS but no step
        or (int(env.get("SLURM_NTASKS", 1)) > 1 and "SLURM_STEP_NODELIST" in env)
        or "JOB_COMPLETION_INDEX" in env  # a pod of a Kubernetes Indexed Job (a JobSet)
        or "," in tpu_hosts  # a TPU slice of several hosts on GKE
        or int(env.get("MEGASCALE_NUM_SLICES", 1)) > 1  # several TPU slices
        or "JAX_COORDINATOR_ADDRESS" in env  # set by hand, as for a Cloud TPU VM slice
    )
    if several:  # jax 0.10.2 finds Open MPI 5's processes only through mpi4py
        jax.distributed.initialize(cluster_detection_method="mpi4py" if mpi else None)
    return several


def model_config_of(run: RunConfig) -> model_config.ModelConfig:
    """The preset or --model-config's shape, with experts if --experts asks for them."""
    if run.model_config:
        config = model_config.config_from_hf(run.model_config)
    else:
        config = model_config.PRESETS[run.model]
    if run.experts < 0 or not 1 <= run.top_k <= max(run.experts, 1):
        raise SystemExit(
            f"--top-k {run.top_k} must be between 1 and --experts {run.experts}"
        )
    if run.shared_experts < 0 or (run.shared_experts and not run.experts):
        raise SystemExit("--shared-experts needs --experts, and is 0 or more")
    if run.balance == "bias" and not run.experts:
        raise SystemExit("--balance bias balances experts: it needs --experts")
    if run.capacity_factor <= 0 or run.group_size < 1:
        raise SystemExit("--capacity-factor and --group-size must be positive")
    if run.eod_id is not None and not 0 <= run.eod_id < config.vocab_size:
        raise SystemExit(
            f"--eod-id {run.eod_id} is not a token id: the vocabulary has "
            f"{config.vocab_size} (0 to {config.vocab_size - 1})"
        )
    return dataclasses.replace(
        config,
        num_experts=run.experts,
        top_k=run.top_k,
        capacity_factor=run.capacity_factor,
        group_size=run.group_size,
        dispatch=run.dispatch,
        balance=run.balance,
        shared_experts=run.shared_experts,
    )


def prepare_data(run: RunConfig, vocab_size: int) -> list[data.TokenRecords]:
    """Process 0 tokenizes the default corpus and checks the files first; the others
    then open them, or (on a node with its own disk) tokenize their own copy."""
    where = (run.data_dir, run.seq_len, vocab_size, run.data, run.data_dtype)
    if jax.process_index() == 0:
        data.prepare(*where)
    multihost_utils.sync_global_devices("data prepared")
    return data.sources(*where)


def make_evaluation(
    run: RunConfig, mesh, model, shapes, rows: slice, source: data.TokenRecords
):
    """--eval-every: state -> the mean loss over --eval-batches held-out batches,
    placed on the devices once; None without --eval-every."""
    if not run.eval_every:
        return None
    eval_step = held_out_step(run, mesh, model, shapes)
    sharding, shape = (
        NamedSharding(mesh, P(BATCH)),
        (run.global_batch, run.seq_len + 1),
    )
    held_out = [
        jax.make_array_from_process_local_data(sharding, rows_BT, shape)
        for rows_BT in data.eval_batches(
            source, run.global_batch, rows, run.eval_batches
        )
    ]

    def evaluate(state) -> float:
        with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
            return float(np.mean([eval_step(state, batch) for batch in held_out]))

    # train() counts the evaluation step's memory toward the peak
    evaluate.step = eval_step
    return evaluate


def held_out_step(run: RunConfig, mesh, model, shapes):
    """The jitted evaluation step, in the training step's micro-batches."""
    shardings = jax.tree.map(lambda s: s.sharding, shapes)
    dtype = jnp.dtype(run.dtype)
    return make_eval_step(shardings, mesh, dtype, run.eod_id, model, run.grad_accum)


def train(run: RunConfig, mesh, model, step, shapes, init) -> None:
    print0 = print if jax.process_index() == 0 else lambda *a, **k: None
    sources = prepare_data(run, model.config.vocab_size)
    rows = process_rows(mesh, run.global_batch, run.seq_len)
    # --eval-every: the first source's last batches are held out from training.
    held_out = run.eval_batches if run.eval_every else 0
    batches = data.batches(
        sources, run.global_batch, rows, run.seed, run.data_weights, held_out
    )
    manager = None
    if run.checkpoint_dir:
        manager = checkpoint_manager(run.checkpoint_dir, run.keep, run.checkpoint_every)
    # Restored straight into the sharded shapes: no second copy on any device.
    if manager and manager.latest_step() is not None:
        state, batches = restore(manager, shapes, batches)
        print0(f"resumed from step {int(state.step)} in {run.checkpoint_dir}")
    else:
        # jit with out_shardings: the state is born sharded, never whole on one device
        with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
            state = jax.jit(
                init, out_shardings=jax.tree.map(lambda s: s.sharding, shapes)
            )(jax.random.key(run.seed))
    tokens_per_step = run.global_batch * run.seq_len
    flops = model_config.flops_per_token(model.config, run.seq_len) * tokens_per_step
    # None on a device without a known peak (a CPU): no MFU printed
    peak = PEAK_FLOPS.get(jax.devices()[0].device_kind)
    preemption, batch_sharding = Preemption(mesh), NamedSharding(mesh, P(BATCH))
    deadline = StepDeadline(run.step_timeout).start() if run.step_timeout else None
    log = MetricsLog(run.log_dir)
    evaluate = make_evaluation(run, mesh, model, shapes, rows, sources[0])
    # The loop's one read of the step counter from the device.
    first = now = int(state.step)
    pending, clock, stop = None, time.perf_counter(), False

    def report(now: int, metrics: dict, vote: jax.Array) -> bool:
        """Step ``now``'s numbers, read once the next step is queued; stop there?"""
        nonlocal clock
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        seconds, clock = time.perf_counter() - clock, time.perf_counter()
        values |= {"tokens_per_s": tokens_per_step / seconds, "step_time_s": seconds}
        mfu = (
            f" mfu {flops / seconds / (peak * jax.device_count()):.1%}" if peak else ""
        )
        log.write(
            now,
            f"step {now} loss {values['loss']:.4f} grad_norm {values['grad_norm']:.3f} "
            f"tokens/s {values['tokens_per_s']:,.0f} "
            f"step_time {seconds * 1e3:.0f} ms{mfu}",
            values,
        )
        # Marked after a step ends, so the first step's compilation does not count.
        if deadline:
            deadline.reached(now)
        return preemption.agreed(vote)

    for now in range(first + 1, run.steps + 1):
        tokens = jax.make_array_from_process_local_data(
            batch_sharding, next(batches), (run.global_batch, run.seq_len + 1)
        )
        # one trace per process
        if run.profile and now == PROFILED.start:
            jax.profiler.start_trace(
                os.path.join(run.profile, f"process_{jax.process_index()}")
            )
        elif run.profile and now == PROFILED.stop:
            jax.profiler.stop_trace()
        # "train N" on a profile's timelines: XProf finds the steps by it
        marked = jax.profiler.StepTraceAnnotation("train", step_num=now)
        with marked, jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
            # Dispatch returns at once; the device runs the step while Python goes on.
            state, metrics = step(state, tokens)
        # Step now - 1's numbers, while step now runs: no wait between steps.
        stop = pending is not None and report(*pending)
        pending = (now, metrics, preemption.vote())
        evaluating = evaluate and (now % run.eval_every == 0 or now == run.steps)
        # Step now's numbers first, on all processes alike.
        if evaluating or stop:
            stop = report(*pending) or stop
            pending = None
        if manager and (now % run.checkpoint_every == 0 or stop or now == run.steps):
            save(manager, now, state, batches)
        if evaluating:
            loss = evaluate(state)
            log.write(now, f"eval {now} loss {loss:.4f}", {"eval_loss": loss})
            # the next step's time leaves evaluation out
            clock = time.perf_counter()
        if stop:
            break
    if pending:
        report(*pending)
    steps = [step] + ([evaluate.step] if evaluate else [])
    if peak := peak_memory(jax.local_devices(), steps_memory(steps, shapes, run, mesh)):
        print0(peak, flush=True)
    # Stopped before PROFILED.stop: end the trace.
    if run.profile and first < PROFILED.start <= now < PROFILED.stop:
        jax.profiler.stop_trace()
    if deadline:
        deadline.stop()
    if manager:
        # the last save is asynchronous: wait for it
        finish(manager)
        manager.close()
    # Said only once the save is done.
    if stop:
        print0(preemption.farewell(now, run.checkpoint_dir), flush=True)
    log.close()


def steps_memory(steps, shapes, run: RunConfig, mesh) -> list[int]:
    """The bytes each jitted step holds on a device; [] where devices count no memory
    (XLA:CPU). Compiles again, which reads JAX's compilation cache."""
    if not jax.local_devices()[0].memory_stats():
        return []
    return [step_bytes(step, shapes, run, mesh) for step in steps]


def attention_kind(
    requested: str | None, seq_len: int | None = None, platform: str | None = None
) -> str:
    """--attention, or its default for the devices (``platform``: by default this
    machine's): cuDNN's kernel on NVIDIA GPUs, splash on TPUs (where the kernel's blocks
    fit ``seq_len``), chunked blocks elsewhere."""
    platform = platform or jax.devices()[0].platform
    if requested == "cudnn" and platform != "gpu":
        raise SystemExit(
            f"--attention cudnn needs an NVIDIA GPU; this machine has {platform} "
            "devices: use --attention chunked or xla"
        )
    # Off a TPU the kernel runs only interpreted (the tests' way): too slow to train.
    if requested == "splash" and platform != "tpu":
        raise SystemExit(
            f"--attention splash needs a TPU; this machine has {platform} devices: "
            "use --attention chunked or xla"
        )
    fits = seq_len is None or seq_len % model_lib.splash.LANES == 0
    if requested == "splash" and not fits:
        raise SystemExit(
            f"--attention splash needs a --seq-len that is a multiple of "
            f"{model_lib.splash.LANES}; got {seq_len}: use --attention chunked"
        )
    default = {"gpu": "cudnn", "tpu": "splash" if fits else "chunked"}
    return requested or default.get(platform, "chunked")


def target_devices(run: RunConfig) -> list | None:
    """--topology's TPU devices, described without the chips (as MaxText's
    train_compile.py does); None without it: this machine's."""
    if run.slices < 1:
        raise SystemExit(f"--slices {run.slices}: give 1 or more")
    if not run.topology:
        if run.slices != 1:
            raise SystemExit("--slices needs --topology: the slices to compile for")
        return None
    if not run.compile_only:
        raise SystemExit(
            "--topology compiles for chips that are not here: add --compile-only"
        )
    from jax.experimental import topologies

    # JAX would write the program to its persistent cache and could not read it back:
    # deserializing needs a client of those chips.
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        topology = topologies.get_topology_desc(
            run.topology, "tpu", num_slices=run.slices
        )
    # No libtpu, or a name it does not know: repeat its words.
    except RuntimeError as error:
        said = str(error).splitlines()[0]
        if "not installed" in said:
            raise SystemExit(
                f"--topology needs libtpu, the TPU compiler (no TPU needed), in a "
                f"folder of its own: pip install --target DIR libtpu, of the version "
                f"jax[tpu]=={jax.__version__} asks for, then PYTHONPATH=DIR; JAX said: "
                f"{said}"
            ) from None
        raise SystemExit(
            f"--topology {run.topology}: {said} (libtpu's names: v5e:16x16, "
            f"v5p:4x4x8, v6e:8x8, v4:2x2x2)"
        ) from None
    return topology.devices


def setup(run: RunConfig, devices=None):
    """The mesh, the model, the optimizer, the jitted step and the state's shapes;
    over ``devices`` (by default this machine's)."""
    mesh = make_mesh(run.mesh, devices)
    platform = devices[0].platform if devices else jax.default_backend()
    config = model_config_of(run)
    check_fits(config, mesh, run)
    # dropless.py's exchange: ragged_all_to_all where the backend has it
    ragged = platform in ("gpu", "tpu")
    config = dataclasses.replace(config, exchange="ragged" if ragged else "padded")
    dropless_split = config.dispatch == "dropless" and mesh.shape["expert"] > 1
    # Warn once, from process 0, not from every process.
    if dropless_split and not ragged and jax.process_index() == 0:
        print(
            f"dropless experts on expert={mesh.shape['expert']}: all_to_alls of "
            f"worst-case buffers (room for all of a device's choices for every "
            f"device): {platform} has no jax.lax.ragged_all_to_all"
        )
    model = model_lib.abstract(
        config,
        jnp.dtype(run.dtype),
        run.remat,
        offload_activations="activations" in run.offload,
        context_parallel=mesh.shape["sequence"] > 1,
        attention=attention_kind(run.attention, run.seq_len, platform),
        lookup=lookup(config, dict(mesh.shape), run.global_batch * run.seq_len),
    )
    tx = make_optimizer(run)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        shapes, init = abstract_state(model, tx, mesh, run.offload, run.zero1)
    step = make_train_step(jax.tree.map(lambda s: s.sharding, shapes), mesh, run, model)
    return mesh, model, tx, step, shapes, init


def main(argv=None) -> None:
    run = parse_args(argv)
    data.check_paths(run)
    if run.num_devices:
        jax.config.update("jax_num_cpu_devices", run.num_devices)
    jax.config.update("jax_compilation_cache_dir", run.compilation_cache)
    join_processes()
    devices = target_devices(run)
    mesh, model, _, step, shapes, init = setup(run, devices)
    if run.compile_only:
        held_out = held_out_step(run, mesh, model, shapes) if run.eval_every else None
        return compile_only(step, shapes, run, mesh, held_out)
    try:
        train(run, mesh, model, step, shapes, init)
    # Out of memory: one line, no traceback.
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        raise SystemExit(out_of_memory(str(error), shapes, run, mesh)) from None


if __name__ == "__main__":
    try:
        main()
    # A refusal: its one line, and status 2 as argparse's.
    except SystemExit as stop:
        if not isinstance(stop.code, str):
            raise
        print(stop.code, file=sys.stderr)
        sys.exit(2)
