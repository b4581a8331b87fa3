"""Where an array's pieces live: shard shapes and bytes per device."""

from __future__ import annotations

import jax


def bytes_per_device(array: jax.Array) -> dict[int, int]:
    """Bytes of ``array`` each device holds, keyed by device id, read from its addressable shards."""
    held: dict[int, int] = {}
    for shard in array.addressable_shards:
        held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held


def shard_shapes(array: jax.Array) -> dict[int, tuple[int, ...]]:
    """The shape of the block each device holds, keyed by device id."""
    return {shard.device.id: tuple(shard.data.shape) for shard in array.addressable_shards}
