"""benchmarks/tpu_overlap.py: which collectives the TPU compiler overlaps with matrix
products, read from the scheduled text. The classifier runs here on hand-written
programs (no libtpu in CI); the JSON of the compiled TPU programs is pinned, and the
share of tensor parallelism's collectives the planner hides on a TPU is the JSON's."""

from __future__ import annotations

import json

import pytest
from by_path import load

from jaxdist_lessons.planning import gpu
from jaxdist_lm import mesh_spec

tpu_overlap = load("tpu_overlap", "benchmarks/tpu_overlap.py")

SIZES = mesh_spec.parse("fsdp=4,tensor=4")  # device i: fsdp i // 4, tensor i % 4

# A -start/-done pair around a matmul fusion, over tensor (ids 0-3 a group), and one
# around elementwise work only, over fsdp (0, 4, 8, 12).
PAIRS = """HloModule step, is_scheduled=true

%matmul (p0: bf16[64,64], p1: bf16[64,64]) -> bf16[64,64] {
  %p0 = bf16[64,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, \
rhs_contracting_dims={0}
}

%double (p0: bf16[64,64]) -> bf16[64,64] {
  %p0 = bf16[64,64]{1,0} parameter(0)
  ROOT %add.1 = bf16[64,64]{1,0} add(%p0, %p0)
}

ENTRY %main (x: bf16[16,64], w: bf16[64,64]) -> (bf16[64,64], bf16[64,64]) {
  %x = bf16[16,64]{1,0} parameter(0)
  %w = bf16[64,64]{1,0} parameter(1)
  %all-gather-start.1 = (bf16[16,64]{1,0}, bf16[64,64]{1,0}) all-gather-start(%x), \
channel_id=1, replica_groups=[4,4]<=[16], dimensions={0}, use_global_device_ids=true
  %fusion.1 = bf16[64,64]{1,0} fusion(%w, %w), kind=kOutput, calls=%matmul
  %all-gather-done.1 = bf16[64,64]{1,0} all-gather-done(%all-gather-start.1)
  %all-gather-start.2 = (bf16[16,64]{1,0}, bf16[64,64]{1,0}) all-gather-start(%x), \
channel_id=2, replica_groups=[4,4]<=[4,4]T(1,0), dimensions={0}, \
use_global_device_ids=true
  %fusion.2 = bf16[64,64]{1,0} fusion(%w), kind=kLoop, calls=%double
  %all-gather-done.2 = bf16[64,64]{1,0} all-gather-done(%all-gather-start.2)
  ROOT %tuple.1 = (bf16[64,64]{1,0}, bf16[64,64]{1,0}) tuple(%all-gather-done.1, \
%all-gather-done.2)
}
"""

# The TPU compiler's own spelling, in a loop of 3 trips: a start fusion (its
# computation ends in AsyncCollectiveStart), a continuation fusion that computes a
# matmul beside the collective's next part, the done fusion; a second start and done
# with nothing between; an all-reduce and a dynamic slice fused into a reduce-scatter;
# and a synchronous all-reduce over both axes.
CONTINUATION = """HloModule step, is_scheduled=true

%start.1 (p0: bf16[16,64]) -> (bf16[16,64], bf16[64,64], u32[]) {
  %p0 = bf16[16,64]{1,0} parameter(0)
  %all-gather.1 = bf16[64,64]{1,0} all-gather(%p0), channel_id=1, \
replica_groups=[4,4]<=[16], dimensions={0}, use_global_device_ids=true
  ROOT %custom-call.1 = (bf16[16,64]{1,0}, bf16[64,64]{1,0}, u32[]) \
custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.1 (p0: bf16[16,64], p1: bf16[64,64], p2: u32[], \
p3: bf16[64,64]) -> (bf16[64,64], bf16[16,64], bf16[64,64], u32[]) {
  %p3 = bf16[64,64]{1,0} parameter(3)
  %convolution.1 = bf16[64,64]{1,0} convolution(%p3, %p3), dim_labels=bf_io->bf
  %p0 = bf16[16,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  %all-gather.2 = bf16[64,64]{1,0} all-gather(%p0), channel_id=1, \
replica_groups=[4,4]<=[16], dimensions={0}, use_global_device_ids=true
  %p2 = u32[] parameter(2)
  ROOT %tuple.2 = (bf16[64,64]{1,0}, bf16[16,64]{1,0}, bf16[64,64]{1,0}, u32[]) \
tuple(%convolution.1, %p0, %all-gather.2, %p2)
}

%done.1 (p0: bf16[16,64], p1: bf16[64,64], p2: u32[]) -> bf16[64,64] {
  %p0 = bf16[16,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  %p2 = u32[] parameter(2)
  ROOT %custom-call.2 = bf16[64,64]{1,0} custom-call(%p0, %p1, %p2), \
custom_call_target="AsyncCollectiveDone"
}

%start.2 (p0: bf16[64,16]) -> (bf16[64,16], bf16[64,64], u32[]) {
  %p0 = bf16[64,16]{1,0} parameter(0)
  %all-gather.3 = bf16[64,64]{1,0} all-gather(%p0), channel_id=2, \
replica_groups=[4,4]<=[4,4]T(1,0), dimensions={1}, use_global_device_ids=true
  ROOT %custom-call.3 = (bf16[64,16]{1,0}, bf16[64,64]{1,0}, u32[]) \
custom-call(%all-gather.3), custom_call_target="AsyncCollectiveStart"
}

%done.2 (p0: bf16[64,16], p1: bf16[64,64], p2: u32[]) -> bf16[64,64] {
  %p0 = bf16[64,16]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  %p2 = u32[] parameter(2)
  ROOT %custom-call.4 = bf16[64,64]{1,0} custom-call(%p0, %p1, %p2), \
custom_call_target="AsyncCollectiveDone"
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.2 = f32[] add(%a, %b)
}

%all-reduce-scatter.1 (p0: f32[64,64], p1: s32[]) -> f32[16,64] {
  %p0 = f32[64,64]{1,0} parameter(0)
  %all-reduce.1 = f32[64,64]{1,0} all-reduce(%p0), channel_id=3, \
replica_groups=[4,4]<=[16], use_global_device_ids=true, to_apply=%sum
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %dynamic-slice.1 = f32[16,64]{1,0} dynamic-slice(%all-reduce.1, %p1, %zero), \
dynamic_slice_sizes={16,64}
}

%body (p: (s32[], bf16[16,64], bf16[64,16], bf16[64,64], f32[64,64])) -> \
(s32[], bf16[16,64], bf16[64,16], bf16[64,64], f32[64,64]) {
  %p = (s32[], bf16[16,64]{1,0}, bf16[64,16]{1,0}, bf16[64,64]{1,0}, f32[64,64]{1,0}) \
parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[16,64]{1,0} get-tuple-element(%p), index=1
  %y = bf16[64,16]{1,0} get-tuple-element(%p), index=2
  %w = bf16[64,64]{1,0} get-tuple-element(%p), index=3
  %g = f32[64,64]{1,0} get-tuple-element(%p), index=4
  %async-collective-start.1 = (bf16[16,64]{1,0}, bf16[64,64]{1,0}, u32[]) fusion(%x), \
kind=kCustom, calls=%start.1
  %get-tuple-element.1 = bf16[16,64]{1,0} get-tuple-element(\
%async-collective-start.1), index=0
  %get-tuple-element.2 = bf16[64,64]{1,0} get-tuple-element(\
%async-collective-start.1), index=1
  %get-tuple-element.3 = u32[] get-tuple-element(%async-collective-start.1), index=2
  %fusion.1 = (bf16[64,64]{1,0}, bf16[16,64]{1,0}, bf16[64,64]{1,0}, u32[]) \
fusion(%get-tuple-element.1, %get-tuple-element.2, %get-tuple-element.3, %w), \
kind=kOutput, calls=%async_collective_fusion.1
  %get-tuple-element.4 = bf16[16,64]{1,0} get-tuple-element(%fusion.1), index=1
  %get-tuple-element.5 = bf16[64,64]{1,0} get-tuple-element(%fusion.1), index=2
  %get-tuple-element.6 = u32[] get-tuple-element(%fusion.1), index=3
  %async-collective-done.1 = bf16[64,64]{1,0} fusion(%get-tuple-element.4, \
%get-tuple-element.5, %get-tuple-element.6), kind=kCustom, calls=%done.1
  %async-collective-start.2 = (bf16[64,16]{1,0}, bf16[64,64]{1,0}, u32[]) fusion(%y), \
kind=kCustom, calls=%start.2
  %get-tuple-element.7 = bf16[64,16]{1,0} get-tuple-element(\
%async-collective-start.2), index=0
  %get-tuple-element.8 = bf16[64,64]{1,0} get-tuple-element(\
%async-collective-start.2), index=1
  %get-tuple-element.9 = u32[] get-tuple-element(%async-collective-start.2), index=2
  %async-collective-done.2 = bf16[64,64]{1,0} fusion(%get-tuple-element.7, \
%get-tuple-element.8, %get-tuple-element.9), kind=kCustom, calls=%done.2
  %scattered = f32[16,64]{1,0} fusion(%g, %i), kind=kLoop, calls=%all-reduce-scatter.1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %tuple.3 = (s32[], bf16[16,64]{1,0}, bf16[64,16]{1,0}, bf16[64,64]{1,0}, \
f32[64,64]{1,0}) tuple(%next, %x, %y, %async-collective-done.1, %g)
}

%condition (p: (s32[], bf16[16,64], bf16[64,16], bf16[64,64], f32[64,64])) -> pred[] {
  %p = (s32[], bf16[16,64]{1,0}, bf16[64,16]{1,0}, bf16[64,64]{1,0}, f32[64,64]{1,0}) \
parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %three = s32[] constant(3)
  ROOT %lt.1 = pred[] compare(%i, %three), direction=LT
}

ENTRY %main (s: (s32[], bf16[16,64], bf16[64,16], bf16[64,64], f32[64,64]), \
v: f32[8]) -> f32[8] {
  %s = (s32[], bf16[16,64]{1,0}, bf16[64,16]{1,0}, bf16[64,64]{1,0}, f32[64,64]{1,0}) \
parameter(0)
  %while.1 = (s32[], bf16[16,64]{1,0}, bf16[64,16]{1,0}, bf16[64,64]{1,0}, \
f32[64,64]{1,0}) while(%s), condition=%condition, body=%body
  %v = f32[8]{0} parameter(1)
  ROOT %all-reduce.2 = f32[8]{0} all-reduce(%v), channel_id=4, replica_groups={}, \
use_global_device_ids=true, to_apply=%sum
}
"""


# A pair around a loop of matmuls (a collective matmul's loop is one: compute), whose
# counter starts at 1 (its first trip peeled off) and stops before 8: 7 trips, each
# with a permute around the ring of tensor's first group, beside the loop's matmul.
LOOP = """HloModule step, is_scheduled=true

%body (p: (u32[], bf16[64,64])) -> (u32[], bf16[64,64]) {
  %p = (u32[], bf16[64,64]{1,0}) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %w = bf16[64,64]{1,0} get-tuple-element(%p), index=1
  %collective-permute-start.1 = (bf16[64,64]{1,0}, bf16[64,64]{1,0}, u32[], u32[]) \
collective-permute-start(%w), channel_id=2, \
source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %dot.1 = bf16[64,64]{1,0} dot(%w, %w), lhs_contracting_dims={1}, \
rhs_contracting_dims={0}
  %collective-permute-done.1 = bf16[64,64]{1,0} collective-permute-done(\
%collective-permute-start.1)
  %one = u32[] constant(1)
  %next = u32[] add(%i, %one)
  ROOT %tuple.1 = (u32[], bf16[64,64]{1,0}) tuple(%next, %dot.1)
}

%condition (p: (u32[], bf16[64,64])) -> pred[] {
  %p = (u32[], bf16[64,64]{1,0}) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %eight = u32[] constant(8)
  ROOT %lt.1 = pred[] compare(%i, %eight), direction=LT
}

ENTRY %main (x: bf16[16,64], w: bf16[64,64]) -> bf16[64,64] {
  %x = bf16[16,64]{1,0} parameter(0)
  %w = bf16[64,64]{1,0} parameter(1)
  %all-gather-start.1 = (bf16[16,64]{1,0}, bf16[64,64]{1,0}) all-gather-start(%x), \
channel_id=1, replica_groups=[4,4]<=[16], dimensions={0}, use_global_device_ids=true
  %one = u32[] constant(1)
  %first = u32[] copy(%one)
  %start = (u32[], bf16[64,64]{1,0}) tuple(%first, %w)
  %while.1 = (u32[], bf16[64,64]{1,0}) while(%start), condition=%condition, body=%body
  ROOT %all-gather-done.1 = bf16[64,64]{1,0} all-gather-done(%all-gather-start.1)
}
"""


def summary(text: str) -> list[tuple]:
    return [
        (c.kind, c.bytes, c.group, c.axes, c.asynchronous, c.overlapped)
        for c in tpu_overlap.classify(text, SIZES)
    ]


def test_a_pair_with_a_matmul_between_is_overlapped_and_one_without_is_not():
    # each all-gather's result: bf16[64,64], 8,192 bytes (the -done's, not the -start's)
    assert summary(PAIRS) == [
        ("all-gather", 8192, 4, ("tensor",), True, True),
        ("all-gather", 8192, 4, ("fsdp",), True, False),
    ]


def test_the_tpu_compilers_start_continuation_and_done_fusions():
    # the entry's first, then the loop's: three trips, each of its collectives thrice
    assert summary(CONTINUATION) == [
        ("all-reduce", 32, 16, ("fsdp", "tensor"), False, False),
        ("all-gather", 3 * 8192, 4, ("tensor",), True, True),
        ("all-gather", 3 * 8192, 4, ("fsdp",), True, False),
        ("reduce-scatter", 3 * 4096, 4, ("tensor",), False, False),
    ]


def test_a_loop_of_matmuls_overlaps_and_a_peeled_loop_runs_one_trip_less():
    # a permute's result is its buffer: 8,192 bytes, 7 times
    assert summary(LOOP) == [
        ("all-gather", 8192, 4, ("tensor",), True, True),
        ("collective-permute", 7 * 8192, None, ("tensor",), True, True),
    ]


def test_bytes_by_axis_in_all_asynchronous_overlapped_and_sent():
    axes = tpu_overlap.by_axis(tpu_overlap.classify(CONTINUATION, SIZES))
    # a ring sends 3/4 of a gathered array, and 3/4 of the array a shard comes from
    assert axes["tensor"] == {
        "bytes": 24576 + 12288,
        "async": 24576,
        "overlapped": 24576,
        "sent": 18432 + 36864,
        "sent_overlapped": 18432,
        "count": 2,
        "kinds": {
            "all-gather": {"sent": 18432, "sent_overlapped": 18432},
            "reduce-scatter": {"sent": 36864, "sent_overlapped": 0},
        },
    }
    assert axes["fsdp"]["overlapped"] == 0 < axes["fsdp"]["async"] == 24576
    # an all-reduce's ring sends 2 (N - 1) / N of it
    assert axes["fsdp,tensor"]["sent"] == 60


def test_group_axes_reads_a_devices_mesh_position():
    assert tpu_overlap.group_axes([[0, 1, 2, 3]], SIZES) == ("tensor",)
    assert tpu_overlap.group_axes([[1, 5, 9, 13]], SIZES) == ("fsdp",)
    assert tpu_overlap.group_axes([[0, 5]], SIZES) == ("fsdp", "tensor")
    assert tpu_overlap.group_axes([[7]], SIZES) == ()


@pytest.fixture(scope="module")
def data() -> dict:
    return json.loads(tpu_overlap.OUT.read_text())


def share(row: dict, axis: str) -> float:
    """The share of the bytes a device sends over ``axis`` that compute overlaps."""
    sums = row["axes"][axis]
    return sums["sent_overlapped"] / sums["sent"]


def test_the_json_says_what_was_compiled(data):
    assert data["meta"]["libtpu_version"] == "0.0.42.1"
    assert data["meta"]["run"] == tpu_overlap.RUN
    keys = ("name", "model", "topology", "mesh", "flags")
    assert [tuple(r[k] for k in keys) for r in data["rows"]] == tpu_overlap.CASES


def test_fsdp_alone_hides_its_collectives_tensor_parallelism_mostly_waits(data):
    """Of the bytes a device sends over each axis, the share a matmul overlaps."""
    shares = {
        row["name"]: {axis: round(share(row, axis), 2) for axis in row["axes"]}
        for row in data["rows"]
    }
    assert shares == {
        "v5e, tensor": {"fsdp": 0.58, "fsdp,tensor": 0.8, "tensor": 0.18},
        "v5e, tensor, MaxText's flags": {
            "fsdp": 0.58,
            "fsdp,tensor": 0.8,
            "tensor": 0.18,
        },
        "v5e, FSDP alone": {"fsdp": 0.87},
        "v5p, tensor": {"fsdp": 0.37, "fsdp,tensor": 0.8, "tensor": 0.0},
        "v5p, tensor, MaxText's flags": {
            "fsdp": 0.56,
            "fsdp,tensor": 0.8,
            "tensor": 0.26,
        },
        "v5e, tensor, 8b, MaxText's flags": {
            "fsdp": 0.66,
            "fsdp,tensor": 0.0,
            "tensor": 0.37,
        },
        "v5p, tensor, 8b, MaxText's flags": {
            "fsdp": 0.64,
            "fsdp,tensor": 0.0,
            "tensor": 0.18,
        },
    }
    tensor = data["rows"][-2]["axes"]["tensor"]
    assert (tensor["sent"], tensor["sent_overlapped"]) == (
        19_025_780_784,
        7_046_430_720,
    )


def test_every_reduce_scatter_over_tensor_is_waited_for(data):
    """What the compiler overlaps over `tensor` is all-gathers and permutes (a matmul
    cut into sends beside its parts), never the reduce-scatters."""
    for row in data["rows"]:
        kinds = row["axes"].get("tensor", {"kinds": {}})["kinds"]
        hidden = {kind for kind, sums in kinds.items() if sums["sent_overlapped"]}
        assert hidden <= {"all-gather", "collective-permute"}, row["name"]
        if kinds:
            assert kinds["reduce-scatter"]["sent"] > 0, row["name"]


def test_maxtexts_flags_are_libtpus_defaults_on_a_v5e_not_on_a_v5p(data):
    rows = {row["name"]: row for row in data["rows"]}
    sha = {name: row["program_sha256"] for name, row in rows.items()}
    assert sha["v5e, tensor"] == sha["v5e, tensor, MaxText's flags"]
    assert sha["v5p, tensor"] != sha["v5p, tensor, MaxText's flags"]


def test_the_planner_hides_the_8b_models_share_on_each_tpu(data):
    rows = {row["name"]: row for row in data["rows"]}
    compiled = {
        "TPU v5e": round(share(rows["v5e, tensor, 8b, MaxText's flags"], "tensor"), 2),
        "TPU v5p": round(share(rows["v5p, tensor, 8b, MaxText's flags"], "tensor"), 2),
    }
    assert gpu.TPU_TENSOR_OVERLAP == compiled == {"TPU v5e": 0.37, "TPU v5p": 0.18}
