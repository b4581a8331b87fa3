"""Train a Llama-style decoder on a mesh: pipeline, data, fsdp, expert, sequence, tensor

    python examples/lm/train.py --model tiny --mesh data=2,fsdp=2,tensor=2 --steps 200 \
        --global-batch 16 --seq-len 128 --num-devices 8
    JAX_NUM_CPU_DEVICES=4 mpirun -np 2 python examples/lm/train.py --model tiny ...
    srun --ntasks-per-node=8 --gpus-per-node=8 python examples/lm/train.py --model 1b
    python examples/lm/train.py --model 8b --mesh fsdp=8,tensor=2 --seq-len 2048 \
        --global-batch 16 --num-devices 16 --compile-only  # memory, bytes: no hardware
    python examples/lm/train.py --model 8b --mesh fsdp=64,tensor=4 --seq-len 2048 \
        --global-batch 256 --compile-only --topology v5e:16x16  # libtpu, no TPU
    python examples/lm/train.py --model tiny --mesh data=2,sequence=4  # ring attention
    python examples/lm/train.py --model tiny --experts 8 --top-k 2 --mesh expert=4 ...
    python examples/lm/train.py --model tiny --mesh pipeline=2,data=4 --grad-accum 4 \
        --schedule interleaved --virtual-stages 2  # GPipe, 1F1B or interleaved 1F1B

This file parses the command line, sets up and runs the loop. Beside it: model_config.py
(the shape, the presets, config.json), model.py (the decoder), layers.py (what it and
experts.py share: the axes' names, the MLP), attention.py (the attention kernels it
calls; splash.py the TPU's), experts.py (the mixture of experts, its router and
capacity), dropless.py (each device's share of the experts without a capacity), data.py
(tokens read in place, with Grain), mesh_spec.py (--mesh's axes and sizes, the rules,
what splits evenly), layout.py (the mesh, the check that stops a mesh in one line),
step.py (the loss, gradients, accumulation, ZeRO-1 and the optimizer's offload),
inputs.py (what the loss takes in: inputs and targets, the weights cast, micro-batches),
optimizer.py (AdamW, Adam's moments in --moments' dtype), pipeline.py (the model cut
into stages, and the schedules that run them) and schedules.py (their timetables),
resilience.py (preemption, the step deadline, checkpoints), metrics.py (MFU, the metrics
log), compiled.py (--compile-only) and convert.py (Hugging Face).

JAX, Flax, Optax, Orbax, Grain, NumPy and (for the corpus) tokenizers. Each step prints
its loss, tokens per second, step time and model-flops utilisation; checkpoints hold the
model, the optimizer and the data iterator, so a rerun on the same --checkpoint-dir
continues with the exact next batch. SIGTERM or SIGUSR1 (preemption notices) save at the
next step boundary and exit 0. --step-timeout S ends a job whose step has not advanced
on some process for S seconds (a process alive but stuck, which JAX's heartbeat does not
catch), naming the processes behind, or stopped, and printing every process's stack.
A bad path, a damaged checkpoint or a failed save is said in one line (status 2); a
damaged latest checkpoint falls back to the newest step that restores.
"""

import argparse
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data
import model as model_lib
import model_config
from attention import ATTENTIONS
from compiled import compile_only, out_of_memory, step_bytes
from layout import (
    AXES,
    BATCH,
    RULES,
    check_fits,
    lookup,
    make_mesh,
    process_rows,
)
from metrics import PEAK_FLOPS, MetricsLog, peak_memory
from optimizer import make_optimizer
from resilience import (
    Preemption,
    StepDeadline,
    checkpoint_manager,
    finish,
    restore,
    save,
)
from schedules import SCHEDULES
from step import abstract_state, make_eval_step, make_train_step

OFFLOADS = ("optimizer", "activations")


def offloads(text: str) -> frozenset[str]:
    """--offload's value: "none", or some of OFFLOADS joined by commas."""
    chosen = frozenset(text.split(",")) - {"none"}
    if unknown := sorted(chosen - set(OFFLOADS)):
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown)}: expected none or some of {', '.join(OFFLOADS)}"
        )
    return chosen


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--model", default="tiny", choices=sorted(model_config.PRESETS))
    add(
        "--model-config",
        metavar="CONFIG_JSON",
        help="the shape from a Hugging Face Llama config.json instead of --model "
        "(with convert.py from-hf's checkpoint: fine-tune a Llama)",
    )
    add(
        "--mesh",
        default="fsdp=-1",
        help="e.g. data=2,fsdp=2,tensor=2; -1 = the rest; axes: "
        + ", ".join(AXES)
        + " (on TPUs of several slices, data is the axis across them)",
    )
    add("--experts", type=int, default=0, help="experts per MLP (0: a dense MLP)")
    add("--top-k", type=int, default=1, help="experts per token")
    add(
        "--capacity-factor",
        type=float,
        default=1.25,
        help="an expert's slots per group: "
        "ceil(top_k x group x factor / experts); experts / top_k: none dropped",
    )
    add(
        "--dispatch",
        default="capacity",
        choices=["capacity", "dropless"],
        help="capacity: GShard's fixed slots per expert, a choice over them dropped; "
        "dropless: every choice computed, sorted by expert (grouped matrix products)",
    )
    add(
        "--balance",
        default="loss",
        choices=["loss", "bias"],
        help="loss: Switch's load-balancing loss; bias: DeepSeek-V3's per-expert "
        "routing bias, moved by --bias-rate a step toward equal loads (no such loss)",
    )
    add("--bias-rate", type=float, default=0.001, help="--balance bias's step")
    add(
        "--shared-experts",
        type=int,
        default=0,
        help="experts every token goes through, beside its --top-k (DeepSeekMoE)",
    )
    add(
        "--group-size",
        type=int,
        default=512,
        help="tokens routed together (at most --seq-len)",
    )
    add("--steps", type=int, default=200, help="stop after this step")
    add(
        "--total-steps",
        type=int,
        help="the learning rate schedule's length (default: --steps); keep it when a "
        "rerun goes further, so that the curve does not change",
    )
    add(
        "--global-batch",
        type=int,
        default=16,
        help="sequences per optimizer step, all devices",
    )
    add(
        "--grad-accum",
        type=int,
        default=1,
        help="micro-batches per step: each device computes --global-batch / K "
        "sequences at a time and adds up the gradients",
    )
    add(
        "--schedule",
        default="1f1b",
        choices=SCHEDULES,
        help="with a pipeline axis: gpipe (jax.grad writes the backward; each stage "
        "keeps all K micro-batches), 1f1b (at most P), interleaved (--virtual-stages "
        "per device, a smaller bubble)",
    )
    add(
        "--virtual-stages",
        type=int,
        default=1,
        metavar="V",
        help="--schedule interleaved: stages per device (the layers cut in P x V)",
    )
    add("--seq-len", type=int, default=128)
    add(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="compute type",
    )
    add("--remat", default="full", choices=sorted(model_lib.REMAT_POLICIES))
    add(
        "--zero1",
        action="store_true",
        help="split the optimizer's state over the data axis (ZeRO stage 1): each "
        "replica updates its share, and the updated weights are gathered",
    )
    add(
        "--moments",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the type Adam's two moments are kept in between steps (bfloat16: 4 "
        "bytes a weight instead of 8; each update still computed in float32)",
    )
    add(
        "--offload",
        default=frozenset(),
        type=offloads,
        help="what to keep in the host's pinned memory, comma-separated: optimizer "
        "(Adam's moments, moved to the device for each update), activations (each "
        "layer's saved input, moved back for the backward pass); or none",
    )
    add(
        "--attention",
        choices=ATTENTIONS,
        help="cudnn: cuDNN's fused kernel (NVIDIA GPUs; the default there, never run "
        "on a GPU by this project); splash: "
        "JAX's Pallas kernel (TPUs; the default there, for a --seq-len that is a "
        "multiple of 128); chunked: blocks in plain JAX, memory linear in the sequence "
        "(the default elsewhere); xla: XLA's reference, the T x T scores in float32",
    )
    add("--learning-rate", type=float, default=3e-3)
    add("--warmup-steps", type=int, default=20)
    add("--weight-decay", type=float, default=0.1)
    add("--clip-norm", type=float, default=1.0)
    add("--seed", type=int, default=0)
    add(
        "--data",
        help="your own token ids instead of the corpus, read in place: a .npy, a .bin "
        "(--data-dtype), or a directory of them (shards); several: a.bin,b.bin",
    )
    add("--data-dtype", choices=sorted(data.BIN_DTYPES), help="a .bin's token ids")
    add("--data-weights", help="mix the --data entries: e.g. 0.7,0.3")
    add(
        "--eod-id",
        type=int,
        help="the token that ends each document: attention and positions restart "
        "after it (document masking); by default a row is one text",
    )
    add(
        "--data-dir",
        default="/tmp/jaxdist_lm/data",
        help="where the default corpus's tokens are kept",
    )
    add(
        "--checkpoint-dir", help="save here, and resume from the latest step found here"
    )
    add("--checkpoint-every", type=int, default=100)
    add(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="every N steps, print the loss on held-out batches (0: never)",
    )
    add("--eval-batches", type=int, default=4, help="held-out batches per evaluation")
    add(
        "--log-dir",
        help="write each step's metrics to DIR/metrics.jsonl and to TensorBoard",
    )
    add("--keep", type=int, default=3, help="checkpoints to keep")
    add(
        "--num-devices",
        type=int,
        help="simulated CPU devices (ignored on accelerators)",
    )
    add(
        "--compile-only",
        action="store_true",
        help="compile one step, print memory, stop",
    )
    add(
        "--topology",
        metavar="NAME",
        help="with --compile-only: compile for a TPU slice that is not here, by "
        "libtpu's name for it (v5e:16x16, v5p:4x4x8, v6e:8x8); needs libtpu "
        "installed, not a TPU",
    )
    add(
        "--slices",
        type=int,
        default=1,
        help="with --topology: that many slices joined by the data-center network "
        "(--mesh's data, the axis across them, a multiple of it)",
    )
    add(
        "--profile", metavar="DIR", help="trace steps 6 to 8 with jax.profiler into DIR"
    )
    add("--compilation-cache", default="/tmp/jaxdist_lm/jax_cache")
    add(
        "--step-timeout",
        type=float,
        metavar="SECONDS",
        help="end the job (status 124) when a step has not finished on some process "
        "for SECONDS",
    )
    return parser.parse_args(argv)


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


def config_from_args(args) -> model_config.ModelConfig:
    """The preset or --model-config's shape, with experts if --experts asks for them."""
    if args.model_config:
        config = model_config.config_from_hf(args.model_config)
    else:
        config = model_config.PRESETS[args.model]
    if args.experts < 0 or not 1 <= args.top_k <= max(args.experts, 1):
        raise SystemExit(
            f"--top-k {args.top_k} must be between 1 and --experts {args.experts}"
        )
    if args.shared_experts < 0 or (args.shared_experts and not args.experts):
        raise SystemExit("--shared-experts needs --experts, and is 0 or more")
    if args.balance == "bias" and not args.experts:
        raise SystemExit("--balance bias balances experts: it needs --experts")
    if args.capacity_factor <= 0 or args.group_size < 1:
        raise SystemExit("--capacity-factor and --group-size must be positive")
    if args.eod_id is not None and not 0 <= args.eod_id < config.vocab_size:
        raise SystemExit(
            f"--eod-id {args.eod_id} is not a token id: the vocabulary has "
            f"{config.vocab_size} (0 to {config.vocab_size - 1})"
        )
    return dataclasses.replace(
        config,
        num_experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        group_size=args.group_size,
        dispatch=args.dispatch,
        balance=args.balance,
        shared_experts=args.shared_experts,
    )


def prepare_data(args, vocab_size: int) -> list[data.TokenRecords]:
    """Process 0 tokenizes the default corpus and checks the files first; the others
    then open them, or (on a node with its own disk) tokenize their own copy."""
    where = (args.data_dir, args.seq_len, vocab_size, args.data, args.data_dtype)
    if jax.process_index() == 0:
        data.prepare(*where)
    multihost_utils.sync_global_devices("data prepared")
    return data.sources(*where)


def make_evaluation(args, mesh, model, shapes, rows: slice, source: data.TokenRecords):
    """--eval-every: state -> the mean loss over --eval-batches held-out batches,
    placed on the devices once; None without --eval-every."""
    if not args.eval_every:
        return None
    eval_step = held_out_step(args, mesh, model, shapes)
    sharding, shape = (
        NamedSharding(mesh, P(BATCH)),
        (args.global_batch, args.seq_len + 1),
    )
    held_out = [
        jax.make_array_from_process_local_data(sharding, rows_BT, shape)
        for rows_BT in data.eval_batches(
            source, args.global_batch, rows, args.eval_batches
        )
    ]

    def evaluate(state) -> float:
        with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
            return float(np.mean([eval_step(state, batch) for batch in held_out]))

    evaluate.step = eval_step  # its memory counts toward the peak
    return evaluate


def held_out_step(args, mesh, model, shapes):
    """The jitted evaluation step, in the training step's micro-batches."""
    shardings = jax.tree.map(lambda s: s.sharding, shapes)
    dtype = jnp.dtype(args.dtype)
    return make_eval_step(shardings, mesh, dtype, args.eod_id, model, args.grad_accum)


def train(args, mesh, model, step, shapes, init) -> None:
    print0 = print if jax.process_index() == 0 else lambda *a, **k: None
    sources = prepare_data(args, model.config.vocab_size)
    rows = process_rows(mesh, args.global_batch, args.seq_len)
    # --eval-every: the first source's last batches are held out from training.
    held_out = args.eval_batches if args.eval_every else 0
    batches = data.batches(
        sources, args.global_batch, rows, args.seed, args.data_weights, held_out
    )
    manager = checkpoint_manager(args) if args.checkpoint_dir else None
    if manager and manager.latest_step() is not None:  # into the shapes: one copy
        state, batches = restore(manager, shapes, batches)
        print0(f"resumed from step {int(state.step)} in {args.checkpoint_dir}")
    else:
        with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):  # born sharded
            state = jax.jit(
                init, out_shardings=jax.tree.map(lambda s: s.sharding, shapes)
            )(jax.random.key(args.seed))
    tokens_per_step = args.global_batch * args.seq_len
    flops = model_config.flops_per_token(model.config, args.seq_len) * tokens_per_step
    peak = PEAK_FLOPS.get(jax.devices()[0].device_kind)  # None: no MFU (a CPU)
    preemption, batch_sharding = Preemption(mesh), NamedSharding(mesh, P(BATCH))
    deadline = StepDeadline(args.step_timeout).start() if args.step_timeout else None
    log = MetricsLog(args.log_dir)
    evaluate = make_evaluation(args, mesh, model, shapes, rows, sources[0])
    first = now = int(state.step)  # the one read of the step from the device
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
        if deadline:  # after the step: the first step's compilation does not count
            deadline.reached(now)
        return preemption.agreed(vote)

    for now in range(first + 1, args.steps + 1):
        tokens = jax.make_array_from_process_local_data(
            batch_sharding, next(batches), (args.global_batch, args.seq_len + 1)
        )
        if args.profile and now == 6:  # trace steps 6 to 8, one trace per process
            jax.profiler.start_trace(
                os.path.join(args.profile, f"process_{jax.process_index()}")
            )
        elif args.profile and now == 9:
            jax.profiler.stop_trace()
        # "train N" on a profile's timelines: XProf finds the steps by it
        marked = jax.profiler.StepTraceAnnotation("train", step_num=now)
        with marked, jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
            state, metrics = step(state, tokens)  # queued: the device runs it
        # Step now - 1's numbers, while step now runs: no wait between steps.
        stop = pending is not None and report(*pending)
        pending = (now, metrics, preemption.vote())
        evaluating = evaluate and (now % args.eval_every == 0 or now == args.steps)
        if evaluating or stop:  # step now's numbers first (all processes alike)
            stop = report(*pending) or stop
            pending = None
        if manager and (now % args.checkpoint_every == 0 or stop or now == args.steps):
            save(manager, now, state, batches)
        if evaluating:
            loss = evaluate(state)
            log.write(now, f"eval {now} loss {loss:.4f}", {"eval_loss": loss})
            clock = time.perf_counter()  # the next step's time leaves evaluation out
        if stop:
            break
    if pending:
        report(*pending)
    steps = [step] + ([evaluate.step] if evaluate else [])
    if peak := peak_memory(
        jax.local_devices(), steps_memory(steps, shapes, args, mesh)
    ):
        print0(peak, flush=True)
    if args.profile and first < 6 <= now < 9:  # stopped before step 9: end the trace
        jax.profiler.stop_trace()
    if deadline:
        deadline.stop()
    if manager:
        finish(manager)  # the last save is asynchronous
        manager.close()
    if stop:  # once the save is done
        print0(preemption.farewell(now, args.checkpoint_dir), flush=True)
    log.close()


def steps_memory(steps, shapes, args, mesh) -> list[int]:
    """The bytes each jitted step holds a device, where the devices count memory (a
    GPU's or a TPU's; none on XLA:CPU): compiled again, which reads JAX's compilation
    cache."""
    if not jax.local_devices()[0].memory_stats():
        return []
    return [step_bytes(step, shapes, args, mesh) for step in steps]


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


def target_devices(args) -> list | None:
    """With --topology, the devices of a TPU slice (or of --slices of them) that the TPU
    compiler describes without the chips, as MaxText's train_compile.py does; without
    it, None: this machine's."""
    if args.slices < 1:
        raise SystemExit(f"--slices {args.slices}: give 1 or more")
    if not args.topology:
        if args.slices != 1:
            raise SystemExit("--slices needs --topology: the slices to compile for")
        return None
    if not args.compile_only:
        raise SystemExit(
            "--topology compiles for chips that are not here: add --compile-only"
        )
    from jax.experimental import topologies

    # JAX would write the program to its persistent cache and could not read it back:
    # deserializing needs a client of those chips.
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        topology = topologies.get_topology_desc(
            args.topology, "tpu", num_slices=args.slices
        )
    except RuntimeError as error:  # no libtpu, or a name it does not know: its words
        said = str(error).splitlines()[0]
        if "not installed" in said:
            raise SystemExit(
                f"--topology needs libtpu, the TPU compiler (no TPU needed), in a "
                f"folder of its own: pip install --target DIR libtpu, of the version "
                f"jax[tpu]=={jax.__version__} asks for, then PYTHONPATH=DIR; JAX said: "
                f"{said}"
            ) from None
        raise SystemExit(
            f"--topology {args.topology}: {said} (libtpu's names: v5e:16x16, "
            f"v5p:4x4x8, v6e:8x8, v4:2x2x2)"
        ) from None
    return topology.devices


def setup(args, devices=None):
    """The mesh, the model, the optimizer, the jitted step and the state's shapes;
    over ``devices`` (by default this machine's)."""
    mesh = make_mesh(args.mesh, devices)
    platform = devices[0].platform if devices else jax.default_backend()
    config = config_from_args(args)
    check_fits(config, mesh, args)
    # dropless.py's exchange: ragged_all_to_all where the backend has it
    ragged = platform in ("gpu", "tpu")
    config = dataclasses.replace(config, exchange="ragged" if ragged else "padded")
    dropless_split = config.dispatch == "dropless" and mesh.shape["expert"] > 1
    if dropless_split and not ragged and jax.process_index() == 0:  # said once
        print(
            f"dropless experts on expert={mesh.shape['expert']}: all_to_alls of "
            f"worst-case buffers (room for all of a device's choices for every "
            f"device): {platform} has no jax.lax.ragged_all_to_all"
        )
    model = model_lib.Transformer(
        config,
        jnp.dtype(args.dtype),
        args.remat,
        offload_activations="activations" in args.offload,
        context_parallel=mesh.shape["sequence"] > 1,
        attention=attention_kind(args.attention, args.seq_len, platform),
        lookup=lookup(config, mesh, args),
    )
    tx = make_optimizer(args)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        shapes, init = abstract_state(
            model, tx, mesh, args.seq_len, args.offload, args.zero1
        )
    step = make_train_step(
        jax.tree.map(lambda s: s.sharding, shapes),
        mesh,
        jnp.dtype(args.dtype),
        args.grad_accum,
        args.eod_id,
        model,
        args.schedule,
        args.virtual_stages,
        args.zero1,
    )
    return mesh, model, tx, step, shapes, init


def main(argv=None) -> None:
    args = parse_args(argv)
    data.check_paths(args)
    if args.num_devices:
        jax.config.update("jax_num_cpu_devices", args.num_devices)
    jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
    join_processes()
    devices = target_devices(args)
    mesh, model, _, step, shapes, init = setup(args, devices)
    if args.compile_only:
        held_out = held_out_step(args, mesh, model, shapes) if args.eval_every else None
        # the step and the state's shapes for other flags
        rebuild = lambda other: setup(other, devices)[3:5]
        return compile_only(step, shapes, args, mesh, held_out, rebuild)
    try:
        train(args, mesh, model, step, shapes, init)
    except jax.errors.JaxRuntimeError as error:  # out of memory: one line, no traceback
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        raise SystemExit(out_of_memory(str(error), shapes, args, mesh)) from None


if __name__ == "__main__":
    try:
        main()
    except SystemExit as stop:  # a refusal: its one line, and status 2 as argparse's
        if not isinstance(stop.code, str):
            raise
        print(stop.code, file=sys.stderr)
        sys.exit(2)
