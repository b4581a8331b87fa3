import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist_lessons.models import vit

TINY = {
    "num_classes": 10,
    "patch_size": 4,
    "hidden": 32,
    "num_layers": 2,
    "num_heads": 4,
    "mlp_dim": 64,
}


def abstract(model, images):
    return jax.eval_shape(model.init, jax.random.key(0), images)


def test_parameter_count_matches_the_formula():
    model = vit.ViT(**TINY)
    variables = abstract(model, jnp.zeros((1, 16, 16, 3)))
    count = sum(x.size for x in jax.tree.leaves(nn.unbox(variables)))
    assert count == vit.vit_params(32, 2, 64, 4, 16, 10)


def test_published_sizes_of_vit_b16_and_l16():
    # ViT paper (Dosovitskiy et al. 2021), table 1: ViT-Base 86M, ViT-Large 307M at 16x16 patches,
    # 1000 classes; the exact counts below are those of the reference implementation.
    assert vit.vit_params(768, 12, 3072, 16, 224, 1000) == 86_567_656
    assert vit.vit_params(1024, 24, 4096, 16, 224, 1000) == 304_326_632


def test_every_parameter_carries_logical_names():
    variables = abstract(vit.ViT(**TINY), jnp.zeros((1, 16, 16, 3)))
    boxes = jax.tree.leaves(
        variables, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )
    assert boxes and all(isinstance(b, nn.LogicallyPartitioned) for b in boxes)
    specs = nn.get_partition_spec(variables)["params"]
    assert specs["Block_0"]["mlp"]["up"]["kernel"] == jax.P("embed", "mlp")
    assert specs["Block_1"]["attention"]["query"]["kernel"] == jax.P(
        "embed", "heads", "kv"
    )
    assert specs["Block_1"]["attention"]["out"]["kernel"] == jax.P(
        "heads", "kv", "embed"
    )
    assert specs["head"]["bias"] == jax.P("classes")


def test_logits_and_patches():
    model = vit.ViT(**TINY)
    images = jax.random.normal(jax.random.key(1), (3, 16, 16, 3))
    variables = jax.jit(model.init)(jax.random.key(0), images)
    logits = jax.jit(model.apply)(variables, images)
    assert logits.shape == (3, 10) and logits.dtype == jnp.float32
    patches = vit.patchify(images, 4)
    assert patches.shape == (3, 16, 48)
    np.testing.assert_array_equal(patches[:, 0].reshape(3, 4, 4, 3), images[:, :4, :4])
    np.testing.assert_array_equal(patches[:, 1].reshape(3, 4, 4, 3), images[:, :4, 4:8])


def test_bad_sizes_raise_clear_errors():
    with pytest.raises(ValueError, match="not divisible by patch_size=5"):
        vit.patchify(jnp.zeros((1, 16, 16, 3)), 5)
    with pytest.raises(ValueError, match="not divisible by num_heads=3"):
        abstract(vit.ViT(**{**TINY, "num_heads": 3}), jnp.zeros((1, 16, 16, 3)))


def test_loss_is_log_classes_at_zero_logits():
    model = vit.ViT(**TINY)
    images = jnp.zeros((2, 16, 16, 3))
    params = jax.tree.map(jnp.zeros_like, nn.unbox(abstract(model, images))["params"])
    batch = {"images": images, "labels": jnp.array([1, 7])}
    loss = jax.jit(lambda p, b: vit.classification_loss(model, p, b))(params, batch)
    # every logit 0: the loss is log(10)
    assert float(loss) == pytest.approx(np.log(10), rel=1e-6)
