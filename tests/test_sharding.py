import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxdist_lessons import sharding


def test_bytes_and_shapes_per_device_for_a_batch_sharded_array():
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.zeros((n * 4, 6), jnp.float32), NamedSharding(mesh, P("data")))
    assert sharding.bytes_per_device(x) == {d.id: 4 * 6 * 4 for d in jax.devices()}
    assert sharding.shard_shapes(x) == {d.id: (4, 6) for d in jax.devices()}


def test_replicated_array_is_whole_on_every_device():
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.zeros((3, 5), jnp.bfloat16), NamedSharding(mesh, P()))
    assert set(sharding.bytes_per_device(x).values()) == {3 * 5 * 2}
    assert sum(sharding.bytes_per_device(x).values()) == jax.device_count() * x.nbytes
