"""--mesh: the mesh's axes, in order, and a spec such as 'fsdp=4,tensor=2' read into a
size for each. Standard library only: the book's planner reads this same file.
"""

import math
import re

# 'tensor' last: its devices are neighbours, in one node; 'sequence' next (a ring of
# keys and values); 'pipeline' first, the one whose traffic (a stage's activations)
# crosses nodes best.
AXES = ("pipeline", "data", "fsdp", "expert", "sequence", "tensor")


def parse(spec: str, devices: int | None = None) -> dict[str, int]:
    """'data=2,tensor=2' -> a size for each of AXES, 1 where the spec says nothing.
    With ``devices``, one size may be -1 (the devices left), and the sizes must
    multiply to ``devices``; raises ValueError saying what is wrong."""
    sizes = dict.fromkeys(AXES, 1)
    for item in spec.split(","):
        axis, _, size = item.partition("=")
        lowest = -1 if devices is not None else 1
        if axis not in sizes or not re.fullmatch(r"-?\d+", size) or int(size) < lowest:
            raise ValueError(f"--mesh {spec}: expected axis=size with axes {AXES}")
        if int(size) == 0:
            raise ValueError(f"--mesh {spec}: an axis of size 0 holds no devices")
        sizes[axis] = int(size)
    if devices is None:
        return sizes
    known = math.prod(s for s in sizes.values() if s != -1)
    rest = [axis for axis, size in sizes.items() if size == -1]
    if len(rest) > 1 or devices % known:
        raise ValueError(f"--mesh {spec} does not fit {devices} devices")
    for axis in rest:
        sizes[axis] = devices // known
    if math.prod(sizes.values()) != devices:
        raise ValueError(
            f"--mesh {spec} has {math.prod(sizes.values())} devices, "
            f"not the {devices} there are"
        )
    return sizes
