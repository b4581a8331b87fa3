"""Compile examples/lm/train.py's step for several meshes in one process; print JSON.

    python tests/lm_compile_driver.py DEVICES MODEL SEQ_LEN GLOBAL_BATCH CACHE_DIR MESH [MESH ...]

A MESH may carry more of train.py's flags after it, in the same argument
("fsdp=8,tensor=2 --global-batch 64 --grad-accum 4"); they override the common ones.

Used by tests/test_lm_recipe.py, so that JAX starts once for all the meshes. For each mesh,
train.main(["--compile-only", ...]) as the command line runs it: the numbers it prints, read
back by compiled.read_summary (memory per device in GB, bytes per collective kind), and the
all-gather bytes of the same compiled program split by the mesh axes each one's groups span.
"""

import contextlib
import io
import json
import pathlib
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "lm"))

import compiled  # noqa: E402
import layout  # noqa: E402
import train  # noqa: E402

from jaxdist_lessons import profiling  # noqa: E402


def all_gathers_by_axes(text: str, mesh) -> dict[str, int]:
    """All-gather bytes by the mesh axes their groups span, with collective_bytes's loop
    counting (``profiling.collective_bytes_by_axis``)."""
    by_axis = profiling.collective_bytes_by_axis(text, mesh)
    return {
        axes: kinds["all-gather"]
        for axes, kinds in by_axis.items()
        if "all-gather" in kinds
    }


def main():
    _, _, model_name, seq_len, global_batch, cache, *meshes = sys.argv
    texts, collective_bytes = [], compiled.collective_bytes

    def recording(text):  # compile_only's compiled program, kept for the split by axes
        texts.append(text)
        return collective_bytes(text)

    compiled.collective_bytes = recording
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
        summary = compiled.read_summary(printed.getvalue())
        compiled.collective_bytes = collective_bytes
        out[run] = {
            "summary": summary,
            "all_gathers_by_axes": all_gathers_by_axes(
                texts[-1], layout.make_mesh(spec)
            ),
        }
        compiled.collective_bytes = recording
        print(run, json.dumps(out[run]), file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
