"""The run's settings: train.py reads its command line into one ``RunConfig`` (its
flags, by the same names), and the modules take it whole or the fields they need.
Frozen: a variant is a copy (``dataclasses.replace``). Standard library only: the
book's planner reads this same file, and writes a ``RunConfig`` for each layout it
proposes.
"""

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What train.py runs, flag by flag (``--global-batch`` is ``global_batch``); the
    defaults are its flags' defaults, and ``python -m jaxdist_lm.train --help`` says
    what each means and which values it takes."""

    # the model: a preset or a config.json, with experts on top
    model: str = "tiny"
    model_config: str | None = None
    experts: int = 0
    top_k: int = 1
    capacity_factor: float = 1.25
    dispatch: str = "capacity"
    balance: str = "loss"
    bias_rate: float = 0.001
    shared_experts: int = 0
    group_size: int = 512
    # the step: its batch, its mesh and what each device computes and keeps
    mesh: str = "fsdp=-1"
    global_batch: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    dtype: str = "float32"
    remat: str = "full"
    zero1: bool = False
    moments: str = "float32"
    offload: frozenset[str] = frozenset()
    attention: str | None = None
    # the optimizer
    steps: int = 200
    total_steps: int | None = None
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    # the data
    data: str | None = None
    data_dtype: str | None = None
    data_weights: str | None = None
    eod_id: int | None = None
    data_dir: str = "/tmp/jaxdist-lm/data"
    # the run: checkpoints, evaluation, logs, devices, profiling
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    eval_every: int = 0
    eval_batches: int = 4
    log_dir: str | None = None
    keep: int = 3
    num_devices: int | None = None
    compile_only: bool = False
    topology: str | None = None
    slices: int = 1
    profile: str | None = None
    compilation_cache: str = "/tmp/jaxdist-lm/jax_cache"
    step_timeout: float | None = None
