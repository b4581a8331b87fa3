import collections
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import (
    comms,
    compiled,
    experts,
    hardware,
    memory,
    partitioning,
    sequence,
    sharding,
    train,
)
from jaxdist_lessons.models import vit
from jaxdist_lessons.planning import costmodel, layer_collectives, roofline
from jaxdist_lessons.traffic import comm_seconds

matplotlib.use("Agg")
N = jax.device_count()


# --- Tables and cases worked by hand ------------------------------------------------------------


def test_bytes_sent_by_each_kind_of_collective():
    # 2 (N-1)/N
    assert costmodel.sent_bytes(costmodel.Transfer("all-reduce", 100, 4)) == 150
    # (N-1)/N of the gathered array
    assert costmodel.sent_bytes(costmodel.Transfer("all-gather", 100, 4)) == 75
    # N-1 shards of 25
    assert costmodel.sent_bytes(costmodel.Transfer("reduce-scatter", 25, 4)) == 75
    assert (
        costmodel.sent_bytes(costmodel.Transfer("collective-permute", 100, None)) == 100
    )
    with pytest.raises(ValueError, match="unknown collective kind 'broadcast'"):
        costmodel.sent_bytes(costmodel.Transfer("broadcast", 1, 2))
    # without a group size too
    with pytest.raises(ValueError, match="unknown collective kind 'broadcast'"):
        costmodel.sent_bytes(costmodel.Transfer("broadcast", 1, None))


def test_vit_b16_data_parallel_on_8_a100_by_hand():
    spec = costmodel.MODELS["ViT-B/16"]
    e = roofline.estimate(spec, costmodel.Layout(data=8), "A100 40GB")
    # One all-reduce of the bf16 gradients, 86,567,656 x 2 bytes; a ring sends 2 x 7/8 of it at 300 GB/s.
    assert [(t.kind, t.bytes, t.group_size) for t in e.transfers] == [
        ("all-reduce", 86_567_656 * 2, 8)
    ]
    assert e.comm_s == pytest.approx(2 * 7 / 8 * 86_567_656 * 2 / 300e9)
    # Flops: 6 x (block and patch-embedding weights) x 197 tokens x 256 images, plus the head and attention.
    blocks = 12 * (4 * 768**2 + 2 * 768 * 3072)
    flops = (
        6 * (blocks + 16 * 16 * 3 * 768) * 197 * 256
        + 6 * 768 * 1000 * 256
        + 12 * 12 * 197**2 * 768 * 256
    )
    assert e.flops == pytest.approx(flops / 8)
    # compute-bound: flops / peak
    assert e.compute_s == pytest.approx(flops / 8 / 312e12)
    # Memory: 16 bytes of state per parameter (mixed precision Adam); 32 images of activations.
    assert e.state_bytes == 86_567_656 * 16
    assert e.activation_bytes == 12 * 197 * 32 * 768 * (34 + 5 * 12 * 197 / 768)


def test_tensor_parallel_transfers_by_hand():
    spec = costmodel.vit_spec(
        "tiny",
        width=4,
        num_layers=2,
        num_heads=2,
        mlp_width=8,
        patch_size=2,
        image_size=4,
        num_classes=3,
        global_batch=6,
    )
    transfers = costmodel.predict_transfers(
        spec, costmodel.Layout(data=3, tensor=2), param_bytes=4, activation_bytes=4
    )
    activations = [t for t in transfers if t.what.startswith("activations")]
    # 4 per block, 2 blocks, each of (6/3 images x 5 tokens x 4 hidden) floats, over the 2 tensor devices.
    assert [(t.kind, t.bytes, t.group_size) for t in activations] == [
        ("all-reduce", 2 * 5 * 4 * 4, 2)
    ] * 8
    # per block: Q, K, V, out kernels; Q/K/V biases; MLP kernels; up bias
    tp = 4 * 16 + 3 * 4 + 2 * 4 * 8 + 8
    assert spec.layer_tp_params == tp
    assert transfers[-1] == costmodel.Transfer(
        "all-reduce",
        (2 * tp / 2 + spec.params - 2 * tp) * 4,
        3,
        "gradients (data parallel)",
    )


def test_vocabulary_parallel_lm_by_hand():
    spec = costmodel.gpt_spec(
        "lm",
        width=8,
        num_layers=3,
        num_heads=2,
        vocab_size=16,
        seq_len=4,
        global_batch=4,
    )
    assert spec.vocab_parallel and spec.tp_params == 3 * spec.layer_tp_params + 16 * 8
    transfers = costmodel.predict_transfers(
        spec, costmodel.Layout(tensor=2), activation_bytes=2
    )
    # 4 all-reduces per block and 2 for the embedding, each of 4 x 4 tokens x 8 hidden x 2 bytes.
    assert [(t.kind, t.bytes) for t in transfers] == [
        ("all-reduce", 4 * 4 * 8 * 2)
    ] * 14
    in_blocks, outside = costmodel.train_flops(spec)
    assert outside == 6 * 16 * 8 * 16  # the tied output projection, 16 tokens
    assert (
        costmodel.flops_per_device(spec, costmodel.Layout(tensor=2))
        == (in_blocks + outside) / 2
    )


def test_the_precision_sets_the_width_of_the_weights_that_are_sent_and_read():
    spec, layout = costmodel.MODELS["ViT-B/16"], costmodel.Layout(data=8)
    mixed = roofline.estimate(spec, layout, "A100 40GB", precision="mixed")
    fp32 = roofline.estimate(spec, layout, "A100 40GB", precision="fp32")
    assert [t.bytes for t in mixed.transfers] == [86_567_656 * 2]  # bf16 gradients
    assert [t.bytes for t in fp32.transfers] == [86_567_656 * 4]  # fp32 gradients
    assert fp32.comm_s == pytest.approx(2 * mixed.comm_s)
    # Adam: 16 bytes either way
    assert fp32.state_bytes == mixed.state_bytes == 86_567_656 * 16
    explicit = roofline.estimate(
        spec, layout, "A100 40GB", precision="fp32", param_bytes=2
    )
    assert explicit.transfers == mixed.transfers  # an explicit width still wins
    fsdp_mixed = roofline.estimate(
        spec, costmodel.Layout(fsdp=8), "A100 40GB", precision="mixed"
    )
    fsdp_fp32 = roofline.estimate(
        spec, costmodel.Layout(fsdp=8), "A100 40GB", precision="fp32"
    )
    # FSDP also holds two gathered layers, at the weights' width.
    assert (
        fsdp_fp32.state_bytes - fsdp_mixed.state_bytes == 2 * 2 * spec.layer_tp_params
    )


def test_activation_formula_reduces_to_chapter_1s_without_tensor_parallelism():
    for flash in (False, True):
        assert costmodel.layer_activation_bytes(
            2048, 4, 12288, 96, 1, flash
        ) == memory.transformer_layer_activation_bytes(2048, 4, 12288, 96, flash)
    # Korthikanti et al. eq. (2): the 24 sbh and attention terms split over t, the 10 sbh do not.
    assert costmodel.layer_activation_bytes(10, 1, 100, 4, tensor=2) == 10 * 100 * (
        10 + 12 + 5 * 4 * 10 / 200
    )
    # With sequence parallelism (their section 4.2.2) the 10 sbh split too: 34 sbh / t.
    split = costmodel.layer_activation_bytes(
        10, 1, 100, 4, 2, True, sequence_parallel=True
    )
    assert split == 10 * 100 * 34 / 2


def test_layouts_checks_and_labels():
    assert [x.label for x in costmodel.article_layouts(8)] == [
        "(8,1)",
        "(4,2)",
        "(2,4)",
        "(1,8)",
        "FSDP 8",
    ]
    assert costmodel.check_layout(
        costmodel.MODELS["ViT-B/16"], costmodel.Layout(tensor=8)
    ) == ["12 heads do not split over tensor=8"]
    assert (
        costmodel.check_layout(costmodel.MODELS["ViT-L/16"], costmodel.Layout(tensor=8))
        == []
    )
    # GPT-2's 50,257-token vocabulary, split over `tensor` with the embedding, divides by nothing but 1.
    assert costmodel.check_layout(
        costmodel.MODELS["GPT-2 medium (355M)"], costmodel.Layout(data=4, tensor=2)
    ) == ["vocabulary of 50257 does not split over tensor=2"]
    assert [x.label for x in costmodel.article_layouts(32)][-2:] == [
        "(1,32)",
        "FSDP 32",
    ]
    assert [x.label for x in costmodel.article_layouts(6)] == [
        "(6,1)",
        "(3,2)",
        "FSDP 6",
    ]
    assert costmodel.Layout(fsdp=4, tensor=2).label == "FSDP 4 x tensor 2"
    with pytest.raises(
        ValueError, match="Layout.tensor must be a positive integer, got 0"
    ):
        costmodel.Layout(tensor=0)


def test_the_cost_model_needs_a_chip_with_a_link_figure():
    with pytest.raises(
        ValueError, match="A100 80GB PCIe has no chip-to-chip bandwidth"
    ):
        roofline.estimate(
            costmodel.MODELS["ViT-B/16"], costmodel.Layout(data=8), "A100 80GB PCIe"
        )


# --- Against the compiler -----------------------------------------------------------------------

MODEL = vit.ViT(
    num_classes=10, patch_size=4, hidden=64, num_layers=2, num_heads=8, mlp_dim=256
)
SPEC = costmodel.vit_spec(
    "tiny", 64, 2, 8, 256, patch_size=4, image_size=16, num_classes=10, global_batch=8
)
BATCH = {"images": jnp.ones((8, 16, 16, 3)), "labels": jnp.zeros((8,), jnp.int32)}


@pytest.fixture(scope="module", params=["data", "tensor", "fsdp", "hybrid"])
def compiled_step(request):
    strategy = request.param
    mesh, rules = partitioning.strategy_mesh(strategy), partitioning.rules_for(strategy)
    state = train.create_train_state(
        MODEL,
        optax.sgd(0.1),
        BATCH["images"].shape[1:],
        train.rule_shardings(mesh, rules),
        jax.random.key(0),
    )
    step = partitioning.make_train_step(
        lambda p, b: vit.classification_loss(MODEL, p, b),
        mesh,
        rules,
        train.shardings_of(state),
    )
    batch = jax.device_put(BATCH, partitioning.batch_sharding(mesh, rules))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        program = step.lower(state, batch).compile()
    layout = costmodel.Layout(**{a: mesh.shape[a] for a in ("data", "fsdp", "tensor")})
    return strategy, layout, program, state


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="XLA:CPU's collective choices (6 activation all-reduces per block, FSDP gathering once "
    "and all-reducing); GPU passes such as AllReduceReassociate/ReduceScatterCreator differ",
)
def test_predicted_collectives_match_the_compiled_program(compiled_step):
    strategy, layout, program, _ = compiled_step
    measured = layer_collectives.transfers_from_hlo(program.as_text())
    # XLA on CPU all-reduces the input gradients of Q, K and V one by one: 6 activation all-reduces per block.
    predicted = costmodel.predict_transfers(
        SPEC, layout, param_bytes=4, activation_bytes=4, tp_allreduces_per_layer=6
    )
    # the mean loss, all-reduced over the batch devices
    loss = 4 if N > 1 and layout.tensor < N else 0
    if strategy in ("data", "tensor", "hybrid"):
        # Exactly the predicted all-reduces, plus the loss.
        assert sum(t.bytes for t in measured) == sum(t.bytes for t in predicted) + loss
        assert {t.kind for t in measured} <= {"all-reduce"}
    elif N > 1:  # on one device there is nothing to gather
        # FSDP: XLA keeps the gathered weights instead of gathering again, and all-reduces the gradients
        # instead of reduce-scattering them; each device still sends 3 (N-1)/N of the weights, as predicted.
        assert {"all-gather", "all-reduce"} <= {t.kind for t in measured}
        sent = sum(map(costmodel.sent_bytes, measured))
        assert sent == pytest.approx(
            sum(map(costmodel.sent_bytes, predicted)), rel=0.01
        )
        assert sent == pytest.approx(3 * (N - 1) / N * SPEC.params * 4, rel=0.01)
    hw = hardware.chip("A100 40GB")
    assert comm_seconds(measured, hw) == pytest.approx(
        comm_seconds(predicted, hw), rel=0.01, abs=1e-9
    )


def test_predicted_flops_and_parameters_match_the_compiled_program(compiled_step):
    strategy, layout, program, state = compiled_step
    # XLA also counts softmax, LayerNorm, GELU and the optimizer's element-wise flops: within 10%.
    assert compiled.stats(program).flops == pytest.approx(
        costmodel.flops_per_device(SPEC, layout), rel=0.1
    )
    held = max(sharding.bytes_per_device(nn.unbox(state.params)).values()) / 4
    # Exact except under FSDP, where the 10-class head bias is too small to split.
    assert held == pytest.approx(
        costmodel.params_per_device(SPEC, layout), rel=0 if strategy != "fsdp" else 0.01
    )
    assert math.isclose(
        sum(x.size for x in jax.tree.leaves(nn.unbox(state.params))), SPEC.params
    )


# --- One layer's collectives against the compiled layer (chapters 12_long_sequences and 13_experts), at 4 and 8 devices --


def records(transfers):
    """What the compiler and the model must agree on, whatever the order: kind, bytes, group size."""
    return sorted((t.kind, t.bytes, t.group_size) for t in transfers)


def axis_mesh(name, n):
    return jax.make_mesh(
        (n,), (name,), axis_types=(AxisType.Auto,), devices=jax.devices()[:n]
    )


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("kind", list(sequence.ATTENTIONS))
def test_context_parallel_transfers_are_the_compiled_attention(kind, n):
    B, T, N, A = 1, 32, 8, 4  # 2n chunks of the sequence, n heads for Ulysses
    q = jax.ShapeDtypeStruct((B, T, N, A), jnp.float32)
    attention = sequence.over_sequence(
        sequence.ATTENTIONS[kind], axis_mesh("sequence", n)
    )
    measured = layer_collectives.transfers_from_hlo(
        comms.compiled_text(attention, q, q, q)
    )
    predicted = layer_collectives.context_parallel_transfers(kind, B, T, N, A, n)
    assert records(measured) == records(predicted)
    # and a ring sends what chapter 12_long_sequences's formula says
    sent = sum(map(costmodel.sent_bytes, predicted))
    assert sent == sequence.predicted_bytes(kind, B, T, N, A, n)["sent"]


def test_context_parallel_transfers_reject_an_unknown_attention():
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        layer_collectives.context_parallel_transfers("flash", 1, 32, 8, 4, 4)


@pytest.mark.parametrize("n", [4, 8])
def test_expert_parallel_transfers_are_the_compiled_layer(n):
    num_experts, width, tokens, top_k, factor = 8, 16, 8, 2, 1.25
    params = experts.init_params(jax.random.key(0), width, 32, num_experts)
    mesh = axis_mesh("expert", n)
    layer = jax.jit(lambda p, x: experts.moe_all_to_all(p, x, top_k, factor, mesh))
    x_TD = jax.ShapeDtypeStruct((tokens * n, width), jnp.float32)
    measured = layer_collectives.transfers_from_hlo(
        layer.lower(params, x_TD).compile().as_text()
    )
    predicted = layer_collectives.expert_parallel_transfers(
        tokens, num_experts, top_k, factor, width, n
    )
    exchanged = [t for t in measured if t.kind == "all-to-all"]
    assert records(exchanged) == records(predicted)
    # the rest: the router's statistics, averaged (f, P: 8 floats each; z-loss) and the dropped count
    stats = [t for t in measured if t.kind != "all-to-all"]
    assert {t.kind for t in stats} == {"all-reduce"}
    assert sum(t.bytes for t in stats) == (2 * num_experts + 1) * 4 + 4
    # 8 experts x ceil(2 x 8 x 1.25 / 8) = 3 slots x 16 wide x 4 bytes, each way
    assert [t.bytes for t in predicted] == [8 * 3 * 16 * 4] * 2


def block_tp(x, w1, w2):
    return x + jax.lax.psum(jax.nn.gelu(x @ w1) @ w2, "tensor")


def block_sp(x, w1, w2):
    h = jax.lax.all_gather(x, "tensor", axis=1, tiled=True)
    y = jax.nn.gelu(h @ w1) @ w2
    return x + jax.lax.psum_scatter(y, "tensor", scatter_dimension=1, tiled=True)


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_transfers_are_the_compiled_megatron_block(
    sequence_parallel, n
):
    B, T, D, F = 2, 16, 8, 32
    residual = P(None, "tensor") if sequence_parallel else P()
    block = jax.shard_map(
        block_sp if sequence_parallel else block_tp,
        mesh=axis_mesh("tensor", n),
        in_specs=(residual, P(None, "tensor"), P("tensor", None)),
        out_specs=residual,
    )
    shapes = [(B, T, D), (D, F), (F, D)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    measured = layer_collectives.transfers_from_hlo(comms.compiled_text(block, *args))
    predicted = layer_collectives.tensor_parallel_transfers(
        B * T * D * 4, n, sequence_parallel
    )
    assert records(measured) == records(predicted)
    # a ring sends 2 (n-1)/n of the activation either way: chapter 12_long_sequences's Megatron formula
    theory = sequence.megatron_bytes(B, T, D, n)
    name = "tensor + sequence" if sequence_parallel else "tensor"
    assert sum(map(costmodel.sent_bytes, predicted)) == theory[name]["sent"]


def test_sequence_parallel_layout_sends_what_tensor_parallel_sends():
    spec, layout = costmodel.MODELS["GPT-2 (124M)"], costmodel.Layout(data=2, tensor=4)
    spec = dataclasses.replace(spec, logits_per_token=50256)  # a vocabulary 4 divides
    plain = costmodel.predict_transfers(spec, layout)
    sp = costmodel.predict_transfers(spec, layout, sequence_parallel=True)
    kinds = collections.Counter(t.kind for t in sp)
    # 12 blocks x 4 sites + 2 for the vocabulary: each all-reduce is now a gather and a scatter
    assert kinds == {"all-gather": 50, "reduce-scatter": 50, "all-reduce": 1}
    assert sum(map(costmodel.sent_bytes, sp)) == pytest.approx(
        sum(map(costmodel.sent_bytes, plain))
    )
