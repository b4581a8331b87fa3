"""hlo: reading a compiled program's text: instructions, dtypes, replica groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, hlo

HLO = """
HloModule m

%fused_computation (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %multiply.1 = f32[4]{0} multiply(f32[4]{0} %p0, f32[4]{0} %p0)
}

ENTRY %main (a: f32[4], b: f32[4,4]) -> (f32[4], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %fusion = f32[4]{0} fusion(f32[4]{0} %a), kind=kLoop, calls=%fused_computation
  %dot.2 = f32[4]{0} dot(f32[4,4]{1,0} %b, f32[4]{0} %fusion), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %tuple = (f32[4]{0}, f32[4]{0}) tuple(f32[4]{0} %fusion, f32[4]{0} %dot.2)
}
"""


def test_a_tuple_result_with_index_comments_is_one_instruction():
    line = (
        "  %call.9 = (f32[4]{0}, f32[], pred[], f32[4]{0}, f32[4]{0}, /*index=5*/f32[4]{0}) "
        "call(f32[4]{0} %a), to_apply=%norm.6"
    )
    [only] = hlo.instructions("ENTRY %main (a: f32[4]) -> f32[4] {\n" + line + "\n}")
    assert (only.name, only.opcode, only.in_entry) == ("call.9", "call", True)
    assert hlo.shapes_bytes(hlo.shapes(only.shape)) == 4 * 4 * 4 + 4 + 1


def test_op_counts_read_every_computation_and_the_entry_alone():
    assert hlo.op_counts(HLO) == {
        "parameter": 3,
        "multiply": 1,
        "fusion": 1,
        "dot": 1,
        "tuple": 1,
    }
    assert hlo.instruction_count(HLO) == 7
    assert hlo.entry_op_counts(HLO) == {
        "parameter": 2,
        "fusion": 1,
        "dot": 1,
        "tuple": 1,
    }


def test_schedule_outline_keeps_the_order_and_the_async_pairs():
    entry = """ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %fusion = f32[8]{0} fusion(f32[8]{0} %a), kind=kLoop, calls=%f
  %all-reduce-start = f32[8]{0} all-reduce-start(f32[8]{0} %fusion), replica_groups={}, to_apply=%add
  %fusion.1 = f32[8]{0} fusion(f32[8]{0} %a), kind=kLoop, calls=%g
  %dot.2 = f32[8]{0} dot(f32[8]{0} %fusion.1, f32[8]{0} %a), lhs_contracting_dims={}, rhs_contracting_dims={}
  %all-reduce-done = f32[8]{0} all-reduce-done(f32[8]{0} %all-reduce-start)
  ROOT %all-gather = f32[8]{0} all-gather(f32[8]{0} %all-reduce-done), dimensions={0}
}"""
    assert hlo.schedule_outline(entry) == [
        ("compute", 1),
        ("all-reduce-start", 1),
        ("compute", 2),
        ("all-reduce-done", 1),
        ("all-gather", 1),
    ]
    # the fused computation is not the entry
    assert hlo.schedule_outline(HLO) == [("compute", 2)]


def test_a_nested_jit_compiles_to_the_same_program():
    def norm(x):
        return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(
            x.var(-1, keepdims=True) + 1e-5
        )

    def program(inner):
        return jax.jit(jax.grad(lambda w, x: jnp.sum(inner(x @ w) ** 2))).lower(
            jnp.ones((8, 8)), jnp.ones((4, 8))
        )

    nested, plain = program(jax.jit(norm)), program(norm)
    # The lowered program calls the inner jit twice: its forward pass (a call whose tuple result
    # XLA prints with /*index=5*/ comments) and its transpose.
    assert (
        hlo.op_counts(nested.as_text(dialect="hlo"))["call"]
        == hlo.op_counts(plain.as_text(dialect="hlo"))["call"] + 2
    )
    assert hlo.op_counts(nested.compile().as_text()) == hlo.op_counts(
        plain.compile().as_text()
    )


def test_dtype_sizes_in_every_spelling():
    # HLO's names, JAX's short ones (print_saved_residuals), numpy's, and the prose's
    for name, size in [("f32", 4), ("pred", 1), ("s32", 4), ("bf16", 2), ("c128", 16)]:
        assert hlo.dtype_bytes(name) == size, name
    for name, size in [("i32", 4), ("bool", 1), ("f8_e4m3fn", 1), ("u8", 1)]:
        assert hlo.dtype_bytes(name) == size, name
    for name, size in [("float32", 4), ("bfloat16", 2), ("int8", 1), ("complex64", 8)]:
        assert hlo.dtype_bytes(name) == size, name
    for name, size in [("fp32", 4), ("fp16", 2), ("fp8", 1)]:
        assert hlo.dtype_bytes(name) == size, name
    with pytest.raises(ValueError, match="unknown HLO element type 's3'"):
        hlo.dtype_bytes("s3")


def test_opcodes_from_instruction_names():
    assert hlo.opcode_of("all-reduce.3") == "all-reduce"
    assert hlo.opcode_of("all-gather-start.1") == "all-gather"
    assert hlo.opcode_of("fusion.2.1") == "fusion"
    assert hlo.split_async("reduce-scatter-done") == ("reduce-scatter", "-done")


def test_group_size_spellings():
    assert hlo.group_size("{{0,1,2},{3,4,5}}") == 3
    assert hlo.group_size("[4,2]<=[2,4]T(1,0)") == 2
    assert (
        hlo.group_size(
            "mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_1','axis_2'}"
        )
        == 8
    )
    assert hlo.group_size("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}") == 8
    assert hlo.group_size("{}") is None


@pytest.mark.parametrize(
    "text, groups",
    [
        ("{{0,1},{2,3}}", [[0, 1], [2, 3]]),
        ("{{0,2,4,6},{1,3,5,7}}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
        ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
        ("mesh['axis_0'=4,'axis_1'=2] {'axis_1'}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ("mesh['a'=2,'b'=2,'c'=2] {'c', 'a'}", [[0, 4, 1, 5], [2, 6, 3, 7]]),
        ("mesh['a'=2,'b'=4] {}", [[0], [1], [2], [3], [4], [5], [6], [7]]),
        # The mesh's devices in another order: an iota ([2,4] transposed, laid out as the 2 x 4 mesh) or a list.
        (
            "mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_1'}",
            [[0, 4, 1, 5], [2, 6, 3, 7]],
        ),
        ("mesh['x'=2,'y'=2], device_ids=(0,2,1,3) {'y'}", [[0, 2], [1, 3]]),
    ],
)
def test_every_spelling(text, groups):
    assert hlo.replica_group_lists(text) == groups


def test_the_groups_agree_with_group_size():
    for text in [
        "{{0,1},{2,3}}",
        "[4,2]<=[2,4]T(1,0)",
        "mesh['axis_0'=4,'axis_1'=2] {'axis_0'}",
        "mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_1'}",
    ]:
        assert {len(g) for g in hlo.replica_group_lists(text)} == {
            hlo.group_size(text)
        }, text


def test_empty_groups_mean_every_device():
    assert hlo.replica_group_lists("{}", num_devices=4) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="pass num_devices"):
        hlo.replica_group_lists("{}")


def test_a_sub_axis_groups_the_devices_along_its_part_of_the_axis():
    # Shardy's 'a':(pre)size: the part of size `size` after `pre` major ones
    assert hlo.replica_group_lists("mesh['a'=4] {'a':(2)2}") == [[0, 1], [2, 3]]
    assert hlo.replica_group_lists("mesh['a'=4] {'a':(1)2}") == [[0, 2], [1, 3]]
    assert hlo.replica_group_lists("mesh['a'=2,'b'=4] {'a','b':(2)2}") == [
        [0, 1, 4, 5],
        [2, 3, 6, 7],
    ]
    # from the recipe's tiny model at --mesh pipeline=2,fsdp=4: ids 0,1,4,5,2,3,6,7
    text = "mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], device_ids=([2,2,2]T(1,0,2)) "
    groups = hlo.replica_group_lists(text + "{'axis_2':(2)2}")
    assert groups == [[0, 1], [4, 5], [2, 3], [6, 7]]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{0,1}",
        "[2,2]<=",
        "mesh['a'=2] {'b'}",
        "mesh['a'=4] {'b':(2)2}",
        "source_target_pairs",
    ],
)
def test_unreadable_groups_are_an_error(text):
    with pytest.raises(ValueError, match="cannot read replica groups"):
        hlo.replica_group_lists(text)


@pytest.mark.parametrize("axis", ["data", "tensor"])
def test_groups_of_a_compiled_psum_are_the_mesh_axis(axis):
    n = jax.device_count()
    if n % 2:
        pytest.skip("needs an even number of devices")
    mesh = jax.make_mesh(
        (n // 2, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2
    )
    x = jax.device_put(
        np.ones((n // 2, 2), np.float32), NamedSharding(mesh, P("data", "tensor"))
    )
    fn = jax.jit(
        jax.shard_map(
            lambda b: jax.lax.psum(b, axis),
            mesh=mesh,
            in_specs=P("data", "tensor"),
            out_specs=P("data", "tensor"),
        )
    )
    [op] = [
        c
        for c in comms.collectives(fn.lower(x).compile().as_text())
        if c.kind == "all-reduce"
    ]
    groups = hlo.replica_group_lists(op.replica_groups, num_devices=n)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    # Positions in the compiled program are the mesh's device order; along `axis`, one group per row/column.
    position = {int(i): k for k, i in enumerate(ids.flat)}
    expected = ids if axis == "tensor" else ids.T
    assert sorted(sorted(g) for g in groups) == sorted(
        sorted(position[int(i)] for i in row) for row in expected
    )


def test_spanned_axes_are_the_axes_a_groups_positions_differ_along():
    shape, names = (2, 2, 3), ("data", "fsdp", "tensor")
    # Position i is (i // 6, i // 3 % 2, i % 3) on a row-major 2 x 2 x 3 mesh.
    assert hlo.spanned_axes([[0, 1, 2], [3, 4, 5]], shape, names) == ("tensor",)
    assert hlo.spanned_axes([[0, 6], [1, 7]], shape, names) == ("data",)
    assert hlo.spanned_axes([[0, 3, 6, 9]], shape, names) == ("data", "fsdp")
    assert hlo.spanned_axes([[4]], shape, names) == ()
