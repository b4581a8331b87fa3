"""What every ``pytest`` run here sets before anything imports JAX: ``pytest`` (the
tests and the chapters), ``pytest book/`` (the chapters alone, as CI runs them again on
6 devices) and ``pytest tests/...``. pytest reads this file whatever it collects; the
conftest.py of tests/ or book/ only when it collects there.
"""

import os
import pathlib

# Compiled programs are kept in _build/jax_cache, as the chapters keep theirs
# (devices.setup): the tests' subprocesses (mpirun and srun jobs, the LM recipe) and
# the chapters' kernels read the variable too.
if os.environ.get("JAXDIST_COMPILATION_CACHE", "1") != "0":
    os.environ.setdefault(
        "JAX_COMPILATION_CACHE_DIR",
        str(pathlib.Path(__file__).resolve().parent / "_build" / "jax_cache"),
    )
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    # A size limit makes JAX lock the folder: workers, kernels and jobs share it. The
    # limit of devices.setup (CACHE_MAX_BYTES), set here before anything imports JAX.
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 * 1024**3))

# The tests and the chapters compile at XLA's backend optimisation level 0, with
# XLA:CPU's older LLVM emitters in place of its fusion emitters: the same HLO programs
# (shardings, collectives, buffer sizes, all that the tests and the chapters read),
# turned into less optimised machine code in about a third of the time
# (benchmarks/suite_time.py: 43 s of compiling for tests/test_zero.py and
# tests/test_lm_memory.py at level 0 alone, 21 s with both). Their jobs, and the
# chapters' kernels, inherit the flags; the pages say what that changes in the outputs
# the book shows (step times, chapter 5's accuracies).
FAST_COMPILE = [
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
]
# pytest-xdist's workers inherit the flags from the main process: add them once.
flags = os.environ.get("XLA_FLAGS", "").split()
added = [flag for flag in FAST_COMPILE if flag not in flags]
if os.environ.get("JAXDIST_FAST_COMPILE", "1") != "0" and added:
    os.environ["XLA_FLAGS"] = " ".join([*flags, *added])
