"""The seed article, run: every snippet and claim, its verdict, and its fix (the appendix).

Each :class:`Entry` holds one snippet or claim of the article (``shared/seed/article.zh.txt``) in
article order: the article's code as written (indentation restored), the few definitions the
article leaves out, the error it raises today, and the corrected version, which runs and asserts
its result. The appendix notebook shows exactly these cells (a test checks that), and
``tests/test_seed_snippets.py`` runs them all in one namespace, as the notebook does, so that a
JAX, Flax or Optax upgrade that changes the story fails a test before the page goes stale.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
from collections.abc import Iterable
from typing import Any

VERDICTS = {
    "runs": "runs as written and is correct",
    "fails": "raises an error",
    "misleading": "runs, or is partly true, but leaves a wrong idea",
    "false": "the claim is wrong",
    "unverified": "no setup or source given; cannot be checked as stated",
}

# The book's chapters, by notebook name. A chapter not yet written is still named, unlinked.
CHAPTERS = {
    "01_why_distribute": "1. Why distribute",
    "02_device_mesh": "2. Device mesh",
    "03_sharding": "3. Sharding",
    "04_gradients": "4. Gradients across devices",
    "05_resnet50": "5. ResNet50",
    "06_performance": "6. Performance",
    "07_troubleshooting": "7. Troubleshooting",
    "08_multi_host": "8. Multi-host",
    "09_flax_partitioning": "9. Flax partitioning and large meshes",
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One snippet or claim of the article, with what running it shows."""

    key: str
    section: str  # the article's section, e.g. "§2.1"
    title: str  # the snippet or claim in a few words (Markdown)
    verdict: str  # a key of VERDICTS
    chapter: str  # a key of CHAPTERS: where the book teaches it properly
    given: str = ""  # definitions the article leaves out, each marked in the code
    article: str = ""  # the article's code as written; empty for a claim in prose
    shell: bool = False  # the article's code is a shell command: shown, not run as Python
    applied: bool = (
        False  # ``article`` is the article's prose advice applied by us, not its code
    )
    error: tuple[str, str] | None = (
        None  # (exception class name, regex its message matches)
    )
    fix: str = ""  # the corrected version, or the check of the claim: runs and asserts

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(
                f"{self.key}: verdict {self.verdict!r} is not one of {sorted(VERDICTS)}"
            )
        if self.chapter not in CHAPTERS:
            raise ValueError(
                f"{self.key}: chapter {self.chapter!r} is not one of {sorted(CHAPTERS)}"
            )
        if self.error and (not self.article or self.shell):
            raise ValueError(
                f"{self.key}: only Python article code can have an expected error"
            )

    @property
    def code_cells(self) -> list[str]:
        """The Python cells the appendix shows for this entry, in order."""
        runnable = "" if self.shell else self.article
        return [c for c in (self.given, runnable, self.fix) if c]


PRELUDE = """\
import functools
import re

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxdist_lessons import comms, compiled, train
from jaxdist_lessons.mesh import mesh_shape
from jaxdist_lessons.models import resnet
from jaxdist_lessons.seed import ARTICLE_SNIPPETS, undefined_names

n = jax.device_count()
"""

ENTRIES: tuple[Entry, ...] = (
    Entry(
        key="gpt3-memory",
        section="§1",
        title="GPT-3 175B in FP32 needs 700 GB",
        verdict="misleading",
        chapter="01_why_distribute",
        fix="""\
from jaxdist_lessons import memory

weights = memory.weights_bytes(175e9, "fp32")
training = memory.training_state_bytes(175e9, optimizer="adam", precision="fp32")
assert weights == 700e9 and training.state == 16 * 175e9
print(f"weights alone: {weights / 1e9:.0f} GB")
print(
    f"weights + gradients + Adam's two moments: {training.state / 1e12:.1f} TB,"
    " before activations"
)
""",
    ),
    Entry(
        key="mesh-flat-devices",
        section="§2.1",
        title="`Mesh(jax.devices(), ('data', 'model'))`",
        verdict="fails",
        chapter="02_device_mesh",
        article="""\
devices = jax.devices()  # 获取所有可用设备
mesh = Mesh(devices, ('data', 'model'))  # 创建2D网格
""",
        error=(
            "ValueError",
            r"Mesh requires the ndim of its first argument \(`devices`\) to equal the "
            r"length of its second argument \(`axis_names`\), but got devices.ndim == 1 "
            r"and len\(axis_names\) == 2",
        ),
        fix="""\
shape = mesh_shape(n, data=-1, model=2)  # (4, 2) on 8 devices
mesh = jax.make_mesh(shape, ('data', 'model'), axis_types=(AxisType.Auto, AxisType.Auto))
# or by hand: the device array needs one dimension per axis name
by_hand = Mesh(
    np.array(devices).reshape(shape), ('data', 'model'), axis_types=(AxisType.Auto,) * 2
)
assert mesh.devices.shape == by_hand.devices.shape == shape
print(mesh)
""",
    ),
    Entry(
        key="mesh-names",
        section="§2.1",
        title="`('data',)` is data parallel, `('model',)` model parallel",
        verdict="misleading",
        chapter="03_sharding",
        fix="""\
# An axis name is a label. An axis called 'model' that splits the batch is data parallelism.
model_only = jax.make_mesh((n,), ('model',), axis_types=(AxisType.Auto,))
images = jax.device_put(jnp.zeros((2 * n, 32)), NamedSharding(model_only, P('model')))
assert images.sharding.shard_shape(images.shape) == (2, 32)
print(
    f"a batch of {images.shape[0]} over the 'model' axis: each device holds "
    f"{images.sharding.shard_shape(images.shape)}, i.e. 2 examples with all 32 features"
)
""",
    ),
    Entry(
        key="named-shardings",
        section="§2.2",
        title="`P('model')` shards the model dimension",
        verdict="misleading",
        chapter="03_sharding",
        article="""\
# 数据并行分片：批次维度切分
data_sharding = NamedSharding(mesh, P('data'))
# 模型并行分片：模型维度切分
model_sharding = NamedSharding(mesh, P('model'))
# 混合分片
hybrid_sharding = NamedSharding(mesh, P('data', 'model'))
""",
        fix="""\
x = jnp.zeros((8, 4))
for name, s in [
    ("data", data_sharding),
    ("model", model_sharding),
    ("hybrid", hybrid_sharding),
]:
    print(f"{name:>6}: {s.spec} -> each device holds a {s.shard_shape(x.shape)} block")
# P('model') splits dimension 0: the batch of an activation, the input features of a kernel
assert model_sharding.shard_shape(x.shape) == (8 // mesh.shape['model'], 4)
""",
    ),
    Entry(
        key="pmap-pmean",
        section="§2.3",
        title="`@jax.pmap` step that `pmean`s over `'data'`",
        verdict="fails",
        chapter="04_gradients",
        given="""\
# given (not in the article): a loss, and parameters and a batch with a leading device axis
def loss_fn(params, batch):
    return jnp.mean((batch['x'] @ params['w'] - batch['y']) ** 2)


params = {'w': jnp.ones((n, 3))}  # one copy per device
batch = {
    'x': jax.random.normal(jax.random.key(0), (n, 2, 3)),
    'y': jnp.zeros((n, 2)),
}
""",
        article="""\
# 数据并行示例
@jax.pmap
def train_step(params, batch):
    grads = jax.grad(loss_fn)(params, batch)
    return jax.lax.pmean(grads, 'data')  # 跨设备梯度平均


train_step(params, batch)  # given: the article never calls it
""",
        error=("NameError", r"Found an unbound axis name: data"),
        fix="""\
one_copy = {'w': params['w'][0]}
whole_batch = jax.tree.map(lambda b: b.reshape(-1, *b.shape[2:]), batch)
single = jax.grad(loss_fn)(one_copy, whole_batch)  # the reference: one device, whole batch


# (a) pmap, the old way: name the axis
@functools.partial(jax.pmap, axis_name='data')
def pmap_grads(params, batch):
    return jax.lax.pmean(jax.grad(loss_fn)(params, batch), 'data')


# (b) jit with shardings: the compiler adds the all-reduce
data_mesh = jax.make_mesh((n,), ('data',), axis_types=(AxisType.Auto,))
jit_grads = jax.jit(jax.grad(loss_fn))(
    jax.device_put(one_copy, NamedSharding(data_mesh, P())),
    jax.device_put(whole_batch, NamedSharding(data_mesh, P('data'))),
)


# (c) shard_map: average the loss, not the gradients
@jax.jit
@functools.partial(jax.shard_map, mesh=data_mesh, in_specs=(P(), P('data')), out_specs=P())
def shard_map_grads(params, batch):
    return jax.grad(lambda p: jax.lax.pmean(loss_fn(p, batch), 'data'))(params)


for name, grads in [
    ("pmap", pmap_grads(params, batch)['w'][0]),
    ("jit", jit_grads['w']),
    ("shard_map", shard_map_grads(one_copy, whole_batch)['w']),
]:
    np.testing.assert_allclose(grads, single['w'], rtol=1e-6)
    print(
        f"{name:>9}: {np.asarray(grads).round(4)}"
        f"  (one device: {np.asarray(single['w']).round(4)})"
    )
""",
    ),
    Entry(
        key="auto-sync",
        section="§2.3",
        title='"pmap and pjit synchronise gradients automatically"',
        verdict="false",
        chapter="04_gradients",
        fix="""\
per_device = jax.pmap(jax.grad(loss_fn))(params, batch)['w']  # pmap without a pmean
assert not np.allclose(per_device[0], per_device[1])
print("pmap without pmean, device 0:", np.asarray(per_device[0]).round(4))
print("pmap without pmean, device 1:", np.asarray(per_device[1]).round(4))
print("jax.pmap's docstring begins:", repr(jax.pmap.__doc__.splitlines()[0]))
print("jax has pjit:", hasattr(jax, 'pjit'))
""",
    ),
    Entry(
        key="pip-cuda11",
        section="§3.1",
        title='`pip install "jax[cuda11_pip]" -f ...`',
        verdict="fails",
        chapter="01_why_distribute",
        shell=True,
        article="""\
pip install "jax[cuda11_pip]" -f https://storage.googleapis.com/jax-releases/jax_cuda_releases.html
""",
        fix="""\
import importlib.metadata

extras = importlib.metadata.metadata('jax').get_all('Provides-Extra')
assert not any('cuda11' in extra for extra in extras) and 'cuda12' in extras
print(f"jax {jax.__version__} offers the extras: {', '.join(extras)}")
""",
    ),
    Entry(
        key="resnet50-undefined",
        section="§3.2",
        title="`model = ResNet50()`",
        verdict="fails",
        chapter="05_resnet50",
        given="""\
rng = jax.random.key(0)  # given: the article never defines rng
input_shape = (1, 32, 32, 3)  # given: small images keep this page quick (the article: 224)
""",
        article="""\
def create_train_state(rng, input_shape):
    # 初始化模型
    model = ResNet50()
    params = model.init(rng, jnp.ones(input_shape))
    # 自动分片参数
    sharded_params = jax.device_put(params, model_sharding)
    return train_state.TrainState.create(
        apply_fn=model.apply, params=sharded_params, tx=optax.adam(1e-3)
    )


state = create_train_state(rng, input_shape)  # given: the call, as in §3.3
""",
        error=("NameError", r"name 'ResNet50' is not defined"),
        fix="""\
print(
    "flax.linen has ResNet50:", hasattr(nn, 'ResNet50')
)  # it lives in Flax's GitHub examples
# given: the book's ResNet50 (jaxdist_lessons.models.resnet) needs num_classes;
# 1/8 width keeps this page quick
ResNet50 = functools.partial(resnet.ResNet50, num_classes=10, width=0.125)
""",
    ),
    Entry(
        key="device-put-params",
        section="§3.2",
        title="`jax.device_put(params, model_sharding)`",
        verdict="fails",
        chapter="05_resnet50",
        article="""\
state = create_train_state(rng, input_shape)  # given: the call, again
""",
        error=(
            "IndivisibleError",
            r"implies that array axis 0 is partitioned 2 times, but the dimension "
            r"size is \d+ \(full shape: \(\d+, \d+, \d+, \d+\)",
        ),
        fix="""\
variables = jax.eval_shape(ResNet50().init, rng, jnp.ones(input_shape))
leaves = jax.tree.leaves(variables)
indivisible = [x.shape for x in leaves if x.shape[0] % mesh.shape['model']]
print(
    f"{len(indivisible)} of {len(leaves)} leaves have a first dimension that 'model' "
    f"({mesh.shape['model']} devices) does not divide, such as {indivisible[0]}"
)
assert indivisible
# the fix: one spec per leaf, from rules (chapter 5); for now, replicate to go on
model_sharding = NamedSharding(mesh, P())
state = create_train_state(rng, input_shape)
print("TrainState.create runs:", type(state).__name__, "with", list(state.params))
""",
    ),
    Entry(
        key="pjit",
        section="§3.2",
        title="`@functools.partial(jax.pjit, donate_argnums=(0,))`",
        verdict="fails",
        chapter="04_gradients",
        article="""\
@functools.partial(jax.pjit, donate_argnums=(0,))
def train_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn(params, batch['image'])
        loss = optax.softmax_cross_entropy(logits, batch['label']).mean()
        return loss

    grads = jax.grad(loss_fn)(state.params)
    new_state = state.apply_gradients(grads=grads)
    return new_state
""",
        error=("AttributeError", r"module 'jax' has no attribute 'pjit'"),
        fix="""\
@functools.partial(jax.jit, donate_argnums=(0,))  # pjit was merged into jit
def train_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn(params, batch['image'])
        loss = optax.softmax_cross_entropy(logits, batch['label']).mean()
        return loss

    grads = jax.grad(loss_fn)(state.params)
    new_state = state.apply_gradients(grads=grads)
    return new_state


batch = {  # given: the article never defines a batch
    'image': jax.random.normal(jax.random.key(1), (2 * n, *input_shape[1:])),
    'label': jnp.arange(2 * n) % 10,
}
""",
    ),
    Entry(
        key="batch-stats",
        section="§3.2",
        title="`state.apply_fn(params, batch['image'])` with BatchNorm",
        verdict="fails",
        chapter="05_resnet50",
        article="""\
state = train_step(state, batch)  # given: one step, as §3.3 runs it
""",
        error=(
            "ModifyScopeVariableError",
            r'Cannot update variable "mean" in "/bn_init" because '
            r'collection "batch_stats" is immutable',
        ),
        fix="""\
print("init returned the collections:", list(state.params))  # params AND batch_stats


@functools.partial(jax.jit, donate_argnums=(0,))
def train_step(state, batch):
    def loss_fn(params):
        variables = {'params': params['params'], 'batch_stats': params['batch_stats']}
        logits, updates = state.apply_fn(variables, batch['image'], mutable=['batch_stats'])
        loss = optax.softmax_cross_entropy(logits, batch['label']).mean()
        return loss

    grads = jax.grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads)
""",
    ),
    Entry(
        key="softmax-integer-labels",
        section="§3.2",
        title="`optax.softmax_cross_entropy(logits, batch['label'])`",
        verdict="fails",
        chapter="05_resnet50",
        article="""\
state = train_step(state, batch)  # given: one step, as §3.3 runs it
""",
        error=(
            "ValueError",
            r"Incompatible shapes for broadcasting: shapes=\[\(\d+,\), \(\d+, 10\)\]",
        ),
        fix="""\
logits = jax.random.normal(jax.random.key(2), (2 * n, 10))
labels = batch['label']
right = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
one_hot = optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, 10)).mean()
np.testing.assert_allclose(right, one_hot, rtol=1e-6)
print(f"integer labels: {right:.5f} = one-hot labels: {one_hot:.5f}")

# when the batch size equals the number of classes, the wrong call broadcasts silently
square_logits = jax.random.normal(jax.random.key(3), (4, 4))
square_labels = jnp.array([0, 1, 2, 3])
wrong = optax.softmax_cross_entropy(square_logits, square_labels).mean()
right = optax.softmax_cross_entropy_with_integer_labels(square_logits, square_labels).mean()
assert abs(wrong - right) > 0.1
print(
    f"4 examples, 4 classes: the wrong call gives {wrong:.2f}, no error;"
    f" the right value is {right:.2f}"
)
""",
    ),
    Entry(
        key="launch-code",
        section="§3.3",
        title="the launch code (`Mesh(jax.devices(), ('data',))`, training loop)",
        verdict="fails",
        chapter="05_resnet50",
        article="""\
mesh = Mesh(jax.devices(), ('data',))
batch = jax.device_put(batch, data_sharding)
state = create_train_state(rng, (batch_size, 224, 224, 3))
for _ in range(num_steps):
    state = train_step(state, batch)
""",
        error=("NameError", r"name 'batch_size' is not defined"),
        fix="""\
print("names the article uses and never defines:", undefined_names(ARTICLE_SNIPPETS))
print(
    "the new mesh:",
    mesh.axis_names,
    "| data_sharding still uses:",
    data_sharding.mesh.axis_names,
)
try:
    NamedSharding(mesh, P('model'))
except ValueError as error:
    print("and P('model') on the new mesh:", error)

# corrected: one mesh, per-leaf shardings from rules, state born sharded, a step with
# batch_stats, integer labels and donation (jaxdist_lessons.train, chapter 5)
mesh = jax.make_mesh(
    mesh_shape(n, data=-1, model=2),
    ('data', 'model'),
    axis_types=(AxisType.Auto, AxisType.Auto),
)
model, tx, rules = ResNet50(), optax.adam(1e-3), resnet.partition_rules('model')
state = train.create_train_state(model, tx, mesh, rules, rng, input_shape[1:])
shardings = train.state_shardings(model, tx, mesh, rules, input_shape[1:])
train_step, _ = train.make_steps(shardings, mesh)
batch = {'images': batch['image'], 'labels': batch['label'], 'mask': jnp.ones(2 * n)}
losses = []
for _ in range(3):
    state, metrics = train_step(state, batch)
    losses.append(float(metrics['loss']))
print("losses:", [round(loss, 4) for loss in losses])
print("head kernel:", state.params['head']['kernel'].sharding.spec)
assert losses[-1] < losses[0]
""",
    ),
    Entry(
        key="with-sharding-constraint",
        section="§4.1",
        title='"use `with_sharding_constraint` to control communication"',
        verdict="misleading",
        chapter="06_performance",
        applied=True,
        given="""\
# given: the article's advice, applied on a mesh made by jax.make_mesh with Explicit axes
explicit = jax.make_mesh(
    tuple(mesh.shape.values()),
    ('data', 'model'),
    axis_types=(AxisType.Explicit, AxisType.Explicit),
)
x = jax.device_put(jnp.zeros((4 * n, 8)), NamedSharding(explicit, P('data')))
""",
        article="""\
jax.jit(
    lambda x: jax.lax.with_sharding_constraint(
        x * 2, NamedSharding(explicit, P('data', 'model'))
    )
)(x)
""",
        error=(
            "ValueError",
            r"The spec of NamedSharding passed to with_sharding_constraint can only "
            r"refer to Auto axes of the mesh",
        ),
        fix="""\
with jax.set_mesh(explicit):  # Explicit axes: reshard
    y = jax.jit(lambda x: jax.sharding.reshard(x * 2, P('data', 'model')))(x)
print("Explicit mesh, reshard:", jax.typeof(y))
auto_x = jax.device_put(jnp.zeros((4 * n, 8)), NamedSharding(mesh, P('data')))  # Auto axes
z = jax.jit(
    lambda x: jax.lax.with_sharding_constraint(
        x * 2, NamedSharding(mesh, P('data', 'model'))
    )
)(auto_x)
print("Auto mesh, with_sharding_constraint:", z.sharding.spec)
block = (4 * n // mesh.shape['data'], 8 // mesh.shape['model'])
assert z.sharding.shard_shape(z.shape) == y.sharding.shard_shape(y.shape) == block
""",
    ),
    Entry(
        key="gradient-accumulation",
        section="§4.1",
        title='"gradient accumulation reduces sync frequency"',
        verdict="misleading",
        chapter="06_performance",
        fix="""\
from jaxdist_lessons import accumulate

micro_batches = 4
acc_batch = {
    'x': jax.random.normal(jax.random.key(4), (micro_batches * 2 * n, 3)),
    'y': jnp.zeros(micro_batches * 2 * n),
}
w = {'w': jnp.ones(3)}
reference = jax.grad(loss_fn)(w, acc_batch)  # one device, the whole batch at once
for name, variant in accumulate.VARIANTS.items():
    grads_fn = variant(loss_fn, data_mesh, micro_batches)
    loss, grads = grads_fn(w, acc_batch)
    np.testing.assert_allclose(grads['w'], reference['w'], rtol=1e-5)
    found = comms.collectives(grads_fn.lower(w, acc_batch).compile().as_text())
    reduces = [c for c in found if c.kind == 'all-reduce']
    in_loop = sum(c.in_loop for c in reduces)
    print(
        f"{name:>16}: {in_loop} all-reduce(s) inside the micro-batch loop, "
        f"{len(reduces) - in_loop} after it; gradients equal the whole-batch gradient"
    )
    assert (in_loop > 0) == (variant is accumulate.naive_grads)
""",
    ),
    Entry(
        key="mixed-precision-comms",
        section="§4.1",
        title='"mixed precision reduces communication"',
        verdict="misleading",
        chapter="06_performance",
        fix="""\
grads_bf16 = jnp.ones((n, 1024), jnp.bfloat16)
psum_bf16 = jax.jit(
    jax.shard_map(
        lambda g: jax.lax.psum(g, 'data'),
        mesh=data_mesh,
        in_specs=P('data'),
        out_specs=P('data'),
    )
)
lowered = psum_bf16.lower(grads_bf16).as_text()
compiled_reduce = comms.collectives(psum_bf16.lower(grads_bf16).compile().as_text())
assert re.search(r"stablehlo.all_reduce.*?\\}\\) : \\(tensor<[\\dx]*bf16>\\)", lowered, re.S)
assert compiled_reduce[0].dtype == 'f32'
print(
    "the program JAX writes all-reduces bf16; the compiled CPU program all-reduces",
    compiled_reduce[0].dtype,
    f"({compiled_reduce[0].bytes} bytes per device)",
)
""",
    ),
    Entry(
        key="layer-norm-jit",
        section="§4.2",
        title="`@jax.jit def layer_norm(x)` as a computation optimisation",
        verdict="misleading",
        chapter="06_performance",
        article="""\
@jax.jit
def layer_norm(x):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5)
""",
        fix="""\
from jaxdist_lessons import perf

x = jax.random.normal(jax.random.key(5), (64, 256))
np.testing.assert_allclose(layer_norm(x), jax.nn.standardize(x, epsilon=1e-5), atol=1e-5)
flax_norm = nn.LayerNorm(epsilon=1e-5, use_scale=False, use_bias=False)
np.testing.assert_allclose(layer_norm(x), flax_norm.apply({}, x), atol=1e-5)
print("Flax's LayerNorm has scale and bias; its default epsilon:", nn.LayerNorm().epsilon)


def compiled_size(norm):  # instructions in the compiled program of a step that calls norm
    step = jax.jit(lambda x: jnp.tanh(norm(x * 2.0)).sum())
    return perf.instruction_count(step.lower(x).compile().as_text())


inner_jit, plain = compiled_size(layer_norm), compiled_size(layer_norm.__wrapped__)
assert inner_jit == plain
print(f"compiled instructions with the inner jit: {inner_jit}, without: {plain}")
""",
    ),
    Entry(
        key="remat",
        section="§4.3",
        title='"use `jax.checkpoint` (rematerialisation)"',
        verdict="runs",
        chapter="06_performance",
        fix="""\
from jaxdist_lessons import perf


def mlp(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return x.sum()


ws = [jnp.ones((256, 256)) / 256] * 8
x = jnp.ones((64, 256))
remat = jax.checkpoint(mlp)
np.testing.assert_allclose(jax.grad(remat)(ws, x)[0], jax.grad(mlp)(ws, x)[0], rtol=1e-6)
plain_saved, remat_saved = (
    perf.residual_bytes(mlp, ws, x),
    perf.residual_bytes(remat, ws, x),
)
assert remat_saved < plain_saved
print(
    f"activations saved for the backward pass: {plain_saved:,} B without remat, "
    f"{remat_saved:,} B with it"
)
""",
    ),
    Entry(
        key="shard-optimizer-state",
        section="§4.3",
        title='"shard the optimizer state"',
        verdict="runs",
        chapter="06_performance",
        fix="""\
from jaxdist_lessons import zero

adam = optax.adam(1e-3)
weights = {'w': jnp.ones((16 * n, 512))}
state_shape = jax.eval_shape(adam.init, weights)
# ZeRO-1's rule: each array split over 'data' along its largest dimension that divides
specs = zero.opt_state_specs('zero1', state_shape, data_mesh)
shardings = jax.tree.map(lambda spec: NamedSharding(data_mesh, spec), specs)
opt_state = jax.jit(adam.init, out_shardings=shardings)(weights)
mu = opt_state[0].mu['w']
block = mu.sharding.shard_shape(mu.shape)
assert np.prod(block) * n == mu.size
print(f"Adam's first moment {mu.shape}, spec {mu.sharding.spec}: each device keeps {block}")
""",
    ),
    Entry(
        key="clipping-memory",
        section="§4.3",
        title='"gradient clipping controls memory"',
        verdict="false",
        chapter="06_performance",
        fix="""\
def update_memory(tx):
    def update(params, grads, opt_state):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = jax.eval_shape(tx.init, weights)
    return compiled.compiled_stats(jax.jit(update), weights, weights, opt_state)


plain = update_memory(optax.adam(1e-3))
clipped = update_memory(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
assert (
    clipped.temp_bytes >= plain.temp_bytes
    and clipped.argument_bytes == plain.argument_bytes
)
for name, stats in [("Adam", plain), ("clipping + Adam", clipped)]:
    print(
        f"{name:>15}: {stats.argument_bytes:,} B arguments,"
        f" {stats.output_bytes:,} B outputs, "
        f"{stats.temp_bytes:,} B temporaries"
    )
""",
    ),
    Entry(
        key="shapes-differ-message",
        section="§5.1",
        title="`ValueError: Array shapes differ across devices`",
        verdict="false",
        chapter="07_troubleshooting",
        applied=True,
        given="""\
import pathlib

sources = [pathlib.Path(module.__file__).parent for module in (jax, flax, optax)]
hits = [
    f
    for root in sources
    for f in root.rglob("*.py")
    if "differ across devices" in f.read_text()
]
assert hits == []
print(f"'differ across devices' in the installed jax, flax and optax: {len(hits)} files")
odd_batch = jnp.zeros((n + 1, 3))  # given: a batch that does not divide by the devices
""",
        article="""\
jax.device_put(odd_batch, NamedSharding(data_mesh, P('data')))
""",
        error=(
            "IndivisibleError",
            r"implies that array axis 0 is partitioned \d+ times, but the "
            r"dimension size is \d+",
        ),
        fix="""\
batch_rows = odd_batch.shape[0]
padded = (
    -(-batch_rows // n) * n
)  # pad to a multiple of the device count, and mask the extra rows
placed = jax.device_put(jnp.zeros((padded, 3)), NamedSharding(data_mesh, P('data')))
mask = jnp.arange(padded) < batch_rows
print(
    f"{batch_rows} rows padded to {padded}: {int(mask.sum())} real, each device holds "
    f"{placed.sharding.shard_shape(placed.shape)}"
)
""",
    ),
    Entry(
        key="check-jax-versions",
        section="§5.1",
        title='"check that all devices run the same JAX version"',
        verdict="false",
        chapter="07_troubleshooting",
        fix="""\
platforms = {d.client.platform_version for d in jax.devices()}
print(
    f"{jax.device_count()} devices, one Python process, one jax {jax.__version__}; "
    f"their runtimes: {platforms}"
)
assert len(platforms) == 1
""",
    ),
    Entry(
        key="custom-prng-oom",
        section="§5.2",
        title="`jax.config.update('jax_enable_custom_prng', True)` against out-of-memory",
        verdict="false",
        chapter="07_troubleshooting",
        given="""\
def init_memory():  # given: compiled memory of a sharded random init, and the key's type
    init = jax.jit(
        lambda key: jax.random.normal(key, (1024 * n, 1024)),
        out_shardings=NamedSharding(data_mesh, P('data')),
    )
    key = jax.random.PRNGKey(0)
    return type(key).__name__, key.dtype, compiled.compiled_stats(init, key).temp_bytes


before = init_memory()
""",
        article="""\
jax.config.update('jax_enable_custom_prng', True)
""",
        fix="""\
after = init_memory()
jax.config.update('jax_enable_custom_prng', False)  # put it back for the rest of the page
print(f"custom PRNG off: key {before[0]} {before[1]}, {before[2]:,} B temporary")
print(f"custom PRNG on:  key {after[0]} {after[1]}, {after[2]:,} B temporary")
assert before[2] == after[2] and before[1] != after[1]
""",
    ),
    Entry(
        key="profiler",
        section="§5.3",
        title='"use `jax.profiler`"',
        verdict="runs",
        chapter="07_troubleshooting",
        fix="""\
import tempfile

trace_dir = tempfile.mkdtemp()
with jax.profiler.trace(trace_dir):
    jax.jit(layer_norm)(x).block_until_ready()
written = sorted(
    p.name.split('.', 1)[1] for p in pathlib.Path(trace_dir).rglob("*.*") if p.is_file()
)
assert 'xplane.pb' in written
print("jax.profiler.trace wrote:", written)
""",
    ),
    Entry(
        key="eight-dimensional",
        section="§6.1",
        title="\"8-dimensional parallelism\": `Mesh(devices, ('data', 'fsdp', 'tensor', 'pipeline'))`",
        verdict="fails",
        chapter="09_flax_partitioning",
        article="""\
# 8维并行策略
mesh = Mesh(devices, ('data', 'fsdp', 'tensor', 'pipeline'))
sharding = NamedSharding(mesh, P('fsdp', None, 'tensor'))
""",
        error=("ValueError", r"but got devices.ndim == 1 and len\(axis_names\) == 4"),
        fix="""\
pipeline = 2 if n >= 8 else 1
sizes = {
    'data': 1,
    'fsdp': n // (2 * pipeline),
    'model': 2,
    'pipeline': pipeline,
}  # 'tensor': our 'model'
big_mesh = jax.make_mesh(
    tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * 4
)
weight = jax.device_put(
    jnp.zeros((64, 16, 256)), NamedSharding(big_mesh, P('fsdp', None, 'model'))
)
shard = weight.sharding.shard_shape(weight.shape)
distinct = {str(s.index) for s in weight.addressable_shards}
assert shard == (64 // sizes['fsdp'], 16, 256 // 2) and len(distinct) == sizes['fsdp'] * 2
print(
    f"{len(big_mesh.axis_names)} mesh axes {dict(big_mesh.shape)}"
    f" over {big_mesh.size} devices"
)
print(
    f"(64, 16, 256) -> shards {shard}, {len(distinct)} distinct, "
    f"replicated over 'data' and 'pipeline'"
)
""",
    ),
    Entry(
        key="launcher",
        section="§6.2",
        title="`python -m jax.distributed.launch --num_processes=8 --process_hostfile=hosts.txt`",
        verdict="fails",
        chapter="08_multi_host",
        shell=True,
        article="""\
python -m jax.distributed.launch \\
    --num_processes=8 \\
    --process_hostfile=hosts.txt \\
    train_script.py
""",
        fix="""\
import subprocess
import sys

command = [
    sys.executable,
    "-m",
    "jax.distributed.launch",
    "--num_processes=8",
    "--process_hostfile=hosts.txt",
    "train_script.py",
]
run = subprocess.run(command, capture_output=True, text=True)
assert run.returncode == 1 and "jax.distributed.launch" in run.stderr
print(
    f"exit status {run.returncode}:",
    run.stderr.strip().removeprefix(sys.executable + ': '),
)
print(
    "jax.distributed has:",
    [name for name in dir(jax.distributed) if not name.startswith('_')],
)
""",
    ),
    Entry(
        key="with-partitioning-module",
        section="§6.3",
        title="`flax.linen.with_partitioning(flax.linen.Dense(1024), ('model', 'data'))`",
        verdict="fails",
        chapter="09_flax_partitioning",
        article="""\
class Transformer(flax.linen.Module):
    @flax.linen.compact
    def __call__(self, x):
        x = flax.linen.with_partitioning(flax.linen.Dense(1024), ('model', 'data'))(x)
        return x


tokens = jnp.ones((2 * n, 512))  # given: an input,
variables = Transformer().init(rng, tokens)  # given: init,
Transformer().apply(variables, tokens) + 1  # given: and a use of the output
""",
        error=(
            "TypeError",
            r"unsupported operand type\(s\) for \+: 'Partitioned' and 'int'",
        ),
        fix="""\
print(
    "the kernel's spec from the article's form:", nn.get_partition_spec(variables)['params']
)


class Transformer(nn.Module):  # partition metadata goes on the initializers, not the module
    @nn.compact
    def __call__(self, x):
        kernel_init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, 'model'))
        bias_init = nn.with_partitioning(nn.initializers.zeros_init(), ('model',))
        return nn.Dense(1024, kernel_init=kernel_init, bias_init=bias_init)(x)


abstract = jax.eval_shape(Transformer().init, rng, tokens)
print("corrected spec:", nn.get_partition_spec(abstract)['params']['Dense_0']['kernel'])
variables = jax.jit(Transformer().init, out_shardings=nn.get_sharding(abstract, mesh))(
    rng, tokens
)
kernel = variables['params']['Dense_0']['kernel'].value
assert kernel.sharding.shard_shape(kernel.shape) == (512, 1024 // mesh.shape['model'])
y = Transformer().apply(variables, tokens) + 1
print(
    f"kernel {kernel.shape}: each device holds"
    f" {kernel.sharding.shard_shape(kernel.shape)}; "
    f"output {y.shape} is a plain array"
)
""",
    ),
    Entry(
        key="mesh-shape-speedup",
        section="end",
        title="on 8×A100, a (4,2) mesh is 1.8× faster than pure data parallel for ViT; LMs prefer (2,4)",
        verdict="unverified",
        chapter="09_flax_partitioning",
    ),
)

# The article's own code, in order: what `undefined_names` reads.
ARTICLE_SNIPPETS: tuple[str, ...] = tuple(
    "\n".join(line for line in e.article.splitlines() if "# given" not in line)
    for e in ENTRIES
    if e.article and not (e.shell or e.applied)
)

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


def _names(node: ast.AST, context: type) -> set[str]:
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
    """Names a statement binds before its own code reads them: loop and ``with`` targets, arguments."""
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
    """Names the snippets, run in order, read before binding (beyond builtins and ``assumed`` imports).

    A function's body runs later, so its free names only need binding somewhere in the snippets.
    """
    bound_so_far = set(assumed) | set(dir(builtins))
    early_reads: set[str] = set()  # read by top-level code before any binding
    free_in_functions: set[str] = (
        set()
    )  # read by function bodies, bound nowhere inside them
    for statement in (s for snippet in snippets for s in ast.parse(snippet).body):
        if isinstance(statement, (ast.FunctionDef, ast.ClassDef)):
            free_in_functions |= _names(statement, ast.Load) - _bound_inside(statement)
            bound_so_far.add(statement.name)
        else:
            early_reads |= (
                _names(statement, ast.Load) - bound_so_far - _bound_before_use(statement)
            )
            bound_so_far |= _names(statement, ast.Store)
    return sorted(early_reads | (free_in_functions - bound_so_far))


def run(code: str, namespace: dict[str, Any]) -> None:
    """Execute one cell's code in ``namespace``, as a notebook kernel would."""
    exec(compile(code, "<seed>", "exec"), namespace)  # noqa: S102 - running the article is the point


def new_namespace() -> dict[str, Any]:
    """A namespace with the appendix's imports run, as after its first cells."""
    namespace: dict[str, Any] = {"__name__": "__seed__"}
    run(PRELUDE, namespace)
    return namespace


def counts() -> dict[str, int]:
    """How many entries have each verdict."""
    return {v: sum(e.verdict == v for e in ENTRIES) for v in VERDICTS}


def chapter_link(chapter: str, existing: Iterable[str]) -> str:
    """A Markdown link to ``chapter`` if its notebook is in ``existing``, else its title."""
    title = CHAPTERS[chapter]
    return f"[{title}]({chapter}.md)" if chapter in set(existing) else f"{title} (to come)"


def verdict_markdown(existing: Iterable[str]) -> str:
    """The appendix's opening table: section, snippet or claim, verdict, and where the book fixes it."""
    existing = set(existing)
    rows = [
        "| § | snippet or claim | verdict | where the book fixes it |",
        "|---|---|---|---|",
    ]
    for e in ENTRIES:
        rows.append(
            f"| {e.section} | [{e.title}](#{e.key}) | **{e.verdict}** | "
            f"{chapter_link(e.chapter, existing)} |"
        )
    return "\n".join(rows)
