"""Test configuration: 8 CPU devices for the SPMD tests, strict numerics."""

import os

import jax
from hypothesis import settings

# Must happen before any JAX backend is created.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

# In CI the property tests draw the same examples on every run (reproducible
# verdicts); elsewhere they explore new ones each time.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")
