"""Where each array lives: the mesh's axes, the rules from logical axis names to mesh
axes, the checks that a model, a batch and a sequence split over a mesh, and the token
order of ring attention. train.py and the other modules read their layouts here.
"""

import jax
import mesh_spec
import model_config
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_spec import AXES

BATCH = ("data", "fsdp", "expert")  # the mesh axes that split the batch rows

# Logical axis -> mesh axis. Weights: FSDP splits the model width; tensor parallelism
# splits heads, MLP width and vocabulary (Megatron's column/row split); 'expert' splits
# the experts. Activations: the batch over data, fsdp and expert (experts aside,
# 'expert' is one more data axis); the sequence over 'sequence' (context parallelism)
# and, between blocks, over 'tensor' too (Megatron's sequence parallelism); routed
# tokens by expert, not by row; the embedding lookup's output by the batch's replicas.
RULES = (
    ("batch", BATCH),
    ("expert_batch", ("data", "fsdp")),
    ("lookup_batch", ("pipeline", "data", "expert")),
    ("layers", "pipeline"),
    ("embed", "fsdp"),
    ("experts", "expert"),
    ("act_experts", "expert"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("act_seq", "sequence"),
    ("act_seq_residual", ("sequence", "tensor")),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


def make_mesh(spec: str) -> jax.sharding.Mesh:
    """'data=2,tensor=2' -> a mesh over all of AXES; one size may be -1, the rest 1."""
    try:
        sizes = mesh_spec.parse(spec, jax.device_count())
    except ValueError as error:
        raise SystemExit(str(error)) from None
    shape = tuple(sizes[a] for a in AXES)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def check_fits(config: model_config.ModelConfig, mesh, args) -> None:
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
    stages = mesh.shape["pipeline"]
    virtual = args.virtual_stages if args.schedule == "interleaved" else 1
    if args.virtual_stages != 1 and (stages == 1 or args.schedule != "interleaved"):
        raise SystemExit(
            f"--virtual-stages {args.virtual_stages} needs a pipeline axis and "
            "--schedule interleaved"
        )
    if virtual < 1:
        raise SystemExit(f"--virtual-stages {virtual} must be 1 or more")
    if config.num_layers % (stages * virtual):
        cut = f"{stages} stages" if virtual == 1 else f"{stages} x {virtual} stages"
        raise SystemExit(
            f"pipeline={stages}: the model's {config.num_layers} layers do not split "
            f"into {cut} of equal depth"
        )
    if stages > 1 and args.grad_accum < stages:
        raise SystemExit(
            f"pipeline={stages} needs at least {stages} micro-batches: set "
            f"--grad-accum to {stages} or more (more micro-batches, a smaller bubble)"
        )
    if stages > 1 and args.schedule == "interleaved" and args.grad_accum % stages:
        raise SystemExit(
            f"--schedule interleaved runs micro-batches in groups of pipeline="
            f"{stages}: set --grad-accum to a multiple of {stages}"
        )
    if "activations" in args.offload and (args.remat != "full" or stages > 1):
        raise SystemExit(
            "--offload activations moves the one input a layer keeps under full remat "
            "to host memory: it needs --remat full and no pipeline axis (a "
            "pipeline keeps its stage inputs itself)"
        )
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


def lookup(config: model_config.ModelConfig, mesh, args) -> str:
    """How the model looks its tokens up (its ``lookup``). Without batch replicas
    ('data' or 'expert'), or with nothing else, as XLA likes ("xla"): its partitioner
    needs no help there.
    With them, "rows" (the activations move to the table's shards and back) unless the
    table moves fewer bytes: with 'data', when each device has at least as many tokens
    as the table has rows; with 'expert', when an fsdp group's share of a step's tokens
    is (read from compiled programs of 1 to 8B models). With the vocabulary split over
    'tensor', "rows" always."""
    data, expert, fsdp = mesh.shape["data"], mesh.shape["expert"], mesh.shape["fsdp"]
    data *= mesh.shape["pipeline"]  # the stages, too, each look up the whole batch
    if data * expert == 1 or fsdp * mesh.shape["sequence"] * mesh.shape["tensor"] == 1:
        return "xla"  # no replicas, or nothing but replicas: each device looks up alone
    tokens = args.global_batch * args.seq_len
    if data > 1:
        table = tokens / (data * fsdp * expert) >= config.vocab_size
    else:
        table = tokens / fsdp >= config.vocab_size
    return "table" if table and mesh.shape["tensor"] == 1 else "rows"


def without(axis: str, rules=RULES) -> tuple:
    """The rules with one mesh axis taken out: inside a shard_map that makes ``axis``
    manual, layouts may name only the other axes."""
    drop = lambda axes: (
        tuple(a for a in axes if a != axis)
        if isinstance(axes, tuple)
        else (None if axes == axis else axes)
    )
    return tuple((name, drop(axes)) for name, axes in rules)


def zigzag(seq_len: int, num_devices: int) -> np.ndarray:
    """Token positions in the order that balances causal attention over a ring of
    devices: cut into 2n chunks, device i takes chunks i and 2n-1-i (early and late
    tokens alike)."""
    if seq_len % (2 * num_devices):
        raise ValueError(
            f"sequence length {seq_len} must divide into 2 x {num_devices} chunks"
        )
    chunks = np.arange(seq_len).reshape(2 * num_devices, -1)
    return np.concatenate(
        [chunks[[i, 2 * num_devices - 1 - i]].ravel() for i in range(num_devices)]
    )


def process_rows(mesh, global_batch: int, seq_len: int) -> slice:
    """The rows of each global batch that this process's devices hold."""
    sharding = NamedSharding(mesh, P(BATCH))
    index = sharding.addressable_devices_indices_map(
        (global_batch, seq_len + 1)
    ).values()
    starts = [i[0].start or 0 for i in index]
    stops = [global_batch if i[0].stop is None else i[0].stop for i in index]
    rows = slice(min(starts), max(stops))
    block = rows.stop - rows.start
    if global_batch % block or rows.start % block:  # processes would share rows
        per_process = jax.local_device_count()
        spec = ",".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1)
        raise SystemExit(
            f"--mesh {spec}: a batch row's devices span several processes "
            f"({per_process} devices each); make the axes after the batch axes "
            f"(sequence x tensor) divide {per_process}"
        )
    return rows
