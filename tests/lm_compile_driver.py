"""Compile jaxdist_lm/train.py's step for several meshes in one process; print JSON.

    python tests/lm_compile_driver.py DEVICES MODEL SEQ_LEN GLOBAL_BATCH CACHE_DIR MESH [MESH ...]

A MESH may carry more of train.py's flags after it, in the same argument
("fsdp=8,tensor=2 --global-batch 64 --grad-accum 4"); they override the common ones.

Used by tests/test_lm_recipe.py, so that JAX starts once for all the meshes, and by
tests/test_lm_compiled.py for TPU slices (--topology, with libtpu on PYTHONPATH). For each
mesh, train.main(["--compile-only", ...]) as the command line runs it: what it prints, and
read back by compiled.read_summary (memory per device in GB, bytes per collective kind);
the same compiled program's bytes split by the mesh axes each collective's groups span,
and its Pallas kernels (the TPU compiler's tpu_custom_call: Mosaic's, not interpreted).
"""

import contextlib
import io
import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))

from jaxdist_lessons import profiling  # noqa: E402
from jaxdist_lm import (  # noqa: E402
    compiled,
    train,
)


def main():
    _, _, model_name, seq_len, global_batch, cache, *meshes = sys.argv
    programs, collective_bytes = [], compiled.collective_bytes
    compile_only = train.compile_only

    def recording(step, shapes, args, mesh, *rest):  # the program and its mesh, kept
        def counting(text):
            programs.append((text, mesh))
            return collective_bytes(text)

        compiled.collective_bytes = counting
        try:
            return compile_only(step, shapes, args, mesh, *rest)
        finally:
            compiled.collective_bytes = collective_bytes

    train.compile_only = recording
    out = {}
    for run in meshes:
        spec, *flags = run.split()
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            train.main(
                [
                    "--model",
                    model_name,
                    "--mesh",
                    spec,
                    "--seq-len",
                    seq_len,
                    "--global-batch",
                    global_batch,
                    "--compilation-cache",
                    cache,
                    "--compile-only",
                    *flags,
                ]
            )
        text, mesh = programs[0]  # the step's (an evaluation step's comes after)
        programs.clear()
        by_axis = profiling.collective_bytes_by_axis(text, mesh)
        out[run] = {
            "printed": printed.getvalue(),
            "summary": compiled.read_summary(printed.getvalue()),
            "by_axis": by_axis,
            "all_gathers_by_axes": {
                axes: kinds["all-gather"]
                for axes, kinds in by_axis.items()
                if "all-gather" in kinds
            },
            "tpu_kernels": text.count('custom_call_target="tpu_custom_call"'),
        }
        print(run, json.dumps(out[run]["summary"]), file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
