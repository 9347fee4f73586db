"""Inside ``shard_map``: the manual mesh axes a value varies over, and the
window-wide reductions of a gradient whose parameters are split over them.

With parameters sharded over a mesh axis inside ``shard_map`` (tensor
parallelism by hand), each shard holds a slice of every gradient while the
window (its token counts, its loss, the wrapper's own counters) is the same on
every shard: the gradient's squared norm, or whether it is finite, is then the
shards' together. Over an axis along which the window differs (data-parallel
shards with losses of their own, replicas, ensemble members), the shards are
not combined. Outside ``shard_map``, and with ``check_vma=False`` (where jax
tracks no variance), nothing is.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "check_inner_update",
    "check_reduced",
    "check_window",
    "one_copy",
    "over_slices",
    "varying_axes",
    "varying_axes_of_type",
    "varying_like",
    "window_axes",
    "window_flag",
]


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


def window_axes(window: Any) -> frozenset:
    """The manual mesh axes over which any value in ``window`` (a pytree of the
    window's figures: counts, losses, counters) varies."""
    return frozenset().union(
        *(varying_axes(x) for x in jax.tree.leaves(window) if _is_value(x))
    )


def over_slices(value: Any, window: Any) -> Any:
    """``value``, computed from the shard's slices of the gradient (a leaf's
    squared norm, a skip function's verdict), combined over the manual mesh
    axes over which it varies and nothing in ``window`` (the window's token
    count and loss, or a flag made from them) does: summed, or for a boolean,
    whether any shard's holds. ``window=None`` combines nothing.

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
    if window is None or not _is_value(value):
        return value
    axes = varying_axes(value) - window_axes(window)
    if not axes:
        return value
    names = tuple(sorted(axes, key=str))
    if jnp.result_type(value) == jnp.bool_:
        return jax.lax.psum(jnp.asarray(value, jnp.int32), names) > 0
    return jax.lax.psum(value, names)


def window_flag(flag: jax.Array, window: Any) -> jax.Array:
    """``flag`` typed as varying wherever ``window`` does: a ``take`` flag
    that, as :func:`over_slices`' ``window``, keeps those axes apart."""
    return varying_like(flag, window_axes(window))


def varying_like(value: jax.Array, axes: frozenset) -> jax.Array:
    """``value`` typed as varying over the manual mesh axes ``axes`` too (a
    branch's constant beside another branch's result that varies)."""
    missing = axes - varying_axes(value)
    if not missing:
        return value
    return jax.lax.pcast(value, tuple(sorted(missing, key=str)), to="varying")


def one_copy(tree: Any, window: Any) -> Any:
    """``tree`` (a gradient) as a function that sums over all its leaves sees
    it on one shard of the whole gradient: a leaf the same on every shard of
    an axis that other leaves are split over (combined, as :func:`over_slices`
    combines) is kept on that axis' first shard and zero on the others, so the
    shards' sums count it once, not once per shard."""
    if window is None:
        return tree
    leaves = jax.tree.leaves(tree)
    split = frozenset().union(*(varying_axes(x) for x in leaves)) - window_axes(window)
    if not split:
        return tree

    def leaf(x: Any) -> Any:
        copies = sorted(split - varying_axes(x), key=str)
        if not copies:
            return x
        first = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in copies]))
        return jnp.where(first, x, jnp.zeros_like(x))

    return jax.tree.map(leaf, tree)


def check_inner_update(updates: Any, grads: Any, params: Any, window: Any) -> None:
    """A ``ValueError`` where a leaf of the inner optimizer's ``updates``
    varies over a manual mesh axis over which neither its gradient, its
    parameter, nor the window's figures (``window``: the count, the loss)
    do: a transformation that reduces over all leaves (a global norm) saw
    each shard's slices of the others, and the shards would part. Or where
    it varies with its parameter over an axis its (window's mean) gradient
    does not: params ``pcast`` to each shard's own, passed in place of the
    original ones."""
    if jax.tree.structure(updates) != jax.tree.structure(grads):
        return
    param_leaves = _leaves_like(params, grads)
    allowed = window_axes(window)
    paths = jax.tree_util.tree_flatten_with_path(updates)[0]
    for (path, u), g, p in zip(paths, jax.tree.leaves(grads), param_leaves):
        extra = varying_axes(u) - varying_axes(g) - allowed
        if p is not None and extra & varying_axes(p):
            axes = sorted(extra & varying_axes(p), key=str)
            raise ValueError(
                f"`params{jax.tree_util.keystr(path)}` differs between the shards "
                f"of {axes} while its gradient and the wrapper's state do not, "
                "so the inner optimizer's update of it would too: the params "
                "typed as each shard's own (`jax.lax.pcast(params, "
                f"{axes[0]!r}, to='varying')`, the copy to differentiate)? Pass "
                "`update` (or `apply_gradients`) the params as they came into "
                "shard_map"
            )
        if p is not None:
            extra -= varying_axes(p)
        if extra:
            axes = sorted(extra, key=str)
            raise ValueError(
                f"The inner optimizer's update of grads"
                f"{jax.tree_util.keystr(path)} differs between the shards of "
                f"{axes} while that gradient and its parameter do not: inside "
                f"shard_map with parameters split over {axes}, a transformation "
                "that reduces over all leaves (optax.clip_by_global_norm, say) "
                "sees each shard's slices of the others. Combine such a "
                "reduction over the shards yourself (jax.lax.psum of the "
                "slices' squared norms), or run the wrapper outside shard_map"
            )


def _leaves_like(params: Any, grads: Any) -> list[Any]:
    """``params``' leaves, one per leaf of ``grads``, or ``None`` for each
    where ``params`` is missing or of another structure."""
    if params is not None and jax.tree.structure(params) == jax.tree.structure(grads):
        return jax.tree.leaves(params)
    return [None] * len(jax.tree.leaves(grads))


def _is_value(x: Any) -> bool:
    """Whether ``x`` is a jax array (traced or not), the only values that vary
    over manual axes: a host number is the same on every shard (and one too
    large for jax is not typed), an extra argument may be a function (a line
    search's ``value_fn``)."""
    return isinstance(x, jax.Array)


def check_reduced(grads: Any, acc_grads: Any, params: Any) -> None:
    """A ``ValueError`` where a gradient leaf varies over a manual mesh axis
    over which neither its accumulator (the state's) nor its parameter does: a
    data-parallel gradient not yet reduced over the shards. (A slice of a
    split parameter varies with it; a shard's window of its own has an
    accumulator that varies.)"""
    if jax.tree.structure(acc_grads) != jax.tree.structure(grads):
        return
    param_leaves = _leaves_like(params, grads)
    paths = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (path, g), acc, p in zip(paths, jax.tree.leaves(acc_grads), param_leaves):
        if not _is_value(g):
            continue
        unreduced = varying_axes(g) - window_axes((acc, p))
        if unreduced:
            axes = sorted(unreduced, key=str)
            raise ValueError(
                f"grads{jax.tree_util.keystr(path)} differs between the shards of "
                f"{axes} while its parameter and the wrapper's state do not: a "
                "gradient not yet reduced over the shards. Pass the "
                "token-weighted mean over them and its total count, `grads, "
                f"count = mm.weighted_mean_across(grads, count, {axes[0]!r})`"
            )


def check_window(state_count: Any, count: Any, value: Any) -> None:
    """A ``ValueError`` where the microbatch's ``count`` or ``value`` varies
    over a manual mesh axis over which the wrapper's state (``state_count``,
    its token total) does not: one window for all shards cannot take figures
    of each shard's own."""
    same = window_axes(state_count)
    for name, figure in (("count", count), ("value", value)):
        own = window_axes(figure) - same
        if own:
            axes = sorted(own, key=str)
            raise ValueError(
                f"`{name}` differs between the shards of {axes} while the "
                "wrapper's state is the same on every shard: its window is all "
                "the shards'. Pass the token-weighted mean over them and the "
                f"total count (`mm.weighted_mean_across(loss, count, {axes[0]!r})`"
                "); or, for windows of each shard's own (an ensemble), a state "
                f"of each shard's own (passed in sharded over {axes[0]!r}, or "
                "`jax.lax.pcast(state, ..., to='varying')`)"
            )
