"""Token-weighted means across a named mesh axis, for ``shard_map`` code."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from masked_multistep._checks import PARAM_LEAF_TYPES, count_weight, short_repr
from masked_multistep._running_mean import compute_dtype, result_type, safe_fraction
from masked_multistep._shards import varying_axes_of_type

__all__ = ["weighted_mean_across", "weighted_sum_across"]


def reduced_leaf(
    tree: Any, count: Any, names: frozenset | None = None
) -> tuple[str, list[Hashable]] | None:
    """The first leaf of ``tree`` that is the same on every shard of an axis
    (of ``names``, or any) over which ``count`` differs, as ``(path, axes)``,
    ``path`` spelt by ``keystr`` (``"['w']"``, or ``""`` for a bare leaf);
    ``None`` if there is none (always, outside ``shard_map``). Such a leaf was
    already reduced over the shards while the count is still each shard's own."""
    if not isinstance(count, jax.Array):
        return None  # a host number is the same on every shard
    return _first_invariant(tree, jax.typeof(count), names, jax.typeof)


def reduced_leaf_of_types(
    types: Any, count_type: Any, names: frozenset | None = None
) -> tuple[str, list[Hashable]] | None:
    """:func:`reduced_leaf` on types: ``jax.typeof``'s, or the
    ``jax.ShapeDtypeStruct`` leaves of a traced function's outputs."""
    return _first_invariant(types, count_type, names, lambda t: t)


def _first_invariant(
    tree: Any, count_type: Any, names: frozenset | None, type_of: Callable[[Any], Any]
) -> tuple[str, list[Hashable]] | None:
    count_varies = varying_axes_of_type(count_type)
    if names is not None:
        count_varies &= names
    if not count_varies:
        return None
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if invariant := count_varies - varying_axes_of_type(type_of(leaf)):
            # Axis names are any hashables: sorted by their text.
            return jax.tree_util.keystr(path), sorted(invariant, key=str)
    return None


def weighted_mean_across(
    tree: Any,
    count: jax.typing.ArrayLike,
    axis_name: Hashable | Sequence[Hashable],
) -> tuple[Any, jax.Array]:
    """The token-weighted mean of ``tree`` over the shards of ``axis_name``.

    Each shard ``d`` holds a mean ``gᵈ`` (for example its mean gradient) over
    ``nᵈ`` tokens. Every shard receives::

        mean = Σ nᵈ gᵈ / Σ nᵈ        total = Σ nᵈ

    computed as ``Σ (nᵈ / N)·gᵈ`` with ``N = Σ nᵈ`` psummed first, each term in
    at least float32 and cast back to the leaf's dtype at the end. Every term is
    bounded by ``max |gᵈ|``, so no overflow-prone raw sum ``Σ nᵈ gᵈ`` is ever
    formed (it can exceed the float16 range where the mean does not). This is
    the cross-device counterpart of :func:`running_mean_update`, for code inside
    ``jax.shard_map`` (or ``jax.vmap`` with an ``axis_name``); under plain
    ``jit`` with sharded arrays the compiler inserts these reductions itself.
    Inside ``shard_map``, take each shard's own gradient by differentiating with
    respect to ``jax.lax.pcast(params, axis_name, to="varying")``: the gradient
    with respect to replicated params is already summed over the shards.

    Zero-safe: a shard with ``nᵈ = 0`` contributes nothing, even if its ``gᵈ``
    holds NaN or inf (an all-masked shard's ``0/0``); if every count is zero
    the mean is zeros, not NaN. A traced count that is negative, NaN or
    infinite (only possible from a bug upstream) contributes nothing either.
    Finite float counts whose sum passes float32's range (beyond 3.4e38) give
    ``total = inf`` and a NaN mean, never a finite wrong one.
    Reverse-mode derivatives (with respect to ``tree`` and to float counts)
    are finite and equal those of leaving the empty shards out.

    Counts are weights in float32: ``count`` may be any integer (8-64 bit,
    signed or unsigned, numpy or jax) or floating scalar, and is converted by
    value, never through int32. ``total`` is float32: exact for integer totals
    up to 2**24 (16,777,216 tokens), never wrapped; beyond, each of the psum's
    additions rounds it by at most 2**-24 of it (6e-8 relative).

    Args:
      tree: pytree of floating (or complex) arrays, this shard's means.
      count: this shard's weight ``nᵈ``: a non-negative integer or floating
        scalar (e.g. the count from :func:`masked_mean`).
      axis_name: the mesh (or ``vmap``) axis name to reduce over, or a tuple of
        names.

    Returns:
      ``(mean, total)``: ``mean`` with ``tree``'s structure, shapes and dtypes,
      the same on every shard; ``total = Σ nᵈ``, a float32 scalar.

    Raises:
      TypeError: if a leaf of ``tree`` is not floating or complex, ``count`` is
        boolean, complex, not numeric, or in a float narrower than float32, or
        ``axis_name`` is an integer (to jax's collectives, a positional axis).
      ValueError: if ``count`` is not a scalar, or is concrete (not traced) and
        negative, non-finite or beyond float32's range; or if, inside
        ``shard_map``, a leaf of ``tree`` is invariant over ``axis_name`` while
        ``count`` varies. That leaf is already reduced: the gradient with
        respect to a replicated input is summed over shards automatically.
        Differentiate with respect to
        ``jax.lax.pcast(params, axis_name, to="varying")`` instead.
      NameError: if ``axis_name`` is not bound (outside ``shard_map``, or a
        name that the ``shard_map`` it runs in does not map over).

    Examples:
      Three shards with 1, 2 and 0 tokens; the empty one's NaN is ignored:

      >>> import jax, jax.numpy as jnp
      >>> import masked_multistep as mm
      >>> grads = jnp.array([1.0, 4.0, jnp.nan])
      >>> counts = jnp.array([1, 2, 0])
      >>> mean, total = jax.vmap(
      ...     lambda g, n: mm.weighted_mean_across(g, n, "shards"),
      ...     axis_name="shards")(grads, counts)
      >>> print(mean, total)  # (1 * 1 + 2 * 4) / 3 on every shard
      [3. 3. 3.] [3. 3. 3.]
    """
    count = count_weight(count, "`count` (this shard's token count)")
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(leaf, PARAM_LEAF_TYPES):  # a string is read as a dtype
            raise TypeError(
                "`tree` leaves must be floating arrays, got "
                f"{type(leaf).__name__} {short_repr(leaf, 40)} at "
                f"tree{jax.tree_util.keystr(path)}"
            )
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            raise TypeError(
                "`tree` leaves must be floating (or complex), got dtype "
                f"{jnp.result_type(leaf)} at tree{jax.tree_util.keystr(path)}"
            )
    _check_bound(names)
    if reduced := reduced_leaf(tree, count, frozenset(names)):
        # Inside shard_map, the gradient of a replicated (invariant) input is
        # already summed over the shards; weighting that sum again is wrong.
        path, axes = reduced
        raise ValueError(
            f"tree{path} is the same on every shard of {axes} while "
            "`count` differs: it is not this shard's own mean (a constant, or "
            "a value already reduced over the shards). Inside shard_map the "
            "gradient with respect to a replicated input is summed over the "
            "shards automatically; differentiate with respect to "
            f"`jax.lax.pcast(params, {axes[0]!r}, to='varying')` "
            "to get this shard's own gradient."
        )
    with jax.named_scope("masked_multistep/weighted_mean_across"):
        # `count_weight` zeroed a traced negative or non-finite count; a shard
        # with no tokens is left out of the mean and of its derivatives (with
        # respect to its count too), as if it were not there.
        count = jnp.where(count > 0, count, jnp.zeros_like(count))
        total = jax.lax.psum(count, axis_name)
        # Finite counts whose sum passes float32's range: every weight n/inf
        # would be 0, a finite mean of zeros; NaN weights say it instead.
        weighed_by = jnp.where(jnp.isinf(total), jnp.nan, total)
        mean = weighted_sum_across(tree, count, weighed_by, axis_name)
    return mean, total


def _check_bound(names: tuple[Hashable, ...]) -> None:
    """A ``NameError`` that says what to do where an axis of ``names`` is not
    bound (inside an eager ``shard_map`` that checks varying axes, jax's own
    ``psum`` fails on one with a bare ``AssertionError``)."""
    for name in names:
        if isinstance(name, (int, np.integer)):
            # (jax's collectives read an integer as a positional axis of each
            # array: "axis 0 is out of bounds for array of dimension 0".)
            raise TypeError(
                f"`axis_name` must name a mesh (or vmap) axis, got the integer "
                f"{name!r}: pass the axis's name, e.g. 'data'"
            )
        try:
            jax.lax.axis_size(name)
        except NameError as err:
            mesh = jax.sharding.get_abstract_mesh()
            manual = tuple(getattr(mesh, "manual_axes", ()))
            if manual:
                # Inside a shard_map already: the name is the mistake.
                raise NameError(
                    f"`axis_name` {name!r} is not bound here: the `shard_map` "
                    f"this runs in maps over {manual} (and an enclosing "
                    "`vmap` over its `axis_name`, if any); pass the name of the "
                    "axis to average over"
                ) from err
            raise NameError(
                f"{str(err).rstrip('.')}: `weighted_mean_across` reduces over a "
                "named axis, so it runs inside `jax.shard_map` (or "
                "`jax.vmap(..., axis_name=...)`) over that axis; under plain `jit`, "
                "mm.data_parallel_value_and_grad or "
                "MaskedMultiSteps(..., reduction=mm.deferred(mesh, axis_name)) "
                "do it for you"
            ) from err


def weighted_sum_across(
    tree: Any,
    count: jax.Array,
    total: jax.Array,
    axis_name: Hashable | Sequence[Hashable],
) -> Any:
    """``Σ (nᵈ / N)·gᵈ`` over ``axis_name`` when every shard already knows ``N``.

    The arithmetic of :func:`weighted_mean_across` without its scalar ``psum``
    of the counts: one ``psum`` of the weighted tree. ``total`` must be the same
    on every shard (``Σ nᵈ``); a shard with ``nᵈ <= 0`` contributes nothing,
    even if its ``gᵈ`` is NaN, and a zero ``total`` gives zeros.
    """
    return weighted_sum(tree, count, total, lambda x: jax.lax.psum(x, axis_name))


def weighted_sum(
    tree: Any,
    count: jax.Array,
    total: jax.Array,
    sum_over: Callable[[jax.Array], jax.Array],
) -> Any:
    """``Σ (nᵈ / N)·gᵈ``, the sum over ``d`` taken by ``sum_over``.

    The arithmetic of :func:`weighted_sum_across`, whatever holds the shards:
    a named axis (``sum_over`` a ``psum``, ``count`` a scalar) or a leading
    axis of every leaf (``sum_over`` a sum over axis 0, ``count`` of shape
    ``(D,)``, broadcast against each leaf's trailing axes).
    """
    take = count > 0
    count = jnp.where(take, count, jnp.zeros_like(count))

    def leaf(g):
        g = jnp.asarray(g)
        dtype = compute_dtype(g.dtype)
        # The weight in the leaf's own precision: a float32 ratio would cap a
        # float64 leaf (under x64) at float32 accuracy; float64 weights beside
        # a float32 leaf keep their own range for it (1e-40 is no float32 normal).
        real = result_type(jnp.finfo(dtype).dtype, count, total)
        weight = safe_fraction(count.astype(real), total.astype(real))
        trailing = (1,) * (g.ndim - weight.ndim)
        weight = jnp.reshape(weight, weight.shape + trailing)
        taken = jnp.reshape(take, take.shape + trailing)
        # Zero an empty shard's (possibly NaN) value before multiplying:
        # NaN * 0 is NaN, in the value and in the weight's cotangent.
        g_c = jnp.where(taken, g.astype(dtype), jnp.zeros((), dtype))
        return sum_over(weight.astype(dtype) * g_c).astype(g.dtype)

    return jax.tree.map(leaf, tree)
