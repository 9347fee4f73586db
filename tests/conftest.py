"""Test configuration: 8 CPU devices for the SPMD tests, strict numerics."""

import os

# Must happen before any JAX backend is created.
os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
