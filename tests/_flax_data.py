"""Skewed, masked windows of regression data shared by the Flax tests."""

import jax.numpy as jnp
import numpy as np

K = 4  # microbatches per window
ROWS = 2  # sequences per microbatch
T, D_IN, D_OUT = 6, 3, 2
# Real tokens per sequence, one row per window. Microbatch token counts are
# 12, 1, 0, 8 and then 0, 11, 2, 12: skewed, with an empty microbatch at the end
# and at the start of a window.
LENGTHS = np.array([[6, 6, 1, 0, 0, 0, 3, 5], [0, 0, 6, 5, 2, 0, 6, 6]])
INNER = dict(learning_rate=0.05, weight_decay=0.1)
# float32 rounding of two ways of forming the same mean gradient, after adamw.
TOL = dict(atol=1e-6, rtol=1e-5)


def make_windows():
    """Two windows of full-batch data: (x, y, mask) with K * ROWS rows each."""
    rng = np.random.default_rng(0)
    windows = []
    for lengths in LENGTHS:
        x = rng.normal(size=(K * ROWS, T, D_IN)).astype(np.float32)
        y = rng.normal(size=(K * ROWS, T, D_OUT)).astype(np.float32)
        mask = np.arange(T)[None, :] < lengths[:, None]
        # Padding holds garbage, as real padding might.
        x[~mask] = np.nan
        y[~mask] = 1e6
        windows.append((jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask)))
    return windows


def microbatches(window):
    x, y, mask = window
    for i in range(K):
        rows = slice(i * ROWS, (i + 1) * ROWS)
        yield x[rows], y[rows], mask[rows]
