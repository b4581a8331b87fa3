"""The package tests run on 8 simulated CPU devices, chosen before anything else touches JAX.

Always 8, whatever ``JAXDIST_NUM_DEVICES`` says (that variable sets the notebooks' count): a test
that needs another count, 1 or a count that is not a power of two, builds its mesh over a subset
of the 8 (``tests/meshes.py``).
"""

import os

from jaxdist_lessons import devices

DEVICES = devices.setup(num_devices=8)


def demo_pids():
    """Process ids of running multihost_demo processes (to check that none is left behind)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"jaxdist_lessons.multihost_demo" in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found
