"""Plan a run before renting the cluster: which layouts fit, what they send, how fast (predicted).

    python -m jaxdist_lessons.planning --model 8b --devices 16 --nodes 2 --chip h100 \\
        --seq-len 8192 --global-batch 256 [--json] [--check]

One row per candidate layout of the LM recipe (``jaxdist_lm/train.py``): DP, ZeRO-1 (and
ZeRO-2, which the recipe lacks), FSDP, HSDP, FSDP with tensor parallelism inside a node, ring
attention over a ``sequence`` axis, experts over an ``expert`` axis (with a capacity, or
dropless), pipeline schedules (with tensor parallelism inside the stages), and FSDP with
Adam's moments and the saved activations in host memory (priced over the chip's PCIe link).
Each row gives the memory per device, the micro-batches it needs to fit, the bytes each device
sends per step inside a node and across nodes, a predicted step time and MFU, and the recipe's
flags. ``--check`` compiles the best rows with the recipe's
``--compile-only`` on simulated CPU devices and prints predicted and compiled numbers side by side.

The bytes sent and the step time are a GPU's, predicted: weights gathered and gradients
reduce-scattered in the compute type, Megatron's sequence-parallel activations, the matmuls at
``timing.compute_efficiency`` of the datasheet peak (a fraction per chip fitted to published
runs, ``against_published``), FSDP's collectives hidden behind the compute and tensor
parallelism's waited for. ``--bytes xla-cpu`` prices instead the collectives of the program
XLA:CPU compiles from the recipe (JAX 0.10.2): every one moves float32, even under
``--dtype bfloat16``, and their counts per layer were read from compiled programs
(``benchmarks/plan_check.py`` checks them on 35 layouts); those are what ``--check`` compares.
Written here rather than taken from a library: no planner we know of reads JAX meshes.

The modules, each building on those before it: ``shapes`` (the model), ``layouts`` (the
request and the meshes), ``footprint`` (memory per device), ``xla_cpu`` (the collectives
XLA:CPU compiles), ``gpu`` (a GPU's, predicted), ``timing`` (links and the step time),
``ranking`` (the rows and the table), ``checking`` (against compiled programs) and ``cli``
(the command line and the page), with the model's shape from the recipe's
``jaxdist_lm.model_config`` and the run's flags as its ``jaxdist_lm.run_config.RunConfig``
(imported, the same files the recipe runs). Standard library only (no JAX, no NumPy): the "Plan your run" page runs them
in the browser, in Pyodide (``tests/planning/test_cli.py`` imports them with JAX made
unimportable). Beside them, ``costmodel``: chapter 11_pipelines_mesh_shape's roofline model of any Transformer,
checked against compiled programs with JAX, on the same ``Layout`` and vocabulary; and
``published``: the published measured runs (``book/data/published_runs.json``), each with its
source's words; ``efficiency``: the flops utilisation each one reached; and
``against_published``: the planner's whole step for each run, predicted over measured, and the
per-chip compute efficiency fitted from them.
"""
