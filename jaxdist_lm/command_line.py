"""train.py's command line: its flags, named as RunConfig's fields, read once into one.

run = parse_args(["--model", "tiny", "--mesh", "data=2,fsdp=2,tensor=2"])
"""

import argparse
import dataclasses
from collections.abc import Callable

from . import data, model_config
from . import model as model_lib
from .attention import ATTENTIONS
from .mesh_spec import AXES
from .run_config import RunConfig
from .schedules import SCHEDULES

DESCRIPTION = (
    "Train a Llama-style decoder on a mesh: "
    "pipeline, data, fsdp, expert, sequence, tensor"
)
OFFLOADS = ("optimizer", "activations")
# --profile's steps: a few after the first step's compilation
PROFILED = range(6, 9)


def offloads(text: str) -> frozenset[str]:
    """--offload's value: "none", or some of OFFLOADS joined by commas."""
    chosen = frozenset(text.split(",")) - {"none"}
    if unknown := sorted(chosen - set(OFFLOADS)):
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown)}: expected none or some of {', '.join(OFFLOADS)}"
        )
    return chosen


def parse_args(argv=None) -> RunConfig:
    """The command line, read once into the run's config."""
    return RunConfig(**vars(flags().parse_args(argv)))


def flags() -> argparse.ArgumentParser:
    """train.py's flags, named as RunConfig's fields, with its defaults; --help shows
    them in groups."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}.train",
        usage="%(prog)s [flags]",
        description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.set_defaults(**dataclasses.asdict(RunConfig()))
    for title, add_flags in GROUPS:
        add_flags(parser.add_argument_group(title).add_argument)
    return parser


def model_flags(add: Callable) -> None:
    """The model: a preset or a Llama's config.json, and its experts."""
    add(
        "--model",
        choices=sorted(model_config.PRESETS),
        help="a preset shape (model_config.py's PRESETS)",
    )
    add(
        "--model-config",
        metavar="CONFIG_JSON",
        help="the shape from a Hugging Face Llama config.json instead of --model "
        "(with convert from-hf's checkpoint: fine-tune a Llama)",
    )
    add("--experts", type=int, help="experts per MLP (0: a dense MLP)")
    add("--top-k", type=int, help="experts per token")
    add(
        "--capacity-factor",
        type=float,
        help="an expert's slots per group: "
        "ceil(top_k x group x factor / experts); experts / top_k: none dropped",
    )
    add(
        "--dispatch",
        choices=["capacity", "dropless"],
        help="capacity: GShard's fixed slots per expert, a choice over them dropped; "
        "dropless: every choice computed, sorted by expert (grouped matrix products)",
    )
    add(
        "--balance",
        choices=["loss", "bias"],
        help="loss: Switch's load-balancing loss; bias: DeepSeek-V3's per-expert "
        "routing bias, moved by --bias-rate a step toward equal loads (no such loss)",
    )
    add("--bias-rate", type=float, help="--balance bias's step")
    add(
        "--shared-experts",
        type=int,
        help="experts every token goes through, beside its --top-k (DeepSeekMoE)",
    )
    add(
        "--group-size",
        type=int,
        help="tokens routed together (at most --seq-len)",
    )


def layout_flags(add: Callable) -> None:
    """The mesh, the batch and the pipeline's schedule."""
    add(
        "--mesh",
        help="e.g. data=2,fsdp=2,tensor=2; -1 = the rest; axes: "
        + ", ".join(AXES)
        + " (on TPUs of several slices, data is the axis across them)",
    )
    add(
        "--global-batch",
        type=int,
        help="sequences per optimizer step, all devices",
    )
    add(
        "--grad-accum",
        type=int,
        help="micro-batches per step: each device computes --global-batch / K "
        "sequences at a time and adds up the gradients",
    )
    add("--seq-len", type=int, help="tokens per sequence")
    add(
        "--schedule",
        choices=SCHEDULES,
        help="with a pipeline axis: gpipe (jax.grad writes the backward; each stage "
        "keeps all K micro-batches), 1f1b (at most P), interleaved (--virtual-stages "
        "per device, a smaller bubble)",
    )
    add(
        "--virtual-stages",
        type=int,
        metavar="V",
        help="--schedule interleaved: stages per device (the layers cut in P x V)",
    )


def memory_flags(add: Callable) -> None:
    """The compute's types, and what is kept where."""
    add(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="compute type",
    )
    add(
        "--remat",
        choices=sorted(model_lib.REMAT_POLICIES),
        help="what each layer keeps for the backward pass: full recomputes the "
        "layer, dots keeps its matrix products' outputs, none keeps everything",
    )
    add(
        "--zero1",
        action="store_true",
        help="split the optimizer's state over the data axis (ZeRO stage 1): each "
        "replica updates its share, and the updated weights are gathered",
    )
    add(
        "--moments",
        choices=["float32", "bfloat16"],
        help="the type Adam's two moments are kept in between steps (bfloat16: 4 "
        "bytes a weight instead of 8; each update still computed in float32)",
    )
    add(
        "--offload",
        type=offloads,
        # a string default, which argparse reads through offloads: --help shows "none"
        default="none",
        help="what to keep in the host's pinned memory, comma-separated: optimizer "
        "(Adam's moments, moved to the device for each update), activations (each "
        "layer's saved input, moved back for the backward pass); or none",
    )
    add(
        "--attention",
        choices=ATTENTIONS,
        help="cudnn: cuDNN's fused kernel (NVIDIA GPUs; the default there, never run "
        "on a GPU by this project); splash: "
        "JAX's Pallas kernel (TPUs; the default there, for a --seq-len that is a "
        "multiple of 128); chunked: blocks in plain JAX, memory linear in the sequence "
        "(the default elsewhere); xla: XLA's reference, the T x T scores in float32",
    )


def optimizer_flags(add: Callable) -> None:
    """AdamW and its schedule."""
    add("--steps", type=int, help="stop after this step")
    add(
        "--total-steps",
        type=int,
        help="the learning rate schedule's length (default: --steps); keep it when a "
        "rerun goes further, so that the curve does not change",
    )
    add("--learning-rate", type=float, help="the peak, after the warmup")
    add("--warmup-steps", type=int, help="linear warmup, then cosine decay")
    add("--weight-decay", type=float, help="AdamW's")
    add("--clip-norm", type=float, help="the gradients' global norm, at most")
    add("--seed", type=int, help="the weights' initialization and the batches' order")


def data_flags(add: Callable) -> None:
    """The tokens."""
    add(
        "--data",
        help="your own token ids instead of the corpus, read in place: a .npy, a .bin "
        "(--data-dtype), or a directory of them (shards); several: a.bin,b.bin",
    )
    add("--data-dtype", choices=sorted(data.BIN_DTYPES), help="a .bin's token ids")
    add("--data-weights", help="mix the --data entries: e.g. 0.7,0.3")
    add(
        "--eod-id",
        type=int,
        help="the token that ends each document: attention and positions restart "
        "after it (document masking); by default a row is one text",
    )
    add(
        "--data-dir",
        help="where the default corpus's tokens are kept",
    )


def checkpoints_flags(add: Callable) -> None:
    """Checkpoints, evaluation and metrics."""
    add(
        "--checkpoint-dir", help="save here, and resume from the latest step found here"
    )
    add("--checkpoint-every", type=int, help="steps between checkpoints")
    add("--keep", type=int, help="checkpoints to keep")
    add(
        "--eval-every",
        type=int,
        metavar="N",
        help="every N steps, print the loss on held-out batches (0: never)",
    )
    add("--eval-batches", type=int, help="held-out batches per evaluation")
    add(
        "--log-dir",
        help="write each step's metrics to DIR/metrics.jsonl and to TensorBoard",
    )


def running_flags(add: Callable) -> None:
    """Where and how it runs."""
    add(
        "--num-devices",
        type=int,
        help="simulated CPU devices (ignored on accelerators)",
    )
    add(
        "--compile-only",
        action="store_true",
        help="compile one step, print memory, stop",
    )
    add(
        "--topology",
        metavar="NAME",
        help="with --compile-only: compile for a TPU slice that is not here, by "
        "libtpu's name for it (v5e:16x16, v5p:4x4x8, v6e:8x8); needs libtpu "
        "installed, not a TPU",
    )
    add(
        "--slices",
        type=int,
        help="with --topology: that many slices joined by the data-center network "
        "(--mesh's data, the axis across them, a multiple of it)",
    )
    add(
        "--profile",
        metavar="DIR",
        help=f"trace steps {PROFILED[0]} to {PROFILED[-1]} with jax.profiler into DIR",
    )
    add("--compilation-cache", help="JAX's persistent compilation cache")
    add(
        "--step-timeout",
        type=float,
        metavar="SECONDS",
        help="end the job (status 124) when a step has not finished on some process "
        "for SECONDS",
    )


GROUPS = [
    ("the model: a preset or a Llama's config.json, and its experts", model_flags),
    ("the mesh, the batch and the pipeline's schedule", layout_flags),
    ("the compute's types, and what is kept where", memory_flags),
    ("AdamW and its schedule", optimizer_flags),
    ("the tokens", data_flags),
    ("checkpoints, evaluation and metrics", checkpoints_flags),
    ("where and how it runs", running_flags),
]
