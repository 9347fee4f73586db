"""A token count as a float32 weight: converted by value, never wrapped.

:func:`microbatched_value_and_grad` and :func:`weighted_mean_across` weight
each microbatch (or shard) by its count and return the total. Both keep counts
as float32: integer counts of any dtype (8-64 bit, signed or unsigned, numpy
or jax) and float counts are converted *by value*, never through int32, so a
total is exact up to 2**24 (16,777,216) and beyond that rounded to float32
precision (relative 6e-8), never wrapped or clipped.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["count_weight", "valid_weight"]


def count_weight(count: Any, what: str = "`count`", role: str = "") -> jax.Array:
    """``count`` as a float32 scalar, converted by value, checked at trace time.

    A Python or numpy count is converted on the host (a numpy ``int64`` or
    ``uint64`` keeps its value, where ``jnp.asarray`` would wrap it to int32);
    a jax count (traced or not) is converted by ``astype``, which is by value
    for every integer dtype. A concrete count that is negative, NaN, infinite
    or too large for float32 raises ``ValueError``; a traced one is returned as
    converted, and :func:`valid_weight` zeroes it if it is not usable.

    Raises:
      TypeError: if ``count`` is boolean, complex or not numeric.
      ValueError: if ``count`` is not a scalar, or is concrete and negative,
        non-finite or beyond float32's range.
    """
    if isinstance(count, jax.Array):  # tracers included
        dtype, shape = count.dtype, count.shape
    elif isinstance(count, int) and not isinstance(count, bool):
        dtype, shape = np.dtype(np.int64), ()  # any size: converted by value below
    else:
        try:
            host = np.asarray(count)
        except Exception as err:  # e.g. a ragged list
            raise TypeError(
                f"{what} must be an integer or floating scalar{role}, got "
                f"{count!r} of type {type(count).__name__}"
            ) from err
        dtype, shape = host.dtype, host.shape
    if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(
            f"{what} must be an integer or floating scalar{role}, got dtype {dtype}"
        )
    if shape != ():
        raise ValueError(
            f"{what} must be an integer or floating scalar{role}, got shape "
            f"{shape} and dtype {dtype}"
        )
    if isinstance(count, jax.core.Tracer):
        return count.astype(jnp.float32)
    # float64 holds every integer count to 53 bits, more than float32 keeps.
    exact = float(count) if isinstance(count, int) else float(np.asarray(count))
    if not (np.isfinite(exact) and exact >= 0):
        raise ValueError(f"{what} must be finite and non-negative{role}, got {count!r}")
    if exact > float(np.finfo(np.float32).max):
        raise ValueError(
            f"{what} is too large for a float32 token total{role}, got {count!r}"
        )
    return jnp.asarray(np.float32(exact))


def valid_weight(weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(take, weight)``: ``take`` where ``weight`` is finite and positive, else 0.

    A count that is zero, negative, NaN or infinite (a bug upstream, or a value
    too large for float32) carries no tokens: its weight becomes 0.
    """
    take = jnp.isfinite(weight) & (weight > 0)
    return take, jnp.where(take, weight, jnp.zeros_like(weight))
