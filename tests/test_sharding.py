import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import mesh as mesh_lib
from jaxdist_lessons import sharding
from jaxdist_lessons.sharding import ShardingError

N = jax.device_count()
MESHES = [
    ((N,), ("data",)),
    ((N // 2, 2), ("data", "model")),
    ((2, N // 2), ("data", "model")),
]
SPECS = [
    P(),
    P("data"),
    P("model"),
    P("data", "model"),
    P(None, "model"),
    P(("data", "model")),
    P(("model", "data")),
    P("model", "data"),
]


def cases():
    for (shape, names), spec in itertools.product(MESHES, SPECS):
        used = {a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))}
        if used <= set(names):
            yield shape, names, spec


@pytest.mark.parametrize("mesh_shape, names, spec", list(cases()), ids=str)
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_predicted_shards_match_the_addressable_shards(mesh_shape, names, spec, axis_type):
    m = mesh_lib.make_mesh(mesh_shape, names, axis_types=axis_type)
    shape, dtype = (4 * N, 2 * N), jnp.bfloat16
    x = jax.device_put(jnp.zeros(shape, dtype), NamedSharding(m, spec))
    assert set(sharding.shard_shapes(x).values()) == {sharding.shard_shape(shape, m, spec)}
    assert set(sharding.bytes_per_device(x).values()) == {
        sharding.expected_bytes_per_device(shape, dtype, m, spec)
    }
    held = sharding.blocks(shape, x.sharding)
    assert len(held) == N // sharding.replicas(m, spec)
    assert all(len(ids) == sharding.replicas(m, spec) for ids in held.values())
    # the blocks tile the array exactly once
    cover = np.zeros(shape, int)
    for block in held:
        cover[tuple(slice(a, b) for a, b in block)] += 1
    assert (cover == 1).all()


def test_replicas_counts_unnamed_axes():
    m = mesh_lib.make_mesh((N // 2, 2), ("data", "model"))
    assert sharding.replicas(m, P()) == N
    assert sharding.replicas(m, P("data")) == 2
    assert sharding.replicas(m, P(None, "model")) == N // 2
    assert sharding.replicas(m, P(("data", "model"))) == 1


@pytest.mark.parametrize(
    "shape, spec, message",
    [
        (
            (9, 3),
            P("model"),
            "array: dimension 0 of shape (9, 3) has size 9, which 2 devices (axes ('model',)) "
            "cannot split evenly: drop the remainder, pad it to a multiple of 2, or leave it unsharded "
            "(None) in the spec",
        ),
        (
            (8, 7),
            P(None, ("data", "model")),
            "array: dimension 1 of shape (8, 7) has size 7, which {n} devices "
            "(axes ('data', 'model')) cannot split evenly: drop the remainder, pad it "
            "to a multiple of {n}, or leave it unsharded (None) in the spec",
        ),
        (
            (8, 4),
            P("data", "model", None),
            "array: spec P('data', 'model', None) has 3 entries but the array "
            "has rank 2 (8, 4): a spec has at most one entry per array dimension",
        ),
        (
            (8, 4),
            P("tensor"),
            "array: spec P('tensor',) names axis 'tensor', which is not in the mesh "
            "{{'data': {k}, 'model': 2}}: use one of ('data', 'model')",
        ),
        (
            (8, 4),
            P("data", "data"),
            "array: spec P('data', 'data') uses mesh axis 'data' twice; each mesh "
            "axis can split at most one array dimension",
        ),
    ],
)
def test_check_spec_errors(shape, spec, message):
    m = mesh_lib.make_mesh((N // 2, 2), ("data", "model"))
    with pytest.raises(ShardingError) as info:
        sharding.check_spec(shape, m, spec)
    assert str(info.value) == message.format(k=N // 2, n=N)


def test_bytes_and_shapes_per_device_for_a_batch_sharded_array():
    m = mesh_lib.make_mesh((N,), ("data",))
    x = jax.device_put(jnp.zeros((N * 4, 6), jnp.float32), NamedSharding(m, P("data")))
    assert sharding.bytes_per_device(x) == {d.id: 4 * 6 * 4 for d in jax.devices()}
    assert sharding.shard_shapes(x) == {d.id: (4, 6) for d in jax.devices()}


TREE = {
    "dense": {"kernel": jnp.zeros((8, 16)), "bias": jnp.zeros(16)},
    "norm": {"scale": jnp.zeros(16)},
    "step": jnp.zeros((), jnp.int32),
}
RULES = [(r"dense/kernel$", P(None, "model")), (r"bias$|scale$", P("model"))]


def test_rules_map_paths_to_specs_first_match_wins():
    assert sharding.spec_for("params/dense/kernel", RULES) == P(None, "model")
    assert sharding.spec_for("params/dense/bias", RULES) == P("model")
    assert sharding.spec_for("step", RULES) == P()
    assert sharding.spec_for("x/bias", [(r"bias", P("data")), (r"bias", P("model"))]) == P(
        "data"
    )
    with pytest.raises(
        ShardingError, match="no rule matches 'step'; add one, or pass a default spec"
    ):
        sharding.spec_for("step", RULES, default=None)


def test_shardings_from_rules_place_a_tree():
    m = mesh_lib.make_mesh((N // 2, 2), ("data", "model"))
    shardings = sharding.shardings_from_rules(TREE, m, RULES)
    placed = jax.device_put(TREE, shardings)
    assert placed["dense"]["kernel"].sharding.spec == P(None, "model")
    assert placed["norm"]["scale"].sharding.spec == P("model")
    assert placed["step"].sharding.spec == P()
    assert sharding.shard_shapes(placed["dense"]["kernel"])[0] == (8, 8)
    abstract = jax.eval_shape(lambda: TREE)
    assert sharding.specs_from_rules(abstract, m, RULES) == sharding.specs_from_rules(
        TREE, m, RULES
    )


def test_a_bad_rule_fails_with_the_leaf_path():
    m = mesh_lib.make_mesh((N // 2, 2), ("data", "model"))
    with pytest.raises(
        ShardingError, match=r"^dense/bias: spec P\('model', None\) has 2 entries"
    ):
        sharding.specs_from_rules(TREE, m, [(r"bias", P("model", None))])


def test_path_name():
    paths = [
        sharding.path_name(p)
        for p, _ in jax.tree_util.tree_flatten_with_path({"a": [1, (2,)]})[0]
    ]
    assert paths == ["a/0", "a/1/0"]


def test_bytes_per_device_sums_a_whole_tree():
    m = mesh_lib.make_mesh((N // 2, 2), ("data", "model"))
    tree = {
        "a": jax.device_put(jnp.zeros((N, 4)), NamedSharding(m, P("data"))),
        "b": [jax.device_put(jnp.zeros(6, jnp.int8), NamedSharding(m, P()))],
    }
    assert sharding.bytes_per_device(tree) == {d.id: 2 * 4 * 4 + 6 for d in jax.devices()}
