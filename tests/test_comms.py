"""comms reads collectives from compiled programs: hand-written snippets of each kind, and real ones."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms

N = jax.device_count()

SNIPPETS = """
HloModule jit_step, entry_computation_layout={(f32[16,8]{1,0})->f32[16,8]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %g = f32[4]{0} get-tuple-element(%p), index=1
  %in-loop = f32[4]{0} all-reduce(%g), channel_id=9, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %in-loop)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[16,8], b: bf16[2,2]) -> f32[16,8] {
  %ar = f32[16,8]{1,0} all-reduce(%a), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %tuple-ar = (f32[3]{0}, bf16[2,2]{1,0}, /*index=2*/f32[10]{0}) all-reduce(%x, %b, %z), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %ag = f32[64,8]{1,0} all-gather(%a), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
  %rs = f32[2,8]{1,0} reduce-scatter(%a), channel_id=4, replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_1'}, dimensions={0}, to_apply=%add
  %a2a = (f32[2,2]{1,0}, f32[2,2]{1,0}) all-to-all(%s0, %s1), channel_id=5, replica_groups={{0,1}}
  %ar-mesh = f32[6]{0} all-reduce(%v), channel_id=10, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  %cp = f32[2,8]{1,0} collective-permute(%a), channel_id=6, source_target_pairs={{0,1},{1,0}}
  %ars = f32[5]{0} all-reduce-start(%q), channel_id=7, replica_groups={{0,1}}, to_apply=%add
  %ard = f32[5]{0} all-reduce-done(%ars)
  %ags = (f32[1,8]{1,0}, f32[4,8]{1,0}) all-gather-start(%r), channel_id=8, replica_groups={{0,1,2,3}}, dimensions={0}
  %agd = f32[4,8]{1,0} all-gather-done(%ags)
  %loop = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  %f = f32[16,8]{1,0} fusion(%a), kind=kLoop, calls=%add, metadata={op_name="not all-reduce(x)"}
  ROOT %out = f32[16,8]{1,0} copy(%ar)
}
"""


def test_hand_written_snippets_of_every_kind():
    found = {c.name: c for c in comms.collectives(SNIPPETS)}
    assert list(found) == [
        "in-loop",
        "ar",
        "tuple-ar",
        "ag",
        "rs",
        "a2a",
        "ar-mesh",
        "cp",
        "ard",
        "agd",
    ]
    expected = {  # kind, dtype, elements, bytes, group size, in a loop
        "in-loop": ("all-reduce", "f32", 4, 16, 2, True),
        "ar": ("all-reduce", "f32", 128, 512, 4, False),
        "tuple-ar": ("all-reduce", "f32,bf16", 3 + 4 + 10, 12 + 8 + 40, 8, False),
        "ag": ("all-gather", "f32", 512, 2048, 4, False),
        "rs": ("reduce-scatter", "f32", 16, 64, 4, False),
        "a2a": ("all-to-all", "f32", 8, 32, 2, False),
        "ar-mesh": ("all-reduce", "f32", 6, 24, 4, False),
        "cp": ("collective-permute", "f32", 16, 64, None, False),
        "ard": ("all-reduce", "f32", 5, 20, 2, False),
        "agd": ("all-gather", "f32", 32, 128, 4, False),
    }
    for name, (kind, dtype, elements, nbytes, group, in_loop) in expected.items():
        c = found[name]
        assert (c.kind, c.dtype, c.elements, c.bytes, c.group_size, c.in_loop) == (
            kind,
            dtype,
            elements,
            nbytes,
            group,
            in_loop,
        ), name
    assert found["tuple-ar"].shapes == (("f32", (3,)), ("bf16", (2, 2)), ("f32", (10,)))
    assert (
        found["rs"].replica_groups
        == "mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_1'}"
    )
    assert found["ar-mesh"].replica_groups == "mesh['axis_0'=4,'axis_1'=2] {'axis_0'}"
    assert found["cp"].replica_groups == "{{0,1},{1,0}}"


def test_totals_and_summary():
    assert comms.total_bytes(SNIPPETS, "all-reduce") == 16 + 512 + 60 + 24 + 20
    assert (
        comms.total_bytes(SNIPPETS)
        == 16 + 512 + 60 + 24 + 20 + 2048 + 128 + 64 + 32 + 64
    )
    assert comms.summary(SNIPPETS)["all-reduce"] == {
        "count": 5,
        "in_loop": 1,
        "bytes": 632,
    }
    assert comms.bytes_by_kind(SNIPPETS)["all-reduce"] == 632
    assert comms.summary(SNIPPETS)["all-gather"] == {
        "count": 2,
        "in_loop": 0,
        "bytes": 2176,
    }
    with pytest.raises(
        ValueError,
        match="unknown collective kind 'allreduce'; allowed: all-reduce, all-gather",
    ):
        comms.total_bytes(SNIPPETS, "allreduce")


def test_unknown_element_types_are_not_counted_as_zero_bytes():
    with pytest.raises(
        ValueError,
        match="unknown HLO element type 's3' .*add its size to hlo.DTYPE_BYTES",
    ):
        comms.collectives(
            "ENTRY %m () -> s3[4] {\n  %a = s3[4]{0} all-reduce(%x), replica_groups={{0,1}}\n}"
        )


def sm(f, mesh, in_specs, out_specs):
    return jax.jit(
        jax.shard_map(
            f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
    )


def test_real_programs_of_each_kind():
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.ones((4 * N, 8)), NamedSharding(mesh, P("data")))
    full = jax.device_put(jnp.ones((4 * N, 8)), NamedSharding(mesh, P()))
    square = jax.device_put(jnp.ones((4 * N, 4 * N)), NamedSharding(mesh, P("data")))
    cases = [
        (
            sm(lambda a: jax.lax.psum(a, "data"), mesh, P("data"), P("data")),
            x,
            "all-reduce",
            4 * 8 * 4,
        ),
        (
            sm(
                lambda a: jax.lax.all_gather(a, "data", tiled=True),
                mesh,
                P("data"),
                P(),
            ),
            x,
            "all-gather",
            4 * N * 8 * 4,
        ),
        (
            sm(
                lambda a: jax.lax.psum_scatter(a, "data", tiled=True),
                mesh,
                P(),
                P("data"),
            ),
            full,
            "reduce-scatter",
            4 * 8 * 4,
        ),
        (
            sm(
                lambda a: jax.lax.all_to_all(a, "data", 1, 0, tiled=True),
                mesh,
                P("data"),
                P("data"),
            ),
            square,
            "all-to-all",
            4 * 4 * N * 4,
        ),
        (
            sm(
                lambda a: jax.lax.ppermute(
                    a, "data", [(i, (i + 1) % N) for i in range(N)]
                ),
                mesh,
                P("data"),
                P("data"),
            ),
            x,
            "collective-permute",
            4 * 8 * 4,
        ),
    ]
    for fn, arg, kind, nbytes in cases:
        found = comms.collectives(comms.compiled_text(fn, arg))
        assert [c.kind for c in found] == [kind], kind
        assert found[0].bytes == nbytes, kind
        assert found[0].group_size == (None if kind == "collective-permute" else N), (
            kind
        )


def test_all_reduce_in_a_scan_body_is_in_a_loop():
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.ones((4 * N, 8)), NamedSharding(mesh, P("data")))

    def accumulate(a):
        def body(carry, _):
            carry = carry * 0.5 + a
            return carry + jax.lax.psum(carry, "data"), None

        return jax.lax.scan(body, jnp.zeros_like(a), None, length=3)[0]

    found = comms.collectives(
        comms.compiled_text(sm(accumulate, mesh, P("data"), P("data")), x)
    )
    assert [(c.kind, c.in_loop) for c in found] == [("all-reduce", True)]


def test_analytic_bytes():
    params = {"w": jnp.zeros((10, 20)), "b": jnp.zeros(20, jnp.bfloat16)}
    assert comms.tree_bytes(params) == 800 + 40 == comms.data_parallel_bytes(params)
    assert comms.tree_bytes(jax.eval_shape(lambda: params)) == 840
    assert comms.ring_all_reduce_bytes(800, 8) == 1400
    assert comms.ring_all_reduce_bytes(800, 1) == 0
    assert (
        comms.ring_all_gather_bytes(800, 4)
        == 600
        == comms.ring_reduce_scatter_bytes(800, 4)
    )
    with pytest.raises(
        ValueError, match="num_devices must be a positive integer, got 0"
    ):
        comms.ring_all_reduce_bytes(800, 0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_ring_schedule_really_all_reduces_and_sends_2_n_minus_1_over_n(n):
    schedule = comms.ring_all_reduce_schedule(n)
    # held[d][c]: the set of devices whose chunk c is summed into device d's copy
    held = [[{d} for _ in range(n)] for d in range(n)]
    sent = [0] * n
    for src_dst_chunk in schedule["reduce-scatter"]:
        snapshot = [[set(c) for c in row] for row in held]
        for src, dst, chunk in src_dst_chunk:
            # never add a contribution twice
            assert snapshot[src][chunk].isdisjoint(held[dst][chunk])
            held[dst][chunk] |= snapshot[src][chunk]
            sent[src] += 1
    for d in range(n):
        assert held[d][(d + 1) % n] == set(range(n))
    for src_dst_chunk in schedule["all-gather"]:
        snapshot = [[set(c) for c in row] for row in held]
        for src, dst, chunk in src_dst_chunk:
            assert snapshot[src][chunk] == set(range(n))  # only finished chunks travel
            held[dst][chunk] = snapshot[src][chunk]
            sent[src] += 1
    assert all(chunk == set(range(n)) for row in held for chunk in row)
    nbytes = 1000.0 * n
    assert all(
        count * nbytes / n == comms.ring_all_reduce_bytes(nbytes, n) for count in sent
    )
