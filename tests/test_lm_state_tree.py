"""The recipe's train state has the tree its Flax Linen version had (jaxdist_lm at 9467867):
the same paths, shapes, dtypes and layouts, weights and Adam's moments alike. Orbax saves
and restores a checkpoint by that tree, so a checkpoint written before the port to NNX
restores after it (and back). ``tests/data/linen_state_tree.json`` holds the Linen tree."""

import json
import pathlib

import jax
import pytest

from jaxdist_lm import train
from jaxdist_lm.command_line import parse_args

LINEN = json.loads(
    (pathlib.Path(__file__).parent / "data/linen_state_tree.json").read_text()
)


def state_tree(flags: str) -> list[list]:
    """train.setup's state for ``flags``: (path, shape, dtype, spec) of each leaf."""
    run = parse_args([*flags.split(), "--seq-len", "64", "--global-batch", "16"])
    *_, shapes, _ = train.setup(run, jax.devices()[:8])
    leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    return [
        [jax.tree_util.keystr(path), list(x.shape), str(x.dtype), str(x.sharding.spec)]
        for path, x in leaves
    ]


@pytest.mark.parametrize("name", sorted(LINEN["runs"]))
def test_the_state_tree_is_the_linen_recipe_s(name):
    tree = state_tree(LINEN["runs"][name])
    assert tree == LINEN["trees"][name]
    # The tree holds each weight and both of Adam's moments for it, not only a count
    # (but for the experts' routing bias, which optimizer.py moves by its sign).
    paths = {path for path, *_ in tree}
    weights = [
        path.removeprefix(".params") for path in paths if path.startswith(".params")
    ]
    assert ".params['layers']['attention']['query']" in paths
    for moment in ("mu", "nu"):
        having = {w for w in weights if f"].{moment}{w}" in " ".join(paths)}
        assert having == set(weights) - {"['layers']['experts']['router_bias']"}
