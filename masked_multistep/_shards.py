"""Inside ``shard_map``: the manual mesh axes a value varies over, and the
window-wide reductions of a gradient whose parameters are split over them.

With parameters sharded over a mesh axis inside ``shard_map`` (tensor
parallelism by hand), each shard holds a slice of every gradient while the
window's token count is the same on all of them: the gradient's squared norm,
or whether it is finite, is then the shards' together. Over an axis along
which the count differs as well, the shards hold windows of their own
(replicas, ensemble members) and are not combined. Outside ``shard_map``,
and with ``check_vma=False`` (where jax tracks no variance), nothing is.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["over_slices", "varying_axes", "varying_axes_of_type", "varying_like"]


def varying_axes_of_type(aval: Any) -> frozenset:
    """The manual mesh axes over which a value of type ``aval`` (``jax.typeof``
    of it, or a ``jax.ShapeDtypeStruct`` from ``jax.eval_shape``) differs:
    empty outside shard_map."""
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # the older jax spelling


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes over which ``x`` differs (empty outside shard_map)."""
    return varying_axes_of_type(jax.typeof(x))


def over_slices(value: Any, count: Any) -> Any:
    """``value``, computed from the shard's slices of the gradient (a leaf's
    squared norm, a skip function's verdict), combined over the manual mesh
    axes over which it varies and ``count`` (the token count, or a flag made
    from it) does not: summed, or for a boolean, whether any shard's holds.
    ``count=None`` combines nothing.

    Examples:
      Each shard holds a slice of ``arange(8)``; the count is the window's:

      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("model",), devices=jax.devices()[:1],
      ...                      axis_types=(jax.sharding.AxisType.Auto,))
      >>> def shard(g):
      ...     return over_slices(jnp.sum(g * g), jnp.float32(3))
      >>> f = jax.shard_map(shard, mesh=mesh, in_specs=P("model"), out_specs=P())
      >>> print(f(jnp.arange(8.0)))
      140.0
    """
    if count is None:
        return value
    axes = varying_axes(value) - varying_axes(count)
    if not axes:
        return value
    names = tuple(sorted(axes, key=str))
    if jnp.result_type(value) == jnp.bool_:
        return jax.lax.psum(jnp.asarray(value, jnp.int32), names) > 0
    return jax.lax.psum(value, names)


def varying_like(value: jax.Array, axes: frozenset) -> jax.Array:
    """``value`` typed as varying over the manual mesh axes ``axes`` too (a
    branch's constant beside another branch's result that varies)."""
    missing = axes - varying_axes(value)
    if not missing:
        return value
    return jax.lax.pcast(value, tuple(sorted(missing, key=str)), to="varying")
