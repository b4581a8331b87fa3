"""A Llama-style decoder in Flax NNX; each weight and activation names its axes.

RMSNorm, RoPE, grouped-query attention (kernels in attention.py and splash.py), a
SwiGLU MLP (layers.py) or experts (experts.py), and a scan over the layers with a remat
policy. layout.py's rules map the axes' names ("embed", "heads", ...) to mesh axes.

Shape suffixes (one letter per axis; lowercase in einsum subscripts), the book's legend
for the letters used here:

    B  batch (examples in a batch)
    T  tokens: positions in a sequence; also a batch's tokens flattened, or a routing
       group's tokens
    S  key/value positions in attention, where they differ from the queries' T
    D  model width (embedding width)
    N  attention (query) heads
    K  key/value heads (grouped-query attention; K = N without it)
    Q  query heads that share one key/value head (N = K * Q)
    A  width of one attention head
    F  MLP hidden width
    V  vocabulary
    E  experts
    M  slots per expert (its capacity)
    R  a token's routes: its top-k expert choices
    G  routing groups (tokens routed together)
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from . import splash
from .attention import (
    ATTENTIONS,
    BLOCK,
    chunked_attention,
    cudnn_attention,
    document_mask,
    manual_axes,
    placed,
    ring_attention,
)
from .experts import Experts
from .layers import MLP, by_axes, constrain, dense, weight
from .model_config import ModelConfig, RopeScaling

REMAT_POLICIES = {
    # keep every activation for the backward pass
    "none": None,
    # keep each layer's input only
    "full": jax.checkpoint_policies.nothing_saveable,
    # keep the matmuls' outputs
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
# --offload activations: full remat, with each layer's input (the one activation that
# full remat keeps) moved to the host's pinned memory in the forward pass and back for
# the backward (JAX's memory kinds, the policy of the JAX docs' "Gradient
# checkpointing" page). Block names its input LAYER_INPUT for it.
LAYER_INPUT = "layer_input"
OFFLOADED = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=[LAYER_INPUT],
    offload_src="device",
    offload_dst="pinned_host",
)


class RMSNorm(nnx.Module):
    """Each row divided by its root mean square, times a learned scale per feature; the
    statistics in float32, whatever the compute type."""

    def __init__(self, width: int, eps: float, dtype: jnp.dtype):
        self.eps, self.dtype = eps, dtype
        self.scale = nnx.Param(
            jnp.ones((width,), jnp.float32),
            out_sharding=("embed",),
            eager_sharding=False,
        )

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        x = x_BTD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...]).astype(self.dtype)


def rope_frequencies(
    half: int, theta: float, scaling: RopeScaling | None = None
) -> jax.Array:
    """Angle per position of each feature pair: theta^(-i/half), i < half; with Llama
    3.1's scaling, as Hugging Face's _compute_llama3_parameters computes it
    (transformers/modeling_rope_utils.py; Meta's apply_scaling in llama-models)."""
    frequencies = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None:
        return frequencies
    s = scaling
    wavelengths = 2 * math.pi / frequencies
    # 0 at the long wavelength's bound (divided by factor), 1 at the short one (kept)
    blend = (s.original_context / wavelengths - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - blend) * frequencies / s.factor + blend * frequencies
    long = wavelengths > s.original_context / s.low_freq_factor
    short = wavelengths < s.original_context / s.high_freq_factor
    scaled = jnp.where(long, frequencies / s.factor, blended)
    return jnp.where(short, frequencies, scaled)


def rope(
    x_BTNA: jax.Array,
    positions: jax.Array,
    theta: float,
    scaling: RopeScaling | None = None,
) -> jax.Array:
    """Rotate each pair of features by an angle proportional to the token's position:
    ``positions`` per column (T) or, where each row's documents restart, per row (B, T).
    """
    half = x_BTNA.shape[-1] // 2
    frequencies = rope_frequencies(half, theta, scaling)
    # (T, A/2), or (B, T, A/2) with per-row positions
    angles = positions[..., None].astype(jnp.float32) * frequencies
    sin, cos = jnp.sin(angles)[..., None, :], jnp.cos(angles)[..., None, :]
    # A pair is features i and i + A/2, the head's two halves, as in Hugging Face's
    # rotate_half. Meta's code pairs neighbours (2i, 2i + 1), which Hugging Face's
    # checkpoints undo by permuting q's and k's rows (convert.py says more).
    first, second = jnp.split(x_BTNA.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate(
        [first * cos - second * sin, second * cos + first * sin], -1
    )
    return rotated.astype(x_BTNA.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with RoPE, by one of ATTENTIONS' kernels; with
    ``context_parallel``, ring attention over the 'sequence' mesh axis."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: jnp.dtype,
        context_parallel: bool = False,
        attention: str = "xla",
        *,
        rngs: nnx.Rngs,
    ):
        c, self.config, self.dtype = config, config, dtype
        self.context_parallel, self.attention = context_parallel, attention
        D, N, K, A = c.width, c.num_heads, c.num_kv_heads, c.head_width
        # Column-parallel: each 'tensor' device computes its own heads, whole.
        self.query = weight(rngs, (D, N, A), ("embed", "heads", "head_dim"), D)
        self.k = weight(rngs, (D, K, A), ("embed", "kv_heads", "head_dim"), D)
        self.v = weight(rngs, (D, K, A), ("embed", "kv_heads", "head_dim"), D)
        # Row-parallel: each device's heads give a partial sum, which the layout after
        # the block reduces (an all-reduce, or under sequence parallelism a
        # reduce-scatter).
        self.out = weight(rngs, (N, A, D), ("heads", "head_dim", "embed"), N * A)

    def __call__(
        self, x_BTD: jax.Array, positions_T: jax.Array, starts_BT: jax.Array | None
    ) -> jax.Array:
        c = self.config
        w_DNA, w_DKA, w_DKA_v, w_NAD = (
            w[...].astype(self.dtype) for w in (self.query, self.k, self.v, self.out)
        )
        # RoPE counts from each document's start, if documents are masked
        rope_positions = positions_T if starts_BT is None else positions_T - starts_BT
        q_BTNA = rope(
            jnp.einsum("btd,dna->btna", x_BTD, w_DNA),
            rope_positions,
            c.rope_theta,
            c.rope_scaling,
        )
        k_BTKA = rope(
            jnp.einsum("btd,dka->btka", x_BTD, w_DKA),
            rope_positions,
            c.rope_theta,
            c.rope_scaling,
        )
        v_BTKA = jnp.einsum("btd,dka->btka", x_BTD, w_DKA_v)
        q_BTNA = constrain(q_BTNA, ("batch", "act_seq", "act_heads", None))
        k_BTKA = constrain(k_BTKA, ("batch", "act_seq", "act_kv_heads", None))
        v_BTKA = constrain(v_BTKA, ("batch", "act_seq", "act_kv_heads", None))
        # Document starts, if any: per row, whole along the sequence on each device
        documents = () if starts_BT is None else (starts_BT,)
        # Ring attention's blocks stay chunked, not splash: in the zigzag order a block
        # pair's causal mask is not a static lower triangle, and merging the parts needs
        # each part's log-sum-exp and its gradient: the kernel's backward takes the
        # output's gradient alone. Each device computes its tokens, its heads and its
        # batch rows.
        if self.context_parallel:
            spec = nn.logical_to_mesh_axes(("batch", "act_seq", "act_heads", None))
            row_spec = nn.logical_to_mesh_axes(("batch", None))
            ring = jax.shard_map(
                ring_attention,
                in_specs=(spec, spec, spec, P(), *(row_spec for _ in documents)),
                out_specs=spec,
                axis_names=manual_axes(spec, row_spec),
                check_vma=False,
            )
            out_BTNA = ring(q_BTNA, k_BTKA, v_BTKA, positions_T, *documents)
        elif self.attention == "chunked":
            # Blocks of an online softmax; the mask compares positions.
            chunked = lambda q, k, v, at, *starts: chunked_attention(
                q, k, v, at, at, BLOCK, *starts, *starts
            )
            out_BTNA = placed(chunked)(q_BTNA, k_BTKA, v_BTKA, positions_T, *documents)
        elif self.attention == "cudnn":
            # Positions in order: the causal mask is the lower triangle.
            out_BTNA = placed(cudnn_attention, kernel=True)(
                q_BTNA, k_BTKA, v_BTKA, *documents
            )
        elif self.attention == "splash":
            # Positions in order: the causal mask is the lower triangle.
            attend = placed(splash.splash_attention, kernel=True)
            out_BTNA = attend(q_BTNA, k_BTKA, v_BTKA, *documents)
        elif self.attention == "xla":
            # Positions in order; the T x S scores are in float32.
            out_BTNA = jax.nn.dot_product_attention(
                q_BTNA, k_BTKA, v_BTKA, mask=document_mask(starts_BT), is_causal=True
            )
        else:
            raise ValueError(f"attention {self.attention!r}: expected {ATTENTIONS}")
        out_BTNA = constrain(out_BTNA, ("batch", "act_seq", "act_heads", None))
        return jnp.einsum("btna,nad->btd", out_BTNA, w_NAD)


# Between blocks the residual stream is split over the batch and, where the rules map
# "act_seq_residual" to 'tensor', over the sequence too (Megatron's sequence
# parallelism: the norms work on T/tensor tokens, and the all-reduces become all-gathers
# and reduce-scatters).
RESIDUAL = ("batch", "act_seq_residual", "act_embed")
WHOLE = ("batch", "act_seq", "act_embed")
# The embedding lookup's output as the table lies: the rows over the batch's replicas
# ("lookup_batch": 'pipeline', 'data' and 'expert'), the width as the table splits it
# ("embed").
LOOKUP = ("lookup_batch", None, "embed")
LOOKUPS = ("xla", "rows", "table")


class Block(nnx.Module):
    """One layer: attention, then the MLP or the experts, each after an RMSNorm and
    added to the residual stream."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: jnp.dtype,
        context_parallel: bool = False,
        attention: str = "xla",
        *,
        rngs: nnx.Rngs,
    ):
        c = config
        self.attention_norm = RMSNorm(c.width, c.norm_eps, dtype)
        self.attention = Attention(c, dtype, context_parallel, attention, rngs=rngs)
        self.mlp_norm = RMSNorm(c.width, c.norm_eps, dtype)
        if c.num_experts:
            self.experts = Experts(c, dtype, rngs=rngs)
        else:
            self.mlp = MLP(c, dtype, rngs=rngs)

    def __call__(
        self, x_BTD: jax.Array, positions_T: jax.Array, starts_BT: jax.Array | None
    ) -> tuple[jax.Array, jax.Array]:
        # the name OFFLOADED sends to the host
        x_BTD = checkpoint_name(x_BTD, LAYER_INPUT)
        # Each block's input is gathered whole along the sequence (an all-gather where
        # the residual is split over 'tensor'), then split by heads or MLP columns.
        h = constrain(self.attention_norm(x_BTD), WHOLE)
        x_BTD = constrain(x_BTD + self.attention(h, positions_T, starts_BT), RESIDUAL)
        h = constrain(self.mlp_norm(x_BTD), WHOLE)
        if hasattr(self, "experts"):
            y_BTD, aux_loss = self.experts(h)
        else:
            y_BTD, aux_loss = self.mlp(h), jnp.zeros(())
        # jax.lax.scan's (carry, output)
        return constrain(x_BTD + y_BTD, RESIDUAL), aux_loss


def embedding_stddev(config: ModelConfig) -> float:
    """The embedding table's initial standard deviation."""
    # Untied, 1: the table only feeds the first RMSNorm, which rescales it. Tied, it is
    # also the output projection: N(0, 1) would give logits of standard deviation
    # sqrt(D), 45 at D = 2048, and a first loss of hundreds of nats, not ln V.
    # 1/sqrt(D) gives logits of unit size: 0.022 at Llama 3.2 1B's width, close to its
    # config.json's "initializer_range": 0.02.
    return config.width**-0.5 if config.tie_embeddings else 1.0


class Transformer(nnx.Module):
    """Token ids -> (logits, the experts' auxiliary loss over all layers; 0 if dense),
    given the columns' ``positions_T`` (the zigzag's) and the documents' ``starts_BT``.

    The settings after ``config`` say how it computes, not what it holds:

    - ``dtype``: the compute type; the weights stay float32.
    - ``remat``: one of REMAT_POLICIES; with ``offload_activations`` ("full" only),
      each layer's input kept in the host's memory (OFFLOADED).
    - ``scan_unroll``: layers per loop iteration; num_layers leaves no loop (XLA's
      cost_analysis counts a loop's body once, whatever its trip count).
    - ``context_parallel``: ring attention over the 'sequence' mesh axis.
    - ``attention``: "xla", jax.nn.dot_product_attention's reference (the T x S
      scores in float32); "cudnn", cuDNN's fused kernel (NVIDIA GPUs, bfloat16);
      "splash", JAX's Pallas kernel for TPUs (splash.py); "chunked", blocks of an
      online softmax in plain JAX, memory linear in the sequence.
    - ``lookup``: the embedding lookup, one of LOOKUPS (mesh_spec.lookup says which).
      On a mesh whose batch has replicas ('data' or 'expert'), left to XLA ("xla"),
      the lookup's gradient asks XLA's partitioner to go from rows split over all
      devices to the width split over 'fsdp' and rows whole, which it can only do by
      gathering the whole array ("Involuntary full rematerialization"). "rows": the
      lookup's output is laid out as the table (LOOKUP) before the residual's layout,
      so the activations move to the table's shards and back in all-to-alls. "table":
      the table is gathered over 'fsdp' first (as FSDP gathers a layer), so the tokens
      are looked up where they are.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: jnp.dtype = jnp.float32,
        remat: str = "full",
        offload_activations: bool = False,
        scan_unroll: int = 1,
        context_parallel: bool = False,
        attention: str = "xla",
        lookup: str = "xla",
        *,
        rngs: nnx.Rngs,
    ):
        if offload_activations and remat != "full":
            raise ValueError(
                f"offloading activations is full remat with each layer's input in "
                f"host memory; remat is {remat!r}"
            )
        c, self.config, self.dtype = config, config, dtype
        self.remat, self.offload_activations = remat, offload_activations
        self.scan_unroll, self.context_parallel = scan_unroll, context_parallel
        self.attention, self.lookup = attention, lookup
        table = by_axes(
            nnx.initializers.normal(embedding_stddev(c)), ("vocab", "embed")
        )
        self.embed = nnx.Embed(
            c.vocab_size, c.width, dtype=dtype, embedding_init=table, rngs=rngs
        )

        # num_layers blocks made as one, each weight with a leading axis of layers
        # named "layers" (which the rules map to 'pipeline'); split_rngs gives each
        # layer its own key, or all would draw the same weights
        @nnx.split_rngs(splits=c.num_layers)
        @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: "layers"})
        def blocks(rngs: nnx.Rngs) -> Block:
            return Block(c, dtype, context_parallel, attention, rngs=rngs)

        self.layers = blocks(rngs)
        self.final_norm = RMSNorm(c.width, c.norm_eps, dtype)
        if not c.tie_embeddings:
            self.unembed = dense(c.width, c.vocab_size, ("embed", "vocab"), dtype, rngs)

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_T: jax.Array | None = None,
        starts_BT: jax.Array | None = None,
    ):
        x_BTD, aux_loss = self.features(tokens_BT, positions_T, starts_BT)
        return self.logits(x_BTD), aux_loss

    def features(
        self,
        tokens_BT: jax.Array,
        positions_T: jax.Array | None = None,
        starts_BT: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """Token ids -> (the last layer's output, before the final norm; the experts'
        auxiliary loss): the model without its output projection, for a loss that
        computes the logits a chunk at a time (loss.fused_cross_entropy)."""
        if positions_T is None:
            positions_T = jnp.arange(tokens_BT.shape[1])
        x_BTD = self.embed_tokens(tokens_BT)
        return self.run_layers(x_BTD, positions_T, starts_BT)

    def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
        """Token ids -> the residual stream's first values, in its layout."""
        if self.lookup == "table":
            table_VD = constrain(self.embed.embedding[...], ("vocab", None))
            x_BTD = jnp.take(table_VD, tokens_BT, axis=0).astype(self.dtype)
        elif self.lookup in ("rows", "xla"):
            x_BTD = self.embed(tokens_BT)
        else:
            raise ValueError(f"lookup {self.lookup!r}: expected one of {LOOKUPS}")
        if self.lookup == "rows":
            x_BTD = constrain(x_BTD, LOOKUP)
        return constrain(x_BTD, RESIDUAL)

    def run_layers(
        self, x_BTD: jax.Array, positions_T: jax.Array, starts_BT: jax.Array | None
    ) -> tuple[jax.Array, jax.Array]:
        """The residual stream through every layer (config.num_layers of them: a
        pipeline stage's model has its stage's count) -> (it, the experts' losses)."""
        graphdef, stacked = nnx.split(self.layers)
        # A traced array, as Linen's nn.scan made it: inputs.py's numpy positions would
        # be computed on in numpy while tracing and compiled in as constants.
        positions_T = jnp.asarray(positions_T)

        def layer(x_BTD, layer_state):
            block = nnx.merge(graphdef, layer_state)
            return block(x_BTD, positions_T, starts_BT)

        if self.remat != "none":
            policy = REMAT_POLICIES[self.remat]
            layer = jax.checkpoint(
                layer,
                policy=OFFLOADED if self.offload_activations else policy,
                prevent_cse=False,
            )
        x_BTD, aux_losses = jax.lax.scan(layer, x_BTD, stacked, unroll=self.scan_unroll)
        return x_BTD, aux_losses.sum()

    def logits(self, x_BTD: jax.Array) -> jax.Array:
        """The final norm and the output projection: vocabulary-parallel logits, so
        that no device holds a row of all V logits."""
        x_BTD = self.final_norm(x_BTD)
        if self.config.tie_embeddings:
            logits_BTV = self.embed.attend(x_BTD)
        else:
            logits_BTV = self.unembed(x_BTD)
        return constrain(logits_BTV, ("batch", "act_seq", "act_vocab"))


# Transformer's settings: how it computes, not what it holds
SETTINGS = (
    "dtype",
    "remat",
    "offload_activations",
    "scan_unroll",
    "context_parallel",
    "attention",
    "lookup",
)


def settings_of(model: Transformer) -> dict:
    """``model``'s SETTINGS, by name."""
    return {name: getattr(model, name) for name in SETTINGS}


def abstract(config: ModelConfig, *settings, **named_settings) -> Transformer:
    """Transformer(config, *settings, **named_settings) with its weights as shapes
    (nnx.eval_shape): nothing drawn or held, for a model of any size on any
    machine."""
    return nnx.eval_shape(
        lambda: Transformer(config, *settings, **named_settings, rngs=nnx.Rngs(0))
    )


def variant(model: Transformer, **changes) -> Transformer:
    """``model`` with some of its settings (or its ``config``) changed, its weights as
    shapes."""
    settings = settings_of(model) | changes
    return abstract(settings.pop("config", model.config), **settings)


def initialized(model: Transformer, rng: jax.Array) -> Transformer:
    """``model``'s settings with weights drawn from ``rng``."""
    return Transformer(model.config, **settings_of(model), rngs=nnx.Rngs(rng))


def params_of(model: Transformer) -> dict:
    """The model's weights as nested dicts of arrays, keyed by their paths
    ({"embed": {"embedding": ...}, "layers": {"attention": {"query": ...}}, ...}):
    the train state's and the checkpoints' form."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def with_params(model: Transformer, params: dict) -> Transformer:
    """``model`` holding ``params``: all its weights, or some of its top-level parts
    (a pipeline stage's "layers", the head's "final_norm" and "unembed"), the others
    as ``model`` holds them (shapes, for an abstract model: a method that does not use
    them runs)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, {**nnx.to_pure_dict(state), **params})


def logical_params(model: Transformer) -> dict:
    """params_of, each weight in Linen's ``nn.LogicallyPartitioned`` box of its
    logical axis names: the form ``nn.get_partition_spec`` reads, and which optax
    carries into Adam's moments; unboxed under a mesh, the names go through the rules
    (``nn.logical_axis_rules``), as Linen's ``nn.with_logical_partitioning`` did."""

    def box(variable: nnx.Variable):
        names = variable.get_metadata().get("out_sharding")
        return nn.LogicallyPartitioned(variable[...], names) if names else variable[...]

    is_variable = lambda x: isinstance(x, nnx.Variable)
    boxed = jax.tree.map(box, nnx.state(model, nnx.Param), is_leaf=is_variable)
    return nnx.to_pure_dict(boxed)
