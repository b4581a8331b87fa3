"""The collectives of the program XLA:CPU compiles from the recipe (JAX 0.10.2), per device and
step: every one moves float32, even under ``--dtype bfloat16``, and all-reduces stand where a
GPU reduce-scatters. The counts per layer were read from compiled programs, and
``benchmarks/plan_check.py`` checks them on 35 layouts; ``--check`` compares against them and
``--bytes xla-cpu`` prices them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jaxdist_lessons.planning.footprint import F32
from jaxdist_lessons.planning.layouts import Layout, Run
from jaxdist_lessons.planning.shapes import attention_weights, mlp_weights
from jaxdist_lessons.strategies import NAMES
from jaxdist_lessons.traffic import Transfer
from jaxdist_lm.model_config import count_params


def collective(
    kind: str, nbytes: float, c: Layout, *axes: str, what: str = "", calls: int = 1
) -> list[Transfer]:
    """``calls`` collectives over ``axes`` carrying ``nbytes`` between them (an empty list
    if those axes have one device)."""
    group = math.prod(c.size(a) for a in axes)
    if group == 1 or not nbytes:
        return []
    return [Transfer(kind, nbytes, group, what, axes, calls)]


def weight_transfers(run: Run, c: Layout) -> list[Transfer]:
    """FSDP's weight gathers and the gradients' all-reduces, as XLA:CPU compiles the recipe.

    Measured: each layer weight gathered twice (forward, and remat's recomputation for the
    backward), the attention's output projection a third time under tensor parallelism, the
    norms three times; the output projection once, twice under tensor parallelism (a tied
    table too, as the output projection); the embedding table never for its lookup (which
    moves activations instead). Gradients: one all-reduce over fsdp
    of all but the embedding's (no reduce-scatter on XLA:CPU), then one over each other batch
    axis (data, sequence, expert) of the fsdp-split gradients; data parallelism alone: all of
    them and the loss.
    """
    m, f, t, e = run.shape, c.size("fsdp"), c.size("tensor"), c.size("expert")
    layers, D, V = m.num_layers, m.width, m.vocab_size
    layer = attention_weights(m) + mlp_weights(m) / e
    out_projection = layers * m.num_heads * m.head_width * D
    norms = layers * 2 * D
    # untied, or the tied table as the output projection: the same moves
    unembed = V * D
    params = count_params(m)
    out = []
    if c.strategy in (NAMES["data"], NAMES["zero1"]) or f == 1:
        return collective("all-reduce", F32 * params + 4, c, "data", what="gradients")
    gathered = (
        2 * layers * layer / t
        + (out_projection / t if t > 1 else 0)
        + 3 * norms
        + 2 * D
    )
    gathered += unembed * (2 if t > 1 else 1) / t
    out += collective("all-gather", F32 * gathered, c, "fsdp", what="weights (FSDP)")
    reduced = layers * layer / t + norms + unembed / t
    if m.num_experts and c.dispatch == "dropless":  # dropless.gathered's float32 sums
        experts = layers * 3 * m.num_experts * D * m.mlp_width / (e * t)
        reduced -= experts
        out += collective(
            "reduce-scatter",
            F32 * experts / f,
            c,
            "fsdp",
            what="experts' gradients (FSDP)",
        )
    out += collective("all-reduce", F32 * reduced, c, "fsdp", what="gradients (FSDP)")
    rest = params - V * D  # the embedding table's gradient: embedding_transfers
    for axis in ("data", "sequence"):
        out += collective(
            "all-reduce", F32 * rest / f, c, axis, what=f"gradients over {axis}"
        )
    # not the experts' own
    shared = rest - layers * (mlp_weights(m) - D * m.num_experts)
    out += collective(
        "all-reduce", F32 * shared / f, c, "expert", what="gradients of shared weights"
    )
    return out


def lookup_moves(run: Run, c: Layout) -> list[Transfer]:
    """The embedding lookup with the table left split: the tokens' activations move to the
    table's fsdp shards and back, and its gradient is reduced over the other batch axes. With
    batch replicas (data or expert), the recipe's "rows" lookup (jaxdist_lm/layout.py's
    ``lookup``): its output laid out as the table first, an all-to-all each way."""
    m, f, s, e, d, t = (
        run.shape,
        c.size("fsdp"),
        c.size("sequence"),
        c.size("expert"),
        c.size("data"),
        c.size("tensor"),
    )
    B, T, D = run.global_batch, run.seq_len, m.width
    rows, table, everything = B // c.batch_ways, F32 * m.vocab_size * D, F32 * B * T * D
    out = [
        t_
        for axis in ("data", "sequence", "expert")
        for t_ in collective(
            "all-reduce", table / f, c, axis, what="embedding gradient"
        )
    ]
    if d > 1:  # HSDP: to the table's layout and back, forward and backward
        return out + collective(
            "all-to-all", 2 * everything / (d * f), c, "fsdp", what="embeddings"
        )
    if e > 1:
        out += collective(
            "all-to-all", 2 * everything / (f * e), c, "fsdp", what="embeddings"
        )
        return out + collective(
            "collective-permute", 2 * F32 * rows * T * D, c, "expert", what="embeddings"
        )
    out += collective("all-to-all", everything / f, c, "fsdp", what="embeddings")
    out += collective(
        "all-to-all", everything / (f * s * t), c, "fsdp", what="embeddings"
    )
    out += collective(
        "all-to-all", everything / (f * t), c, "tensor", what="embeddings"
    )
    if s == 2 and f > 2:  # measured; with f = 2, the swaps below instead
        out += collective(
            "all-to-all", everything / (f * s), c, "sequence", what="zigzag order"
        )
    if s == 2 and f == 2:  # measured: the zigzag order by swaps between the two
        swap = F32 * (rows * T // s * D + B * T * D // f)
        out += collective(
            "collective-permute", swap, c, "sequence", what="zigzag order"
        )
    return out + collective(
        "all-gather",
        everything / f + F32 * rows * T * D,
        c,
        "sequence",
        what="embeddings",
    )


def table_moves(run: Run, c: Layout) -> list[Transfer]:
    """The embedding lookup in a gathered table: the table gathered over fsdp and its gradient
    all-reduced whole (with batch replicas, the recipe's "table" lookup)."""
    m, f, d = run.shape, c.size("fsdp"), c.size("data")
    table = F32 * m.vocab_size * m.width
    out = collective("all-gather", table, c, "fsdp", what="embedding table")
    if d > 1:
        return out + collective(
            "all-reduce", table, c, "data", "fsdp", what="embedding gradient"
        )
    if c.size("expert") > 1:
        return out + collective(
            "all-reduce", table, c, "fsdp", "expert", what="embedding gradient"
        )
    out += collective("all-reduce", table, c, "fsdp", what="embedding gradient")
    return out + collective(
        "all-reduce", 2 * table / f, c, "sequence", what="embedding gradient"
    )


def gathers_the_table(run: Run, c: Layout) -> bool:
    """Whether the embedding table is gathered for the lookup (``table_moves``) rather than
    activations moved (``lookup_moves``). With batch replicas the recipe chooses
    (jaxdist_lm/layout.py's ``lookup``): with a data axis, the table when each device has at
    least as many tokens as the table has rows; with an expert axis, when an fsdp group's
    share of a step's tokens is. Elsewhere XLA:CPU chooses, as read from compiled programs on
    both sides of each boundary (tiny, 125m, 8b): with fsdp and sequence axes, the table when
    it moves fewer bytes; with a tensor axis, never seen."""
    tokens, vocab = run.global_batch * run.seq_len, run.shape.vocab_size
    if c.size("tensor") > 1:
        return False
    if c.size("data") > 1:
        return tokens / c.batch_ways >= vocab
    if c.size("expert") > 1:
        return tokens / c.size("fsdp") >= vocab
    cost = lambda moves: sum(move.bytes for move in moves)
    return cost(table_moves(run, c)) < cost(lookup_moves(run, c))


def embedding_transfers(run: Run, c: Layout) -> list[Transfer]:
    """The embedding lookup and its gradient under FSDP (the table split over fsdp, not over
    the batch), in whichever of its two ways XLA:CPU compiles it (``gathers_the_table``)."""
    if c.size("fsdp") == 1:  # data parallelism: the table is whole on every device
        return []
    return table_moves(run, c) if gathers_the_table(run, c) else lookup_moves(run, c)


def activation_transfers(run: Run, c: Layout) -> list[Transfer]:
    """What moves activations inside the layers: Megatron's sequence-parallel activations,
    ring attention's K and V, the experts' router logits, dispatch and combine. Counts per
    layer read from XLA:CPU's programs."""
    m, t, s, e = run.shape, c.size("tensor"), c.size("sequence"), c.size("expert")
    B, T, D, layers = run.global_batch, run.seq_len, m.width, m.num_layers
    rows = B // c.batch_ways
    out = []
    # XLA:CPU all-reduces where Megatron's sequence parallelism reduce-scatters
    if t > 1:
        act = F32 * rows * T * D
        out += collective(
            "all-gather", act * (6 * layers + 2), c, "tensor", what="activations (SP)"
        )
        out += collective(
            "all-reduce", act * (8 * layers + 1), c, "tensor", what="activations (SP)"
        )
    if s > 1:
        kv = F32 * rows * (T // s) * m.num_kv_heads * m.head_width
        out += collective(
            "collective-permute",
            layers * 3 * (s - 1) * 2 * kv,
            c,
            "sequence",
            what="K and V around the ring",
        )
    if m.num_experts and e > 1:
        # gathered forward and for the backward
        logits = F32 * 2 * layers * B * T * m.num_experts
        out += collective(
            "all-gather", logits, c, "fsdp", "expert", what="router logits"
        )
        if c.dispatch == "dropless":  # dropless.padded_experts: worst-case buffers
            pairs = rows * T * m.top_k
            # forward, remat, backward: 2 each
            tokens = layers * 6 * e * pairs * D * F32
            ids = layers * 2 * e * pairs * 4  # int32 expert ids, forward and remat
            return out + collective(
                "all-to-all",
                tokens + ids,
                c,
                "expert",
                what="pairs to experts and back (worst case)",
            )
        group = min(m.group_size, T)
        slots = math.ceil(m.top_k * group * m.capacity_factor / m.num_experts)
        buffer = F32 * m.num_experts * rows * (T // group) * slots * D
        out += collective(
            "all-to-all",
            layers * 3 * 2 * buffer,
            c,
            "expert",
            what="tokens to experts and back",
        )
    return out


def stage_parts(run: Run, c: Layout, itemsize: int) -> tuple[Transfer, Run, Layout]:
    """A pipeline's sends between stages (every micro-batch's activations forward and
    their gradient back, once per virtual stage, ``itemsize`` bytes a value), and one
    stage's run and layout (FSDP inside the stage)."""
    m = run.shape
    rows = run.global_batch // c.batch_ways
    act = itemsize * rows * run.seq_len * m.width  # every micro-batch's
    sends = Transfer(
        "collective-permute", 2 * c.virtual * act, None, "stage to stage", ("pipeline",)
    )
    stage = dataclasses.replace(m, num_layers=m.num_layers // c.stages)
    per_stage = dataclasses.replace(run, shape=stage, devices=run.devices // c.stages)
    return sends, per_stage, dataclasses.replace(c, stages=1, strategy=NAMES["fsdp"])


def pipeline_transfers(run: Run, c: Layout) -> list[Transfer]:
    """A pipeline's sends between stages (bf16 activations) and FSDP inside each stage:
    predicted, no recipe flag."""
    sends, per_stage, inside = stage_parts(run, c, 2)
    return [sends, *weight_transfers(per_stage, inside)]


def transfers(run: Run, c: Layout) -> list[Transfer]:
    """Every collective of one step on one device."""
    if c.stages > 1:
        return pipeline_transfers(run, c)
    # gradients' shards, then the updated weights gathered
    if c.strategy.startswith("ZeRO"):
        n, params = run.devices, count_params(run.shape)
        return [
            Transfer("reduce-scatter", F32 * params / n, n, "gradients", ("data",)),
            Transfer("all-gather", F32 * params, n, "weights", ("data",)),
        ]
    return (
        weight_transfers(run, c)
        + embedding_transfers(run, c)
        + activation_transfers(run, c)
    )


def transfer_bytes_by_kind(moves: Sequence[Transfer]) -> dict[str, float]:
    """Bytes per collective kind, counted as ``compiled.collective_bytes`` (jaxdist_lm/compiled.py) counts them."""
    out: dict[str, float] = {}
    for move in moves:
        out[move.kind] = out.get(move.kind, 0) + move.bytes
    return out
