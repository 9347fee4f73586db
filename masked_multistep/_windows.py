"""When a window closes: window policies as pure functions over scalars.

A policy sees only scalars that every device agrees on (the window's
microbatch count, token total, the gradient step), so all devices close their
windows on the same microbatch.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["every_k"]

_INT32_MAX = int(np.iinfo(np.int32).max)
# The largest float32 below 2³¹: a float k clipped to it converts to int32 exactly.
_F32_BELOW_2_31 = float(np.nextafter(np.float32(2**31), np.float32(0)))


def _sanitize_k(k: Any) -> jax.Array:
    """A schedule's value as an int32 window size in [1, 2³¹ − 1], total.

    NaN counts as 1 (every microbatch closes its own window, so a broken
    schedule shows at once as an update per microbatch instead of a window that
    never closes); other floats are rounded to the nearest integer; everything
    is clipped to [1, 2³¹ − 1].
    """
    k = jnp.asarray(k)
    if k.shape != ():
        raise ValueError(
            f"`every_k_schedule(step)` must return a scalar, got shape {k.shape}"
        )
    if jnp.issubdtype(k.dtype, jnp.floating):
        k = jnp.where(jnp.isnan(k), 1, jnp.round(k))
        return jnp.clip(k, 1, _F32_BELOW_2_31).astype(jnp.int32)
    if jnp.issubdtype(k.dtype, jnp.integer) and not jnp.issubdtype(k.dtype, jnp.bool_):
        info = np.iinfo(k.dtype)
        lo = jnp.asarray(1, k.dtype)
        hi = jnp.asarray(min(info.max, _INT32_MAX), k.dtype)
        return jnp.clip(k, lo, hi).astype(jnp.int32)
    raise TypeError(
        f"`every_k_schedule(step)` must return an integer or float, got dtype {k.dtype}"
    )


def every_k(
    every_k_schedule: int | Callable[[jax.Array], jax.typing.ArrayLike],
) -> Callable[[jax.Array], jax.Array]:
    """The window size ``k`` as a function of the gradient step.

    Args:
      every_k_schedule: an integer in ``[1, 2³¹ − 1]`` (checked here), or a
        callable of ``gradient_step`` returning one. A callable's result is made
        total under ``jit``: rounded to the nearest integer, clipped to
        ``[1, 2³¹ − 1]``, NaN counts as 1; a non-scalar raises at trace time.

    Returns:
      ``k(step) -> int32 scalar``.

    Examples:
      >>> import jax.numpy as jnp
      >>> print(every_k(4)(jnp.int32(0)), every_k(lambda s: 2.6)(jnp.int32(0)))
      4 3
      >>> print(every_k(lambda s: jnp.nan)(jnp.int32(0)))
      1
    """
    if callable(every_k_schedule):
        return lambda step: _sanitize_k(every_k_schedule(step))
    k = every_k_schedule
    if isinstance(k, (jax.Array, np.ndarray, np.generic)) and np.ndim(k) == 0:
        if not jnp.issubdtype(k.dtype, jnp.integer) or k.dtype == np.bool_:
            raise TypeError(
                f"`every_k_schedule` must be an integer or a callable, got {k!r}"
            )
        k = int(k)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(
            "`every_k_schedule` must be an integer or a callable of the gradient "
            f"step, got {every_k_schedule!r} of type {type(every_k_schedule).__name__}"
        )
    if k < 1:
        raise ValueError(f"`every_k_schedule` must be >= 1, got {k}")
    if k > _INT32_MAX:
        raise ValueError(
            f"`every_k_schedule` must be at most 2**31 - 1 (the state counts "
            f"microbatches in int32), got {k}"
        )
    k = int(k)
    return lambda step: jnp.asarray(k, jnp.int32)
