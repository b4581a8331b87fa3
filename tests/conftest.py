"""The package tests run on simulated CPU devices, chosen before anything else touches JAX."""

from jaxdist_lessons import devices

DEVICES = devices.setup()
