"""jaxdist_lm/compiled.py: the bytes a compiled step sends, read from programs in the forms
XLA:CPU and the TPU compiler write them, and train.py --topology, which compiles the step
for TPU slices that are not here (libtpu, requirements-libtpu.txt; no TPU)."""

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from jaxdist_lm import compiled as lm_compiled
from jaxdist_lm import train

ROOT = pathlib.Path(__file__).resolve().parents[1]
# libtpu takes its lock file (/tmp/libtpu_lockfile) even to compile with no TPU, so a
# second libtpu process (a benchmark, another test run) would stop these tests; this
# variable lets it load beside another (jax-ml/jax#13043). Under pytest-xdist the
# tests that use libtpu share one worker (tests/conftest.py).

# A loop in the TPU compiler's form, trimmed from tests/lm_compile_driver.py's program for
# 2 x v5e:2x2: no known_trip_count in the loop's backend_config; the condition compares
# the counter with 4, and the counter starts at 1 (the first trip was peeled into the
# code before the loop). Each trip sends a gradient over the data-center network and
# all-gathers a weight, which the fusion that overlaps it with compute writes again (an
# echo); after the loop, an async permute ((operand, output, ...)) and a reduce-scatter
# in the TPU's form (an all-reduce in a fusion that keeps a device's slice).
TPU_PROGRAM = """\
HloModule jit_train_step, is_scheduled=true

%region_16.cond (param: (s32[], f32[8,128])) -> pred[] {
  %constant.315 = s32[]{:T(128)} constant(4)
  %param = (s32[]{:T(128)}, f32[8,128]{1,0:T(8,128)}) parameter(0)
  %get-tuple-element.1521 = s32[]{:T(128)} get-tuple-element(%param), index=0
  ROOT %lt.42 = pred[]{:T(512)} compare(%get-tuple-element.1521, %constant.315), direction=LT
}

%async_collective_fusion.481 (param_0.1473: f32[8,128]) -> bf16[2,64,192] {
  %param_0.1473 = f32[8,128]{1,0:T(8,128)} parameter(0)
  ROOT %all-gather.118 = bf16[2,64,192]{2,0,1:T(2,128)(2,1)} all-gather(%param_0.1473), channel_id=3, replica_groups={{0,1},{2,3}}, dimensions={0}, use_global_device_ids=true
}

%all-reduce-scatter.17 (input.24: s32[2,256,1]) -> s32[1,256,1] {
  %input.24 = s32[2,256,1]{1,0,2:T(2,128)} parameter(0)
  %all-reduce.245 = s32[2,256,1]{1,0,2:T(2,128)} all-reduce(%input.24), channel_id=11, replica_groups={{0,1},{2,3}}, use_global_device_ids=true, to_apply=%add.1
  %constant.1540 = s32[] constant(0)
  ROOT %dynamic-slice.608 = s32[1,256,1]{1,0,2:T(2,128)} dynamic-slice(%all-reduce.245, %constant.1540, %constant.1540, %constant.1540), dynamic_slice_sizes={1,256,1}
}

%region_8.body (param.1: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {
  %param.1 = (s32[]{:T(128)}, f32[8,128]{1,0:T(8,128)}) parameter(0)
  %get-tuple-element.2 = f32[8,128]{1,0:T(8,128)} get-tuple-element(%param.1), index=1
  %all-gather.329 = bf16[2,64,192]{2,0,1:T(2,128)(2,1)} all-gather(%get-tuple-element.2), channel_id=3, replica_groups={{0,1},{2,3}}, dimensions={0}, use_global_device_ids=true
  %fusion.481 = bf16[2,64,192]{2,0,1:T(2,128)(2,1)} fusion(%get-tuple-element.2), kind=kOutput, calls=%async_collective_fusion.481
  %after-all.22 = token[] after-all()
  %send.22 = (f32[40,8,128]{2,1,0:T(8,128)}, u32[], token[]) send(%get-tuple-element.2, %after-all.22), channel_id=10, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_reduce_operation="SUM",_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}
  %get-tuple-element.3 = s32[]{:T(128)} get-tuple-element(%param.1), index=0
  ROOT %tuple.9 = (s32[]{:T(128)}, f32[8,128]{1,0:T(8,128)}) tuple(%get-tuple-element.3, %get-tuple-element.2)
}

ENTRY %main.38_spmd (param.2: f32[8,128]) -> f32[8,128] {
  %param.2 = f32[8,128]{1,0:T(8,128)} parameter(0)
  %constant.316 = s32[]{:T(128)} constant(1)
  %copy.709 = s32[]{:T(128)} copy(%constant.316)
  %tuple.234 = (s32[]{:T(128)}, f32[8,128]{1,0:T(8,128)}) tuple(%copy.709, %param.2)
  %while.47 = (s32[]{:T(128)}, f32[8,128]{1,0:T(8,128)}) while(%tuple.234), condition=%region_16.cond, body=%region_8.body
  %collective-permute-start = (s32[2,256,1]{1,0,2:T(2,128)}, s32[2,256,1]{1,0,2:T(2,128)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%param.2), channel_id=78, source_target_pairs={{0,0},{1,2},{2,1},{3,3}}
  %collective-permute-done = s32[2,256,1]{1,0,2:T(2,128)} collective-permute-done(%collective-permute-start)
  %fusion.479 = s32[1,256,1]{1,0,2:T(2,128)} fusion(%collective-permute-done), kind=kCustom, calls=%all-reduce-scatter.17
  ROOT %get-tuple-element.9 = f32[8,128]{1,0:T(8,128)} get-tuple-element(%while.47), index=1
}
"""


def test_a_tpu_loop_counts_from_its_condition_and_its_first_count():
    """3 trips: i from 1 while i < 4. XLA:CPU's form says it outright."""
    assert lm_compiled.loop_trips(TPU_PROGRAM) == {"while.47": 3}
    cpu = TPU_PROGRAM.replace(
        "body=%region_8.body",
        'body=%region_8.body, backend_config={"known_trip_count":{"n":"5"}}',
    )
    assert lm_compiled.loop_trips(cpu) == {"while.47": 5}


def test_collective_bytes_in_the_tpu_compilers_form():
    """Each trip's all-gather (its output, once: not its echo) and send over the
    data-center network (its operand), times 3; the async permute once, by its output
    alone; the TPU's reduce-scatter (an all-reduce, then a slice) by its slice."""
    assert lm_compiled.collective_bytes(TPU_PROGRAM) == {
        "all-gather": 3 * 2 * 64 * 192 * 2,
        "dcn-all-reduce": 3 * 40 * 8 * 128 * 4,
        "collective-permute": 2 * 256 * 4,
        "reduce-scatter": 1 * 256 * 4,
    }


def test_topology_flags_that_cannot_work_stop_in_one_line():
    """--topology compiles and runs nothing; --slices belongs to it; without libtpu (as
    here: requirements.txt leaves it out) it says what to install."""
    for flags, message in [
        (["--topology", "v5e:2x2"], "^--topology compiles for chips that are not here"),
        (["--slices", "2"], "^--slices needs --topology: the slices to compile for$"),
        (["--slices", "0", "--topology", "v5e:2x2"], "^--slices 0: give 1 or more$"),
        (
            ["--topology", "v5e:2x2", "--compile-only"],
            rf"^--topology needs libtpu, the TPU compiler \(no TPU needed\), in a "
            rf"folder of its own: pip install --target DIR libtpu, of the version "
            rf"jax\[tpu\]=={jax.__version__} asks for, then PYTHONPATH=DIR; JAX said: ",
        ),
    ]:
        with pytest.raises(SystemExit, match=message):
            train.target_devices(train.parse_args(["--model", "tiny", *flags]))


def test_the_step_compiled_for_two_tpu_slices_without_a_tpu(libtpu, tmp_path):
    """The tiny model on 2 x v5e:2x2 (data=2 across the slices, fsdp=2 x tensor=2 inside
    each), compiled by libtpu in a subprocess: the TPU compiler's buffer assignment,
    splash attention as Mosaic kernels (forward and backward; not interpreted, as off a
    TPU), and the gradients' reduction across the slices as sends over the data-center
    network, the only traffic on `data`: each device's float32 gradient shard, padded to
    the TPU's (8, 128) tiles (10% more here), and no ICI collective on that axis."""
    run = "data=2,fsdp=2,tensor=2 --topology v5e:2x2 --slices 2 --attention splash"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["PYTHONPATH"] = os.pathsep.join([str(libtpu), str(ROOT)])
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    result = subprocess.run(
        [
            sys.executable,
            "tests/lm_compile_driver.py",
            *("1", "tiny", "256", "8", str(tmp_path)),
            run,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])[run]
    assert out["printed"].startswith(
        "compiled tiny on data=2,fsdp=2,tensor=2 in "
    ) and out["printed"].splitlines()[0].endswith(
        "s (TPU v5 lite: the TPU compiler's buffer assignment, for 2 x v5e:2x2 with no "
        "chip here)"
    )
    assert out["tpu_kernels"] >= 2
    assert set(out["by_axis"]["data"]) == {"dcn-all-reduce"}
    assert not any(
        k.startswith("dcn-")
        for a, kinds in out["by_axis"].items()
        if a != "data"
        for k in kinds
    )
    args = train.parse_args(
        ["--model", "tiny", "--mesh", "data=2,fsdp=2,tensor=2", "--seq-len", "256"]
    )
    _, _, _, _, shapes, _ = train.setup(args, jax.devices()[:8])
    gradients = sum(
        4 * math.prod(x.sharding.shard_shape(x.shape))
        for x in jax.tree.leaves(shapes.params)
    )
    sent = out["by_axis"]["data"]["dcn-all-reduce"]
    assert gradients <= sent <= 1.25 * gradients, (sent, gradients)


def test_a_step_too_big_for_the_slice_stops_as_it_would_on_the_slice(libtpu):
    """8b on a v5e 2x2 (4 chips of 16 GB): the TPU compiler refuses the program, and
    train.py says so in one line with the compiler's words, status 2, as on a TPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["PYTHONPATH"] = os.pathsep.join([str(libtpu), str(ROOT)])
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    flags = "--model 8b --mesh fsdp=4 --seq-len 2048 --global-batch 4 --dtype bfloat16"
    done = subprocess.run(
        [sys.executable, "-m", "jaxdist_lm.train", *flags.split()]
        + ["--compile-only", "--topology", "v5e:2x2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    said = done.stderr.strip().splitlines()[-1]
    assert said.startswith("out of memory: the step needs "), said
    assert "[RESOURCE_EXHAUSTED: Ran out of memory on HBM" in said
    assert "Traceback" not in done.stderr
