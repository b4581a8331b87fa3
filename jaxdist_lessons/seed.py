"""The seed article's snippets and claims: each one's verdict, chapter and expected error.

The appendix (``book/appendix_seed_errata.md``) is the one home of the article's code
(``shared/seed/article.zh.txt``) and of our fixes: each code cell carries a tag,
``seed-<key>-given``, ``seed-<key>-article`` or ``seed-<key>-fix``. This module keeps what is not
code, one :class:`Entry` per snippet or claim in article order: its verdict, the chapter that
teaches it, the cells it has and, where the article's code fails, the error it raises.
The appendix holds its cells to their entries as it runs: after each article cell that fails,
a hidden cell calls :func:`check_raised`, and after each fix, a hidden cell checks its results.
So a JAX, Flax or Optax upgrade that changes the story fails the page's run (``pytest`` runs
every chapter) before the page goes stale. ``tests/test_seed_snippets.py`` checks the cells'
tags and order against the entries.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import re
import sys
from collections.abc import Iterable

VERDICTS = {
    "runs": "runs as written and is correct",
    "fails": "raises an error",
    "misleading": "runs, or is partly true, but leaves a wrong idea",
    "false": "the claim is wrong",
    "unverified": "no setup or source given; cannot be checked as stated",
}

# The book's pages an entry can point to, by notebook name. A page not in the book yet is
# still named, unlinked.
CHAPTERS = {
    "setup": "Setting up",
    "01_why_distribute": "1. Why distribute",
    "02_device_mesh": "2. Device mesh",
    "03_sharding": "3. Sharding",
    "04_gradients": "4. Gradients across devices",
    "05_resnet50": "5. ResNet50",
    "06_performance": "6. Performance",
    "07_troubleshooting": "7. Troubleshooting",
    "08_multi_host": "8. Multi-host",
    "09_flax_partitioning": "9. Logical rules: one model, any strategy",
    "10_language_model": "10. Training a transformer language model",
    "11_pipelines_mesh_shape": "11. Pipelines and the mesh-shape question",
    "12_long_sequences": "12. Long sequences",
}

# The code cells an entry can have, in the order the appendix shows them.
PARTS = ("given", "article", "fix")

# The first line of each cell that holds the article's own code (an `applied` entry's cell is
# ours, and says so instead). Lines marked ``# given`` in those cells are ours too.
ARTICLE_MARK = "# the article, "
GIVEN_MARK = "# given"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One snippet or claim of the article: where it is, what we found, where the book fixes it."""

    key: str  # the appendix's anchor: appendix_seed_errata.md#<key>
    section: str  # the article's section, e.g. "§2.1"
    title: str  # the snippet or claim in a few words (Markdown)
    verdict: str  # a key of VERDICTS
    chapter: str  # a key of CHAPTERS: where the book teaches it properly
    # the entry's code cells, from PARTS, in that order
    cells: tuple[str, ...] = ("fix",)
    # the article's code is a shell command: shown, not run as Python
    shell: bool = False
    # the article cell applies the article's prose advice: our code
    applied: bool = False
    # (exception class name, regex its message matches)
    error: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(
                f"{self.key}: verdict {self.verdict!r} is not one of {sorted(VERDICTS)}"
            )
        if self.chapter not in CHAPTERS:
            raise ValueError(
                f"{self.key}: chapter {self.chapter!r} is not one of {sorted(CHAPTERS)}"
            )
        if tuple(p for p in PARTS if p in self.cells) != self.cells:
            raise ValueError(
                f"{self.key}: cells {self.cells} are not drawn from {PARTS}"
            )
        if "article" in self.cells and self.shell:
            raise ValueError(f"{self.key}: a shell command is shown, not run in a cell")
        if self.error and "article" not in self.cells:
            raise ValueError(
                f"{self.key}: only Python article code can have an expected error"
            )

    def tag(self, part: str) -> str:
        """The tag of this entry's ``part`` cell in the appendix."""
        if part not in self.cells:
            raise KeyError(f"{self.key} has no {part!r} cell; it has {self.cells}")
        return f"seed-{self.key}-{part}"


GIVEN_ARTICLE_FIX = ("given", "article", "fix")
ARTICLE_FIX = ("article", "fix")

# One entry per line or two: a table, kept by hand (ruff would give each field its own line).
# fmt: off
ENTRIES: tuple[Entry, ...] = (
    Entry("gpt3-memory", "§1", "GPT-3 175B in FP32 needs 700 GB",
          "misleading", "01_why_distribute"),
    Entry("mesh-flat-devices", "§2.1", "`Mesh(jax.devices(), ('data', 'model'))`",
          "fails", "02_device_mesh", ARTICLE_FIX,
          error=("ValueError",
                 r"Mesh requires the ndim of its first argument \(`devices`\) to equal the "
                 r"length of its second argument \(`axis_names`\), but got devices.ndim == 1 "
                 r"and len\(axis_names\) == 2")),
    Entry("mesh-names", "§2.1", "`('data',)` is data parallel, `('model',)` model parallel",
          "misleading", "03_sharding"),
    Entry("named-shardings", "§2.2", "`P('model')` shards the model dimension",
          "misleading", "03_sharding", ARTICLE_FIX),
    Entry("pmap-pmean", "§2.3", "`@jax.pmap` step that `pmean`s over `'data'`",
          "fails", "04_gradients", GIVEN_ARTICLE_FIX,
          error=("NameError", r"Found an unbound axis name: data")),
    Entry("auto-sync", "§2.3", '"pmap and pjit synchronise gradients automatically"',
          "false", "04_gradients"),
    Entry("pip-cuda11", "§3.1", '`pip install "jax[cuda11_pip]" -f ...`',
          "fails", "setup", shell=True),
    Entry("resnet50-undefined", "§3.2", "`model = ResNet50()`",
          "fails", "05_resnet50", GIVEN_ARTICLE_FIX,
          error=("NameError", r"name 'ResNet50' is not defined")),
    Entry("device-put-params", "§3.2", "`jax.device_put(params, model_sharding)`",
          "fails", "05_resnet50", ARTICLE_FIX,
          error=("IndivisibleError",
                 r"implies that array axis 0 is partitioned 2 times, but the dimension "
                 r"size is \d+ \(full shape: \(\d+, \d+, \d+, \d+\)")),
    Entry("pjit", "§3.2", "`@functools.partial(jax.pjit, donate_argnums=(0,))`",
          "fails", "04_gradients", ARTICLE_FIX,
          error=("AttributeError", r"module 'jax' has no attribute 'pjit'")),
    Entry("batch-stats", "§3.2", "`state.apply_fn(params, batch['image'])` with BatchNorm",
          "fails", "05_resnet50", ARTICLE_FIX,
          error=("ModifyScopeVariableError",
                 r'Cannot update variable "mean" in "/bn_init" because '
                 r'collection "batch_stats" is immutable')),
    Entry("softmax-integer-labels", "§3.2",
          "`optax.softmax_cross_entropy(logits, batch['label'])`",
          "fails", "05_resnet50", ARTICLE_FIX,
          error=("ValueError",
                 r"Incompatible shapes for broadcasting: shapes=\[\(\d+,\), \(\d+, 10\)\]")),
    Entry("launch-code", "§3.3",
          "the launch code (`Mesh(jax.devices(), ('data',))`, training loop)",
          "fails", "05_resnet50", ARTICLE_FIX,
          error=("NameError", r"name 'batch_size' is not defined")),
    Entry("with-sharding-constraint", "§4.1",
          '"use `with_sharding_constraint` to control communication"',
          "misleading", "06_performance", GIVEN_ARTICLE_FIX, applied=True,
          error=("ValueError",
                 r"The spec of NamedSharding passed to with_sharding_constraint can only "
                 r"refer to Auto axes of the mesh")),
    Entry("gradient-accumulation", "§4.1", '"gradient accumulation reduces sync frequency"',
          "misleading", "06_performance"),
    Entry("mixed-precision-comms", "§4.1", '"mixed precision reduces communication"',
          "misleading", "06_performance"),
    Entry("layer-norm-jit", "§4.2", "`@jax.jit def layer_norm(x)` as a computation optimisation",
          "misleading", "06_performance", ARTICLE_FIX),
    Entry("remat", "§4.3", '"use `jax.checkpoint` (rematerialisation)"',
          "runs", "06_performance"),
    Entry("shard-optimizer-state", "§4.3", '"shard the optimizer state"',
          "runs", "06_performance"),
    Entry("clipping-memory", "§4.3", '"gradient clipping controls memory"',
          "false", "06_performance"),
    Entry("shapes-differ-message", "§5.1", "`ValueError: Array shapes differ across devices`",
          "false", "07_troubleshooting", GIVEN_ARTICLE_FIX, applied=True,
          error=("IndivisibleError",
                 r"implies that array axis 0 is partitioned \d+ times, but the "
                 r"dimension size is \d+")),
    Entry("check-jax-versions", "§5.1", '"check that all devices run the same JAX version"',
          "misleading", "08_multi_host"),
    Entry("custom-prng-oom", "§5.2",
          "`jax.config.update('jax_enable_custom_prng', True)` against out-of-memory",
          "false", "07_troubleshooting", GIVEN_ARTICLE_FIX),
    Entry("profiler", "§5.3", '"use `jax.profiler`"', "runs", "07_troubleshooting"),
    Entry("eight-dimensional", "§6.1",
          "\"8-dimensional parallelism\": `Mesh(devices, ('data', 'fsdp', 'tensor', 'pipeline'))`",
          "fails", "09_flax_partitioning", ARTICLE_FIX,
          error=("ValueError", r"but got devices.ndim == 1 and len\(axis_names\) == 4")),
    Entry("launcher", "§6.2",
          "`python -m jax.distributed.launch --num_processes=8 --process_hostfile=hosts.txt`",
          "fails", "08_multi_host", shell=True),
    Entry("with-partitioning-module", "§6.3",
          "`flax.linen.with_partitioning(flax.linen.Dense(1024), ('model', 'data'))`",
          "fails", "09_flax_partitioning", ARTICLE_FIX,
          error=("TypeError", r"unsupported operand type\(s\) for \+: 'Partitioned' and 'int'")),
    Entry("mesh-shape-speedup", "end",
          "on 8×A100, a (4,2) mesh is 1.8× faster than pure data parallel for ViT; "
          "LMs prefer (2,4)",
          "unverified", "11_pipelines_mesh_shape", ()),
)
# fmt: on

# Names the article uses as if imported: its code never shows its imports.
ASSUMED_IMPORTS = frozenset(
    {
        "jax",
        "jnp",
        "np",
        "functools",
        "optax",
        "flax",
        "train_state",
        "Mesh",
        "NamedSharding",
        "P",
    }
)


def entry(key: str) -> Entry:
    """The entry called ``key``."""
    for e in ENTRIES:
        if e.key == key:
            return e
    raise KeyError(f"no seed entry {key!r}; known: {', '.join(e.key for e in ENTRIES)}")


def check_raised(key: str) -> None:
    """In the appendix, after entry ``key``'s article cell: that cell raised the error the
    entry expects.

    IPython keeps the last cell's uncaught exception in ``sys.last_value``; this takes it
    (and clears it, so that the next entry's check cannot pass on this one's error).

    Raises:
        AssertionError: nothing was raised, or another error, or another message.
    """
    expected = entry(key).error
    if expected is None:
        raise ValueError(f"{key}: the entry expects no error")
    error = getattr(sys, "last_value", None)
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    name, pattern = expected
    if error is None:
        raise AssertionError(f"{key}: the article's code no longer fails")
    if type(error).__name__ != name or not re.search(pattern, str(error)):
        raise AssertionError(
            f"{key}: expected {name} matching {pattern!r}; got "
            f"{type(error).__name__}: {error}"
        )


def article_code(sources: Iterable[str]) -> list[str]:
    """The article's own code among cell sources: cells opening with ARTICLE_MARK, given lines dropped."""
    return [
        "\n".join(line for line in source.splitlines() if GIVEN_MARK not in line)
        for source in sources
        if source.lstrip().startswith(ARTICLE_MARK)
    ]


def article_cells_run() -> list[str]:
    """The article's code in the cells this IPython session has run so far (its history ``In``)."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError(
            "article_cells_run reads a notebook's history: run it in IPython"
        )
    return article_code(shell.user_ns["In"])


def _names(node: ast.AST, context: type | tuple[type, ...]) -> set[str]:
    return {
        n.id
        for n in ast.walk(node)
        if isinstance(n, ast.Name) and isinstance(n.ctx, context)
    }


def _bound_inside(node: ast.AST) -> set[str]:
    """Names a definition binds for its own body: arguments, assignments, nested definitions."""
    bound = _names(node, (ast.Store, ast.Del)) | {
        a.arg for a in ast.walk(node) if isinstance(a, ast.arg)
    }
    return bound | {
        d.name for d in ast.walk(node) if isinstance(d, (ast.FunctionDef, ast.ClassDef))
    }


def _bound_before_use(node: ast.AST) -> set[str]:
    """Names a statement binds before its code reads them: loop and ``with`` targets, arguments."""
    targets = [
        t
        for n in ast.walk(node)
        for t in (
            [n.target]
            if isinstance(n, (ast.For, ast.comprehension))
            else [n.optional_vars]
            if isinstance(n, ast.withitem) and n.optional_vars
            else []
        )
    ]
    return {name for t in targets for name in _names(t, ast.Store)} | {
        a.arg for a in ast.walk(node) if isinstance(a, ast.arg)
    }


def undefined_names(
    snippets: Iterable[str], assumed: Iterable[str] = ASSUMED_IMPORTS
) -> list[str]:
    """Names the snippets, run in order, read before binding (beyond builtins and ``assumed``).

    A function's body runs later, so its free names only need binding somewhere in the snippets.
    """
    bound_so_far = set(assumed) | set(dir(builtins))
    early_reads: set[str] = set()  # read by top-level code before any binding
    # read by function bodies, bound nowhere inside them
    free_in_functions: set[str] = set()
    for statement in (s for snippet in snippets for s in ast.parse(snippet).body):
        if isinstance(statement, (ast.FunctionDef, ast.ClassDef)):
            free_in_functions |= _names(statement, ast.Load) - _bound_inside(statement)
            bound_so_far.add(statement.name)
        else:
            early_reads |= (
                _names(statement, ast.Load)
                - bound_so_far
                - _bound_before_use(statement)
            )
            bound_so_far |= _names(statement, ast.Store)
    return sorted(early_reads | (free_in_functions - bound_so_far))


def counts() -> dict[str, int]:
    """How many entries have each verdict."""
    return {v: sum(e.verdict == v for e in ENTRIES) for v in VERDICTS}
