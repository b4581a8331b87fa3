"""The package tests run on 8 simulated CPU devices, chosen before anything else touches JAX.

Always 8, whatever ``JAXDIST_NUM_DEVICES`` says (that variable sets the notebooks' count): a test
that needs another count, 1 or a count that is not a power of two, builds its mesh over a subset
of the 8 (``tests/meshes.py``).
"""

from jaxdist_lessons import devices

DEVICES = devices.setup(num_devices=8)
