"""The chapters show the mechanics in JAX: .ci/mechanics_count.py, and its verdict on the book."""

import pytest
from by_path import load

mechanics_count = load("mechanics_count", ".ci/mechanics_count.py")

PAGE = """\
```{code-cell}
from jaxdist_lessons import comms, train
from jaxdist_lessons.multihost_demo import run
```

```{code-cell}
mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
```

```{code-cell}
state = train.create_train_state(model, tx)
```

```{code-cell}
print(comms.summary(text), train.expected_bytes(state))
```

```{code-cell}
:tags: [remove-cell]

train.train_and_evaluate(config)
```

```{code-cell}
run("python examples/train.py --steps 2")
```

```{code-cell}
run("mpirun -np 2 python -m jaxdist_lessons.multihost_demo hello")
```
"""


def test_a_cell_counts_when_it_calls_the_packages_mechanics():
    modules, names = mechanics_count.mechanics_names(PAGE)
    cells = mechanics_count.visible_cells(PAGE)
    verdicts = [mechanics_count.hands_mechanics(c, modules, names) for c in cells]
    # imports, JAX's own mesh, a step: counted, measuring and arithmetic: not, a hidden cell
    # is not visible, a script from examples/ is the reader's code, the package's demo is not
    assert verdicts == [False, False, True, False, False, True]


@pytest.mark.parametrize("chapter", mechanics_count.chapters(), ids=lambda p: p.stem)
def test_at_most_a_third_of_a_chapters_cells_hand_the_mechanics_to_the_package(chapter):
    handed, visible = mechanics_count.count(chapter)
    assert 3 * handed <= visible, (
        f"{chapter.name}: {handed} of {visible} visible code cells call the package's "
        "mechanics (python .ci/mechanics_count.py); write them in the page with JAX"
    )
