import collections
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import sharding
from jaxdist_lessons.sharding import ShardingError

N = jax.device_count()
MESHES = [
    ((N,), ("data",)),
    ((N // 2, 2), ("data", "tensor")),
    ((2, N // 2), ("data", "tensor")),
]
SPECS = [
    P(),
    P("data"),
    P("tensor"),
    P("data", "tensor"),
    P(None, "tensor"),
    P(("data", "tensor")),
    P(("tensor", "data")),
    P("tensor", "data"),
]


def cases():
    for (shape, names), spec in itertools.product(MESHES, SPECS):
        used = {a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))}
        if used <= set(names):
            yield shape, names, spec


@pytest.mark.parametrize("mesh_shape, names, spec", list(cases()), ids=str)
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_predicted_shards_match_the_addressable_shards(
    mesh_shape, names, spec, axis_type
):
    m = jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * len(names))
    shape, dtype = (4 * N, 2 * N), jnp.bfloat16
    x = jax.device_put(jnp.zeros(shape, dtype), NamedSharding(m, spec))
    assert {s.data.shape for s in x.addressable_shards} == {
        sharding.shard_shape(shape, m, spec)
    }
    assert sharding.shard_shape(shape, m, spec) == x.sharding.shard_shape(shape)
    # the copies of a block, counted from the shards, are the axes the spec does not name
    named = {
        a
        for entry in spec
        if entry
        for a in (entry if isinstance(entry, tuple) else (entry,))
    }
    replicas = math.prod(size for axis, size in m.shape.items() if axis not in named)
    copies = collections.Counter(str(s.index) for s in x.addressable_shards)
    assert set(copies.values()) == {replicas}
    assert set(sharding.bytes_per_device(x).values()) == {
        sharding.expected_bytes_per_device(shape, dtype, m, spec)
    }
    held = sharding.blocks(shape, x.sharding)
    assert len(held) == N // replicas
    assert all(len(ids) == replicas for ids in held.values())
    # the blocks tile the array exactly once
    cover = np.zeros(shape, int)
    for block in held:
        cover[tuple(slice(a, b) for a, b in block)] += 1
    assert (cover == 1).all()


@pytest.mark.parametrize(
    "shape, spec, message",
    [
        (
            (9, 3),
            P("tensor"),
            "array: dimension 0 of shape (9, 3) has size 9, which 2 devices (axes ('tensor',)) "
            "cannot split evenly: drop the remainder, pad it to a multiple of 2, or leave it unsharded "
            "(None) in the spec",
        ),
        (
            (8, 7),
            P(None, ("data", "tensor")),
            "array: dimension 1 of shape (8, 7) has size 7, which {n} devices "
            "(axes ('data', 'tensor')) cannot split evenly: drop the remainder, pad it "
            "to a multiple of {n}, or leave it unsharded (None) in the spec",
        ),
        (
            (8, 4),
            P("data", "tensor", None),
            "array: spec P('data', 'tensor', None) has 3 entries but the array "
            "has rank 2 (8, 4): a spec has at most one entry per array dimension",
        ),
        (
            (8, 4),
            P("expert"),
            "array: spec P('expert',) names axis 'expert', which is not in the mesh "
            "{{'data': {k}, 'tensor': 2}}: use one of ('data', 'tensor')",
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
    m = jax.make_mesh(
        (N // 2, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2
    )
    with pytest.raises(ShardingError) as info:
        sharding.check_spec(shape, m, spec)
    assert str(info.value) == message.format(k=N // 2, n=N)


def test_bytes_and_shapes_per_device_for_a_batch_sharded_array():
    m = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.zeros((N * 4, 6), jnp.float32), NamedSharding(m, P("data")))
    assert sharding.bytes_per_device(x) == {d.id: 4 * 6 * 4 for d in jax.devices()}
    assert {s.device.id: s.data.shape for s in x.addressable_shards} == {
        d.id: (4, 6) for d in jax.devices()
    }


TREE = {
    "dense": {"kernel": jnp.zeros((8, 16)), "bias": jnp.zeros(16)},
    "norm": {"scale": jnp.zeros(16)},
    "step": jnp.zeros((), jnp.int32),
}
RULES = [(r"dense/kernel$", P(None, "tensor")), (r"bias$|scale$", P("tensor"))]


def test_rules_map_paths_to_specs_first_match_wins():
    assert sharding.spec_for("params/dense/kernel", RULES) == P(None, "tensor")
    assert sharding.spec_for("params/dense/bias", RULES) == P("tensor")
    assert sharding.spec_for("step", RULES) == P()
    assert sharding.spec_for(
        "x/bias", [(r"bias", P("data")), (r"bias", P("tensor"))]
    ) == P("data")
    with pytest.raises(
        ShardingError, match="no rule matches 'step'; add one, or pass a default spec"
    ):
        sharding.spec_for("step", RULES, default=None)


def test_shardings_from_rules_place_a_tree():
    m = jax.make_mesh(
        (N // 2, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2
    )
    shardings = sharding.shardings_from_rules(TREE, m, RULES)
    placed = jax.device_put(TREE, shardings)
    assert placed["dense"]["kernel"].sharding.spec == P(None, "tensor")
    assert placed["norm"]["scale"].sharding.spec == P("tensor")
    assert placed["step"].sharding.spec == P()
    assert placed["dense"]["kernel"].addressable_shards[0].data.shape == (8, 8)
    abstract = jax.eval_shape(lambda: TREE)
    assert sharding.specs_from_rules(abstract, m, RULES) == sharding.specs_from_rules(
        TREE, m, RULES
    )


def test_a_bad_rule_fails_with_the_leaf_path():
    m = jax.make_mesh(
        (N // 2, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2
    )
    with pytest.raises(
        ShardingError, match=r"^dense/bias: spec P\('tensor', None\) has 2 entries"
    ):
        sharding.specs_from_rules(TREE, m, [(r"bias", P("tensor", None))])


def test_placement_rows_read_the_placed_arrays():
    m = jax.make_mesh(
        (N // 2, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2
    )
    x = jnp.zeros((2 * N, 8))
    specs = [P("data"), P(None, "tensor"), P()]
    rows = sharding.placement_rows(
        jax.device_put(x, NamedSharding(m, s)) for s in specs
    )
    assert rows == [
        [str(P("data")), (4, 8), 2, 4 * 8 * 4, N // 2],
        [str(P(None, "tensor")), (2 * N, 4), N // 2, 2 * N * 4 * 4, 2],
        [str(P()), (2 * N, 8), N, 2 * N * 8 * 4, 1],
    ]


def test_bytes_per_device_sums_a_whole_tree():
    m = jax.make_mesh(
        (N // 2, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2
    )
    tree = {
        "a": jax.device_put(jnp.zeros((N, 4)), NamedSharding(m, P("data"))),
        "b": [jax.device_put(jnp.zeros(6, jnp.int8), NamedSharding(m, P()))],
    }
    assert sharding.bytes_per_device(tree) == {
        d.id: 2 * 4 * 4 + 6 for d in jax.devices()
    }


# --- A batch over the devices ------------------------------------------------------------------


@pytest.fixture(scope="module")
def auto():
    return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))


def odd_batch():
    # A batch every device count > 1 fails to divide: one example more than a multiple.
    return np.ones((2 * N + 1, 3), np.float32)


@pytest.mark.skipif(N == 1, reason="one device divides every batch")
def test_check_batch_raises_before_jax_and_names_both_fixes(auto):
    batch = {"images": odd_batch(), "labels": np.zeros(2 * N + 1, np.int32)}
    with pytest.raises(
        sharding.BatchError,
        match=rf"images: a batch of {2 * N + 1} does not split over the {N} devices"
        rf".*pad it to {3 * N} .* drop the remainder to {2 * N}",
    ):
        sharding.check_batch(batch, auto, P("data"))
    padded, mask = sharding.pad_batch(batch, N)
    sharding.check_batch(padded, auto, P("data"))
    assert (
        padded["images"].shape == (3 * N, 3)
        and mask.sum() == 2 * N + 1
        and mask[-1] == 0
    )
    assert np.array_equal(padded["labels"][: 2 * N + 1], batch["labels"])
    sharding.check_batch(sharding.drop_remainder(batch, N), auto, P("data"))
    assert sharding.drop_remainder(batch, N)["labels"].shape == (2 * N,)


def test_pad_and_drop_need_one_leading_size():
    mismatched = {"images": np.ones((5, 3)), "labels": np.zeros(7, np.int32)}
    for fix in (sharding.pad_batch, sharding.drop_remainder):
        with pytest.raises(
            sharding.BatchError,
            match=r"must share their leading \(batch\) size, got "
            r"\{'images': 5, 'labels': 7\}",
        ):
            fix(mismatched, 4)
        with pytest.raises(sharding.BatchError, match="step is a scalar"):
            fix({"images": np.ones((5, 3)), "step": np.int32(3)}, 4)
        with pytest.raises(sharding.BatchError, match="no arrays"):
            fix({}, 4)
    assert sharding.batch_size({"images": np.ones((5, 3)), "labels": np.zeros(5)}) == 5


def test_check_batch_names_the_other_spec_problems(auto):
    good = np.ones((N, 3))
    sharding.check_batch({"x": good}, auto, P("data"))
    with pytest.raises(
        ShardingError, match="names axis 'tensor', which is not in the mesh"
    ):
        sharding.check_batch({"x": good}, auto, P("tensor"))
    with pytest.raises(
        ShardingError, match="x: spec .* has 3 entries but the array has rank 2"
    ):
        sharding.check_batch({"x": good}, auto, P("data", None, None))
    with pytest.raises(sharding.BatchError, match="share their leading"):
        sharding.check_batch({"x": good, "y": np.ones(N + 1)}, auto, P("data"))
    with pytest.raises(sharding.BatchError, match="no arrays"):
        sharding.check_batch({}, auto, P("data"))


def test_one_check_for_the_input_pipeline_and_check_batch(auto):
    assert sharding.check_batch_divides(4 * N, auto, "data", process_count=2) == N
    with pytest.raises(
        sharding.BatchError,
        match=rf"a batch of {2 * N + 1} does not split over the {N} devices of mesh axes "
        rf"'data' \(mesh \{{'data': {N}\}}\) and the 2 processes",
    ):
        sharding.check_batch_divides(2 * N + 1, auto, "data", process_count=2)
    with pytest.raises(
        ShardingError, match="has no axis 'tensor' to shard the batch over"
    ):
        sharding.check_batch_divides(N, auto, "tensor")
