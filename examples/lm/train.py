"""Train a Llama-style language model on a mesh of data, fsdp, expert, sequence, tensor.

    python examples/lm/train.py --model tiny --mesh data=2,fsdp=2,tensor=2 --steps 200 \
        --global-batch 16 --seq-len 128 --num-devices 8
    JAX_NUM_CPU_DEVICES=4 mpirun -np 2 python examples/lm/train.py --model tiny ...
    srun --ntasks-per-node=8 --gpus-per-node=8 python examples/lm/train.py --model 1b
    python examples/lm/train.py --model 8b --mesh fsdp=8,tensor=2 --seq-len 2048 \
        --global-batch 16 --num-devices 16 --compile-only  # memory, bytes: no hardware
    python examples/lm/train.py --model tiny --mesh data=2,sequence=4  # ring attention
    python examples/lm/train.py --model tiny --experts 8 --top-k 2 --mesh expert=4 ...

JAX, Flax, Optax, Orbax, Grain, NumPy and (for the corpus) tokenizers. Each step prints
its loss, tokens per second, step time and model-flops utilisation; checkpoints hold the
model, the optimizer and the data iterator, so a rerun on the same --checkpoint-dir
continues with the exact next batch. SIGTERM or SIGUSR1 (preemption notices) save at the
next step boundary and exit 0. --step-timeout S ends a job whose step has not advanced
on some process for S seconds (a process alive but stuck, which JAX's heartbeat does not
catch), naming the processes behind and printing every process's stack.
"""

import argparse
import collections
import contextlib
import dataclasses
import faulthandler
import json
import os
import re
import signal
import sys
import threading
import time

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402
import model as model_lib  # noqa: E402

# 'tensor' last: its devices are neighbours, in one node; 'sequence' next (a ring of
# keys and values).
AXES = ("data", "fsdp", "expert", "sequence", "tensor")
BATCH = ("data", "fsdp", "expert")  # the mesh axes that split the batch rows

# Logical axis -> mesh axis. Weights: FSDP splits the model width; tensor parallelism
# splits heads, MLP width and vocabulary (Megatron's column/row split); 'expert' splits
# the experts. Activations: the batch over data, fsdp and expert (experts aside,
# 'expert' is one more data axis); the sequence over 'sequence' (context parallelism)
# and, between blocks, over 'tensor' too (Megatron's sequence parallelism); routed
# tokens by expert, not by row.
RULES = (
    ("batch", BATCH), ("expert_batch", ("data", "fsdp")),
    ("embed", "fsdp"), ("experts", "expert"), ("act_experts", "expert"),
    ("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"),
    ("act_seq", "sequence"), ("act_seq_residual", ("sequence", "tensor")),
    ("act_heads", "tensor"), ("act_kv_heads", "tensor"), ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)  # fmt: skip

# Peak dense bf16 flop/s per chip, by the device_kind JAX reports, matched exactly (a
# near miss, an H100 NVL or an H200 NVL, has other peaks): NVIDIA's datasheets give
# Tensor Core peaks with sparsity, twice the dense ones; Google's, per TPU chip.
PEAK_FLOPS = {
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12,  # H100 SXM: 1,979 T with sparsity
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H200": 989e12,  # H200 SXM
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5": 459e12,  # v5p
    "TPU v5p": 459e12,
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--model", default="tiny", choices=sorted(model_lib.PRESETS))
    add(
        "--model-config",
        metavar="CONFIG_JSON",
        help="the shape from a Hugging Face Llama config.json instead of --model "
        "(with convert.py from-hf's checkpoint: fine-tune a Llama)",
    )
    add(
        "--mesh",
        default="fsdp=-1",
        help="e.g. data=2,fsdp=2,tensor=2; -1 = the rest; axes: " + ", ".join(AXES),
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
    add("--seq-len", type=int, default=128)
    add(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="compute type",
    )
    add("--remat", default="full", choices=sorted(model_lib.REMAT_POLICIES))
    add(
        "--attention",
        choices=model_lib.ATTENTIONS,
        help="cudnn: cuDNN's fused kernel (NVIDIA GPUs; the default there); chunked: "
        "blocks in plain JAX, memory linear in the sequence (the default elsewhere); "
        "xla: XLA's reference, the T x T scores in float32",
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
        "--profile", metavar="DIR", help="trace steps 5 to 7 with jax.profiler into DIR"
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


def join_processes() -> None:
    """Join the other processes if mpirun or srun started several: JAX detects them."""
    mpi = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1  # Open MPI's mpirun
    if mpi or int(os.environ.get("SLURM_NTASKS", "1")) > 1:  # or SLURM's srun
        jax.distributed.initialize(cluster_detection_method="mpi4py" if mpi else None)


def make_mesh(spec: str) -> jax.sharding.Mesh:
    """'data=2,tensor=2' -> a mesh over all of AXES; one size may be -1, the rest 1."""
    sizes = {axis: 1 for axis in AXES}
    for item in spec.split(","):
        axis, _, size = item.partition("=")
        if axis not in sizes or not re.fullmatch(r"-?\d+", size):
            raise SystemExit(f"--mesh {spec}: expected axis=size with axes {AXES}")
        sizes[axis] = int(size)
    known = int(np.prod([s for s in sizes.values() if s != -1]))
    rest = [axis for axis, size in sizes.items() if size == -1]
    if len(rest) > 1 or jax.device_count() % known:
        raise SystemExit(f"--mesh {spec} does not fit {jax.device_count()} devices")
    for axis in rest:
        sizes[axis] = jax.device_count() // known
    if np.prod(list(sizes.values())) != jax.device_count():
        raise SystemExit(
            f"--mesh {spec} has {np.prod(list(sizes.values()))} devices, "
            f"not the {jax.device_count()} there are"
        )
    shape = tuple(sizes[a] for a in AXES)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def model_config(args) -> model_lib.ModelConfig:
    """The preset or --model-config's shape, with experts if --experts asks for them."""
    if args.model_config:
        config = model_lib.config_from_hf(args.model_config)
    else:
        config = model_lib.PRESETS[args.model]
    if args.experts < 0 or not 1 <= args.top_k <= max(args.experts, 1):
        raise SystemExit(
            f"--top-k {args.top_k} must be between 1 and --experts {args.experts}"
        )
    if args.capacity_factor <= 0 or args.group_size < 1:
        raise SystemExit("--capacity-factor and --group-size must be positive")
    return dataclasses.replace(
        config,
        num_experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        group_size=args.group_size,
    )


def check_fits(config: model_lib.ModelConfig, mesh, args) -> None:
    """Say what does not divide, before JAX says it less clearly."""
    tensor, batch_ways = (
        mesh.shape["tensor"],
        int(np.prod([mesh.shape[a] for a in BATCH])),
    )
    expert, sequence = mesh.shape["expert"], mesh.shape["sequence"]
    if expert > 1 and config.num_experts % expert:
        raise SystemExit(
            f"--experts {config.num_experts} does not split over expert={expert}"
        )
    if sequence > 1 and args.seq_len % (2 * sequence * tensor):
        raise SystemExit(
            f"--seq-len {args.seq_len} does not split into 2 x sequence={sequence}"
            f" x tensor={tensor} chunks (the zigzag layout)"
        )
    group = min(config.group_size, args.seq_len)
    if config.num_experts and (
        args.seq_len % group or (args.seq_len // group) % sequence
    ):
        raise SystemExit(
            f"--seq-len {args.seq_len} does not make groups of {group} tokens "
            f"that split over sequence={sequence}"
        )
    for name in ("num_heads", "num_kv_heads", "mlp_width", "vocab_size"):
        if getattr(config, name) % tensor:
            raise SystemExit(
                f"{name}={getattr(config, name)} does not split over tensor={tensor}"
            )
    if args.grad_accum < 1:
        raise SystemExit(f"--grad-accum {args.grad_accum} must be 1 or more")
    if args.global_batch % batch_ways:
        raise SystemExit(
            f"--global-batch {args.global_batch} does not split over data x fsdp "
            f"x expert = {batch_ways} devices"
        )
    if args.global_batch % (batch_ways * args.grad_accum):
        raise SystemExit(
            f"--global-batch {args.global_batch} does not split into --grad-accum "
            f"{args.grad_accum} micro-batches over data x fsdp x expert = {batch_ways} "
            f"devices: make it a multiple of {batch_ways * args.grad_accum}"
        )
    if tensor > 1 and args.seq_len % tensor:
        raise SystemExit(
            f"--seq-len {args.seq_len} does not split over tensor={tensor}"
        )


def make_optimizer(args) -> optax.GradientTransformation:
    """AdamW, warmup + cosine decay, global-norm clipping; only the kernels decay."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        args.learning_rate,
        args.warmup_steps,
        max(args.total_steps or args.steps, args.warmup_steps + 1),
        end_value=args.learning_rate / 10,
    )

    def decay(params):  # only matmul weights ('kernel'); not 'scale' nor 'embedding'
        return jax.tree_util.tree_map_with_path(
            lambda p, _: "kernel" in jax.tree_util.keystr(p), params
        )

    # Under jit the gradients are sharded arrays, and clip_by_global_norm sums over all
    # of them: the clipping sees the whole model's norm, whatever the mesh.
    return optax.chain(
        optax.clip_by_global_norm(args.clip_norm),
        optax.adamw(
            schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay
        ),
    )


def zigzag(seq_len: int, num_devices: int) -> np.ndarray:
    """Token positions in the order that balances causal attention over a ring of
    devices: cut into 2n chunks, device i takes chunks i and 2n-1-i (early and late
    tokens alike)."""
    chunks = np.arange(seq_len).reshape(2 * num_devices, -1)
    return np.concatenate(
        [chunks[[i, 2 * num_devices - 1 - i]].ravel() for i in range(num_devices)]
    )


def abstract_state(model, tx, mesh, seq_len: int):
    """The train state's shapes and shardings, from tracing init under the rules."""

    def init(rng):  # the weights are the same whatever the attention (one row: xla's)
        params = model.clone(context_parallel=False, attention="xla").init(
            rng, jnp.zeros((1, seq_len), jnp.int32)
        )["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    boxed = jax.eval_shape(init, jax.random.key(0))  # weights carry their logical axes
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
    strip = lambda tree: jax.tree.map(
        lambda x: x.unbox(False) if is_box(x) else x, tree, is_leaf=is_box
    )
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, RULES)
    shapes = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        strip(boxed),
        shardings,
    )
    return shapes, lambda rng: nn.meta.unbox(init(rng))


def without(axis: str, rules=RULES) -> tuple:
    """The rules with one mesh axis taken out: inside a shard_map that makes ``axis``
    manual, layouts may name only the other axes."""
    drop = lambda axes: (
        tuple(a for a in axes if a != axis)
        if isinstance(axes, tuple)
        else (None if axes == axis else axes)
    )
    return tuple((name, drop(axes)) for name, axes in rules)


def micro_batches(tokens_BT: jax.Array, grad_accum: int, batch_axes) -> jax.Array:
    """(B, T) -> (grad_accum, B / grad_accum, T); micro-batch k holds rows k, k + K, ...

    Every K-th row, not K blocks of rows: each device's rows are a contiguous block of
    the batch, so each micro-batch takes B / (K x devices) rows from every device and
    no row moves (a block split would put micro-batch 0 on the first devices alone).
    """
    B, T = tokens_BT.shape  # noqa: N806
    micro_KBT = tokens_BT.reshape(B // grad_accum, grad_accum, T).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(micro_KBT, P(None, batch_axes))


def make_loss(shardings, mesh, dtype=jnp.float32):
    """loss(apply_fn, params, tokens_BT) -> (loss + the experts' losses, loss)."""
    sequence = mesh.shape["sequence"]
    specs = jax.tree.map(lambda s: s.spec, shardings.params)  # the weights' layouts

    def loss(apply_fn, params, tokens_BT):
        inputs_BT, targets_BT = tokens_BT[:, :-1], tokens_BT[:, 1:]
        positions_T = np.arange(inputs_BT.shape[1])
        if sequence > 1:  # zigzag: each device of the ring gets early and late tokens
            positions_T = zigzag(inputs_BT.shape[1], sequence)
            inputs_BT, targets_BT = (
                inputs_BT[:, positions_T],
                targets_BT[:, positions_T],
            )
        # Float32 master weights, cast to the compute type here, on each device's
        # shard: FSDP then gathers bfloat16 weights, half the bytes (as FSDP2's
        # param_dtype does).
        params = jax.tree.map(
            lambda p, spec: jax.lax.with_sharding_constraint(p.astype(dtype), spec),
            params,
            specs,
        )
        logits_BTV, aux_loss = apply_fn({"params": params}, inputs_BT, positions_T)
        loss = model_lib.cross_entropy(logits_BTV, targets_BT)
        return loss + aux_loss, loss  # the experts' losses train the router

    return loss


def make_train_step(shardings, mesh, dtype=jnp.float32, grad_accum: int = 1):
    specs = jax.tree.map(lambda s: s.spec, shardings.params)  # the weights' layouts
    keep_layout = lambda tree: jax.tree.map(
        jax.lax.with_sharding_constraint, tree, specs
    )
    loss_fn = make_loss(shardings, mesh, dtype)

    def loss_and_grads(apply_fn, params, tokens_BT):
        """One micro-batch's mean loss and its gradient."""
        grad_fn = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)
        (_, loss), grads = grad_fn(apply_fn, params, tokens_BT)
        return loss, grads

    def accumulate(apply_fn, params, tokens_BT, batch_axes):
        """The mean loss and gradient over grad_accum micro-batches, one at a time."""

        def add(sum_, micro_BT):
            loss, grads = loss_and_grads(apply_fn, params, micro_BT)
            # The running sum keeps the weights' layout: under FSDP each device holds
            # 1/fsdp of it, so each micro-batch's gradient is reduce-scattered into it
            # (a whole-size sum on every device would undo what FSDP saves).
            return keep_layout(jax.tree.map(jnp.add, sum_, grads)), loss

        zeros = keep_layout(jax.tree.map(jnp.zeros_like, params))
        micro_KBT = micro_batches(tokens_BT, grad_accum, batch_axes)
        sums, losses_K = jax.lax.scan(add, zeros, micro_KBT)
        # Micro-batches of equal size: the mean of their means is the batch's mean.
        return losses_K.mean(), jax.tree.map(lambda g: g / grad_accum, sums)

    def accumulated(apply_fn, params, tokens_BT):
        """accumulate, with the gradients reduced over 'data' once per step, not once
        per micro-batch. The batch is cut into one part per data replica and the step
        vmapped over the parts (spmd_axis_name: the parts lie along 'data'), so each
        replica adds up its own gradient, kept apart from the others' (a leading axis
        split over 'data': no more bytes per device); one sum after the loop reduces
        them. Without the parts, each micro-batch's gradient would be all-reduced."""
        replicas = mesh.shape["data"]
        if replicas == 1:
            return accumulate(apply_fn, params, tokens_BT, BATCH)
        B, T = tokens_BT.shape  # noqa: N806
        parts_RBT = tokens_BT.reshape(replicas, B // replicas, T)
        with nn.logical_axis_rules(without("data")):  # 'data' is the vmapped axis
            losses_R, grads_R = jax.vmap(
                lambda part_BT: accumulate(apply_fn, params, part_BT, BATCH[1:]),
                spmd_axis_name="data",
            )(parts_RBT)
        return losses_R.mean(), jax.tree.map(lambda g: g.mean(0), grads_R)

    def train_step(state, tokens_BT):
        step_grads = loss_and_grads if grad_accum == 1 else accumulated
        loss, grads = step_grads(state.apply_fn, state.params, tokens_BT)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return state.apply_gradients(grads=grads), metrics

    batch = NamedSharding(mesh, P(BATCH))
    return jax.jit(
        train_step,
        in_shardings=(shardings, batch),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )


def make_eval_step(shardings, mesh, dtype=jnp.float32):
    """The held-out loss of a batch: the training loss, without gradients."""
    loss_fn = make_loss(shardings, mesh, dtype)
    return jax.jit(
        lambda state, tokens_BT: loss_fn(state.apply_fn, state.params, tokens_BT)[1],
        in_shardings=(shardings, NamedSharding(mesh, P(BATCH))),
        out_shardings=NamedSharding(mesh, P()),
    )


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes per collective kind in a compiled program, loops times their trip counts.

    All-gather: its output; the others: their operand (here, its output too). On a ring
    of n devices each device sends (n-1)/n of that, or 2(n-1)/n for an all-reduce.
    """
    kinds = (
        "all-gather",
        "reduce-scatter",
        "all-reduce",
        "all-to-all",
        "collective-permute",
    )
    sizes = {
        "f32": 4,
        "bf16": 2,
        "s32": 4,
        "u32": 4,
        "f16": 2,
        "pred": 1,
        "s8": 1,
        "u8": 1,
    }
    own, calls, name = collections.defaultdict(collections.Counter), {}, None
    for line in hlo_text.splitlines():
        if header := re.match(r"(?:ENTRY )?%(\S+) .*\{$", line):
            name = header.group(1)
            calls[name], entry = [], name if line.startswith("ENTRY") else None
            if entry:
                root = name
        elif match := re.match(r"\s*\S+ = (.+?) ([a-z-]+?)(?:-start)?\(", line):
            shape, opcode = match.groups()
            if opcode in kinds:
                own[name][opcode] += sum(
                    sizes[t]
                    * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                    for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape)
                    if t in sizes
                )
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            for callee in re.findall(r"(?:body|calls|to_apply)=%([\w.-]+)", line):
                calls[name].append(
                    (callee, int(trips.group(1)) if trips and opcode == "while" else 1)
                )

    def total(computation: str) -> collections.Counter:
        counts = collections.Counter(own[computation])
        for callee, times in calls.get(computation, []):
            for kind, size in total(callee).items():
                counts[kind] += times * size
        return counts

    return dict(total(root))


def lower_step(step, shapes, args, mesh) -> jax.stages.Lowered:
    """The step lowered for the state's shapes and a global batch of tokens' shapes."""
    tokens = jax.ShapeDtypeStruct(
        (args.global_batch, args.seq_len + 1),
        jnp.int32,
        sharding=NamedSharding(mesh, P(BATCH)),
    )
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        return step.lower(shapes, tokens)


def compile_only(step, shapes, args, mesh) -> None:
    """Compile one step for the requested sizes, allocating nothing; print its costs."""
    start = time.perf_counter()
    compiled = lower_step(step, shapes, args, mesh).compile()
    memory = compiled.memory_analysis()
    arguments, temporaries = memory.argument_size_in_bytes, memory.temp_size_in_bytes
    outputs = (
        memory.output_size_in_bytes - memory.alias_size_in_bytes
    )  # donated: reused
    sent = collective_bytes(compiled.as_text())
    seconds, platform = time.perf_counter() - start, jax.devices()[0].platform
    print(
        f"compiled {args.model} on {dict(mesh.shape)} in {seconds:.1f} s "
        f"({platform}; XLA:CPU's buffer assignment differs from a GPU's)"
    )
    total = arguments + temporaries + outputs
    print(
        f"per device: arguments {arguments / 1e9:.3f} GB, "
        f"temporaries {temporaries / 1e9:.3f} GB, total {total / 1e9:.3f} GB; "
        "collectives "
        + ", ".join(f"{kind} {size} B" for kind, size in sorted(sent.items())),
        flush=True,
    )


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
                with contextlib.suppress(
                    Exception
                ):  # another process may have fired first
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


def process_rows(mesh, global_batch: int, seq_len: int) -> slice:
    """The rows of each global batch that this process's devices hold."""
    sharding = NamedSharding(mesh, P(BATCH))
    index = sharding.addressable_devices_indices_map(
        (global_batch, seq_len + 1)
    ).values()
    starts = [i[0].start or 0 for i in index]
    stops = [global_batch if i[0].stop is None else i[0].stop for i in index]
    return slice(min(starts), max(stops))


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
        batches.set_state(
            {"next_index": step}
        )  # global batch s is the same on any layout
        return restored.state, batches


def prepare_data(args, vocab_size: int) -> list[data.TokenRecords]:
    """Process 0 tokenizes the default corpus and checks the files first; the others
    then open them, or (on a node with its own disk) tokenize their own copy."""
    where = (args.data_dir, args.seq_len, vocab_size, args.data, args.data_dtype)
    if jax.process_index() == 0:
        data.prepare(*where)
    multihost_utils.sync_global_devices("data prepared")
    return data.sources(*where)


def make_evaluation(args, mesh, shapes, rows: slice, source: data.TokenRecords):
    """--eval-every: state -> the mean loss over --eval-batches held-out batches,
    placed on the devices once; None without --eval-every."""
    if not args.eval_every:
        return None
    shardings = jax.tree.map(lambda s: s.sharding, shapes)
    eval_step = make_eval_step(shardings, mesh, jnp.dtype(args.dtype))
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

    return evaluate


class MetricsLog:
    """Each step's numbers, on process 0: a line on the terminal, and with --log-dir a
    JSON-lines file (metrics.jsonl) and TensorBoard's event files (tensorboardX)."""

    def __init__(self, log_dir: str | None):
        self.on = jax.process_index() == 0
        self.file = self.board = None
        if self.on and log_dir:
            from tensorboardX import SummaryWriter

            os.makedirs(log_dir, exist_ok=True)
            self.file = open(os.path.join(log_dir, "metrics.jsonl"), "a")  # noqa: SIM115
            self.board = SummaryWriter(log_dir)

    def write(self, step: int, line: str, values: dict[str, float]) -> None:
        if not self.on:
            return
        print(line, flush=True)
        if self.file:
            self.file.write(json.dumps({"step": step, **values}) + "\n")
            self.file.flush()
            for name, value in values.items():
                self.board.add_scalar(name, value, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.board.close()


def train(args, mesh, model, tx, step, shapes, init) -> None:
    print0 = print if jax.process_index() == 0 else lambda *a, **k: None
    sources = prepare_data(args, model.config.vocab_size)
    rows = process_rows(mesh, args.global_batch, args.seq_len)
    # --eval-every: the first source's last batches are held out from training.
    held_out = args.eval_batches if args.eval_every else 0
    batches = data.batches(
        sources, args.global_batch, rows, args.seed, args.data_weights, held_out
    )
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        state = jax.jit(init, out_shardings=jax.tree.map(lambda s: s.sharding, shapes))(
            jax.random.key(args.seed)
        )  # born sharded
    manager = checkpoint_manager(args) if args.checkpoint_dir else None
    if manager and manager.latest_step() is not None:
        state, batches = restore(manager, shapes, batches)
        print0(f"resumed from step {int(state.step)} in {args.checkpoint_dir}")
    tokens_per_step = args.global_batch * args.seq_len
    flops = model_lib.flops_per_token(model.config, args.seq_len) * tokens_per_step
    peak = PEAK_FLOPS.get(jax.devices()[0].device_kind)  # None: no MFU (a CPU)
    preemption, batch_sharding = Preemption(mesh), NamedSharding(mesh, P(BATCH))
    deadline = StepDeadline(args.step_timeout) if args.step_timeout else None
    log = MetricsLog(args.log_dir)
    evaluate = make_evaluation(args, mesh, shapes, rows, sources[0])
    first = int(state.step)  # the one read of the step from the device
    pending, clock = None, time.perf_counter()

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
        if args.profile and now in (6, 9):  # trace steps 6 to 8, one trace per process
            if now == 6:
                jax.profiler.start_trace(
                    os.path.join(args.profile, f"process_{jax.process_index()}")
                )
            else:
                jax.profiler.stop_trace()
        with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
            state, metrics = step(state, tokens)  # queued: the device runs it
        # Step now - 1's numbers, while step now runs: no wait between steps.
        stop = pending is not None and report(*pending)
        pending = (now, metrics, preemption.vote())
        evaluating = evaluate and (now % args.eval_every == 0 or now == args.steps)
        if evaluating or stop:  # step now's numbers first (all processes alike)
            stop = report(*pending) or stop
            pending = None
        if manager and (now % args.checkpoint_every == 0 or stop or now == args.steps):
            manager.save(
                now,
                force=True,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=grain.checkpoint.CheckpointSave(batches),
                ),
            )
        if evaluating:
            loss = evaluate(state)
            log.write(now, f"eval {now} loss {loss:.4f}", {"eval_loss": loss})
            clock = time.perf_counter()  # the next step's time leaves evaluation out
        if stop:
            print0(f"{preemption.reason()}: saved step {now}, exiting", flush=True)
            break
    if pending:
        report(*pending)
    if deadline:
        deadline.step = None  # stop watching: no more steps
    if manager:
        manager.wait_until_finished()  # the last save is asynchronous
        manager.close()
    log.close()


def attention_kind(requested: str | None) -> str:
    """--attention, or its default for the devices there are: cuDNN's kernel on NVIDIA
    GPUs, chunked blocks elsewhere."""
    platform = jax.devices()[0].platform
    if requested == "cudnn" and platform != "gpu":
        raise SystemExit(
            f"--attention cudnn needs an NVIDIA GPU; this machine has {platform} "
            "devices: use --attention chunked or xla"
        )
    return requested or ("cudnn" if platform == "gpu" else "chunked")


def setup(args):
    """The mesh, the model, the optimizer, the jitted step and the state's shapes."""
    mesh = make_mesh(args.mesh)
    config = model_config(args)
    check_fits(config, mesh, args)
    model = model_lib.Transformer(
        config,
        jnp.dtype(args.dtype),
        args.remat,
        context_parallel=mesh.shape["sequence"] > 1,
        attention=attention_kind(args.attention),
    )
    tx = make_optimizer(args)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        shapes, init = abstract_state(model, tx, mesh, args.seq_len)
    step = make_train_step(
        jax.tree.map(lambda s: s.sharding, shapes),
        mesh,
        jnp.dtype(args.dtype),
        args.grad_accum,
    )
    return mesh, model, tx, step, shapes, init


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.num_devices:
        jax.config.update("jax_num_cpu_devices", args.num_devices)
    jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
    join_processes()
    mesh, model, tx, step, shapes, init = setup(args)
    if args.compile_only:
        return compile_only(step, shapes, args, mesh)
    train(args, mesh, model, tx, step, shapes, init)


if __name__ == "__main__":
    main()
