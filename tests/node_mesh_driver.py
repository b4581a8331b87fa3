"""Started by ``mpirun`` in ``tests/test_multihost.py``: a node-aware hybrid mesh over simulated nodes.

``python tests/node_mesh_driver.py DEVICES ICI DCN`` (``ICI``, ``DCN``: ``data,fsdp,tensor`` sizes
such as ``1,2,2``) joins the processes with ``DEVICES`` CPU devices each, builds
``multihost.hybrid_mesh`` with the nodes of ``$JAXDIST_NODE_OF_PROCESS``, compiles a ``psum``
over each axis and prints, on process 0, which device is on which node and one JSON line: the
nodes each compiled all-reduce's replica groups span.
"""

import json
import os
import sys

from jaxdist_lessons import multihost

multihost.native_stdout_to_stderr()
per_process, ici, dcn = (
    int(sys.argv[1]),
    *(tuple(int(v) for v in arg.split(",")) for arg in sys.argv[2:4]),
)
multihost.initialize(per_process)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxdist_lessons import comms, hlo  # noqa: E402

AXES = ("data", "fsdp", "tensor")
without_override = {k: v for k, v in os.environ.items() if k != multihost.NODE_OVERRIDE}
# by hostname: all on this machine
detected = multihost.node_of_processes(without_override)
nodes = multihost.node_of_devices()
mesh = multihost.hybrid_mesh(ici, dcn, AXES, nodes=nodes)
grid = multihost.node_grid(mesh, nodes)
for position, device in np.ndenumerate(mesh.devices):
    multihost.print0(
        f"device {device.id:5d} of process {device.process_index}: node {nodes[device.id]}, "
        f"mesh position {dict(zip(AXES, position, strict=True))}"
    )
x = jax.device_put(
    np.ones(mesh.devices.shape, np.float32), NamedSharding(mesh, P(*AXES))
)
report = {"detected": detected, "node_grid": grid.tolist(), "axes": {}}
for axis in AXES:
    psum = jax.jit(
        jax.shard_map(
            lambda b, axis=axis: jax.lax.psum(b, axis),
            mesh=mesh,
            in_specs=P(*AXES),
            out_specs=P(*AXES),
        )
    )
    ops = [
        c
        for c in comms.collectives(psum.lower(x).compile().as_text())
        if c.kind == "all-reduce"
    ]
    groups = (
        hlo.replica_group_lists(ops[0].replica_groups, num_devices=mesh.size)
        if ops
        else []
    )
    report["axes"][axis] = {
        "groups": groups,
        "nodes": [sorted({int(grid.flat[i]) for i in group}) for group in groups],
        "result": float(np.asarray(psum(x).addressable_shards[0].data).flat[0]),
    }
multihost.print0("REPORT " + json.dumps(report))
