"""The window statistics' squared norms, and the views of a gradient they read.

A microbatch's ``‖g‖²`` (or each leaf's, or each device's row's), the window
mean's ``‖ḡ‖²``, in at least float32: on CPUs each leaf reduced on its own (small
leaves of one shape together where they are the state), on GPUs one reduction per
shape of rows (:func:`tree_sq_norm`). Their derivatives ignore skipped and
non-finite gradients (:func:`taken_sq_norm`). The views (:func:`in_compute_precision`,
:func:`for_squared_norms`, :func:`materialized_on_gpu`) let the accumulation pass
and the squared norm read one gradient without a copy of it in memory.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import jax
import jax.numpy as jnp

from masked_multistep._branch import on_gpu
from masked_multistep._running_mean import (
    compute_dtype,
    placed_by_type,
    result_type,
    sq_norm,
    squares,
    sum_scalars,
    summed_by_kind,
    sums_of_leaves,
)
from masked_multistep._shards import over_slices

__all__ = [
    "ONE_REDUCTION",
    "for_squared_norms",
    "gpu_forms",
    "in_compute_precision",
    "materialized_on_gpu",
    "sq_norms",
    "taken_sq_norm",
    "tree_sq_norm",
]

_F32 = jnp.float32


def tree_sq_norm(tree: Any, window: Any = None, together: bool = True) -> jax.Array:
    """``Σ_leaves ‖leaf‖²`` in at least float32 (real, for complex leaves too);
    inside ``shard_map``, a leaf's summed over the shards that hold slices of
    it, ``window`` (the window's tokens, its loss) the same on each (see
    ``_shards``). On GPUs the leaves' rows are added up before one reduction
    per shape of rows (see :func:`_one_reduction` for where); elsewhere each
    leaf is reduced on its own, but on CPUs, with ``together``, small ones
    of one shape together (``_running_mean.sums_of_leaves``: for a tree that
    is alive anyway, the state's; a microbatch's fresh gradients, read
    together, would all be kept until the last is computed). They differ in
    the last bits.

    Examples:
      >>> import jax.numpy as jnp
      >>> from masked_multistep._sq_norms import tree_sq_norm
      >>> print(tree_sq_norm({"a": jnp.array([3.0, 4.0]), "b": jnp.array(1.0)}))
      26.0
    """
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    if not _one_reduction(leaves):
        sums = sums_of_leaves(leaves, squares, window, together)
    else:
        # Each leaf's rows summed (on GPUs, in the pass that also accumulates
        # the leaf), the rows of leaves of one shape added up elementwise, then
        # summed: one reduction where XLA would make a second-stage kernel per
        # leaf, on every microbatch. (A last axis split over devices: its
        # rows' sums would be partial sums, reduced across devices as
        # vectors; its norm, as a scalar.)
        rows = [sq_norm(x) if _last_axis_split(x) else _row_sq_norms(x) for x in leaves]
        sums = summed_by_kind(rows, window)
    return sum_scalars(sums, result_type(_F32, *(x.dtype for x in sums)))


# True or False to choose the forms traced for GPUs (a tree's squared norm as
# one reduction, the statistics' vectors rewritten whole: `gpu_forms`)
# whatever the backend (tests, and benchmarks that compile for a GPU without
# one); None: on GPUs.
ONE_REDUCTION: bool | None = None


def _one_reduction(leaves: list[jax.Array]) -> bool:
    """Whether :func:`tree_sq_norm` adds up the leaves' rows before it
    reduces: on GPUs (XLA:CPU and TPUs make no kernel per leaf's second stage,
    and XLA:CPU pays for the extra pass), where adding them moves nothing
    between devices: in a process of one device (``jax.device_count()``), or
    where every leaf's type says where it is (explicit or manual mesh axes
    only); rows are added up by sharding. Else (any leaf on automatic axes
    with several devices about: rows the partitioner would all-gather to add
    up) every leaf is reduced on its own, as on other platforms."""
    if not leaves or not gpu_forms():
        return False
    return jax.device_count() == 1 or all(placed_by_type(x) for x in leaves)


def gpu_forms() -> bool:
    """Whether a program is traced in the forms chosen for GPUs: as
    :data:`ONE_REDUCTION` says where it is set, else where the default
    backend is a GPU."""
    if ONE_REDUCTION is not None:
        return ONE_REDUCTION
    return on_gpu()


def _last_axis_split(x: jax.Array) -> bool:
    """Whether ``x``'s type says its last axis is split over mesh axes."""
    spec = getattr(jax.typeof(x).sharding, "spec", None)
    return bool(spec) and x.ndim >= 1 and len(spec) >= x.ndim and bool(spec[-1])


def _row_sq_norms(x: jax.Array) -> jax.Array:
    """The squared norms of ``x``'s rows along its last axis (its squared
    elements for a vector or a scalar): they sum to ``‖x‖²``."""
    sq = squares(x)
    return jnp.sum(sq, axis=-1) if sq.ndim >= 2 else sq


def sq_norms(
    tree: Any,
    rows: bool,
    shape: tuple[int, ...],
    per_leaf: bool = False,
    window: Any = None,
    together: bool = True,
) -> jax.Array:
    """``tree_sq_norm(tree, window, together)``, or with ``rows`` each
    leading-axis row's (the rows' count in ``shape``, which also holds with no
    leaves at all); with ``per_leaf`` each leaf's apart, float32, stacked
    along a last axis."""
    if not rows and not per_leaf:
        return tree_sq_norm(tree, window, together)
    if rows:
        parts = [
            jnp.sum(jnp.square(jnp.abs(x).astype(_F32)), axis=tuple(range(1, x.ndim)))
            for x in jax.tree.leaves(tree)
        ]
    else:
        parts = [
            over_slices(sq_norm(jnp.asarray(x)).astype(_F32), window)
            for x in jax.tree.leaves(tree)
        ]
    if per_leaf:
        return _stacked(parts, shape)
    return sum(parts, jnp.zeros(shape, _F32))


def _stacked(parts: list[jax.Array], shape: tuple[int, ...]) -> jax.Array:
    """``parts`` (each of ``shape``) stacked along a new last axis."""
    if not parts:
        return jnp.zeros((*shape, 0), _F32)
    return jnp.stack(parts, axis=-1)


def taken_sq_norm(
    tree: Any,
    take: jax.Array,
    rows: bool = False,
    per_leaf: bool = False,
    together: bool = True,
) -> jax.Array:
    """:func:`_taken_sq_norm_custom`, typed (jax 0.11 annotates a
    ``custom_jvp``'s result as unknown to type checkers)."""
    return cast(jax.Array, _taken_sq_norm_custom(tree, take, rows, per_leaf, together))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _taken_sq_norm_custom(
    tree: Any,
    take: jax.Array,
    rows: bool = False,
    per_leaf: bool = False,
    together: bool = True,
) -> jax.Array:
    """``tree_sq_norm(tree)`` (with ``rows``: each leading-axis row's, and
    ``take`` of shape ``(D,)``; with ``per_leaf``: each leaf's, float32,
    stacked along a last axis), whose derivative ignores skipped and
    non-finite gradients.

    A skipped microbatch's (or device's) gradient may be NaN, and a window
    with a non-finite gradient is recorded and then reset; a later window's
    figures do not depend on them, but reverse mode multiplies their zero
    cotangent by ``2g``, and ``0 * NaN`` is NaN. So the tangent reads ``g``
    only where ``take`` holds and ``g`` is finite (at a non-finite ``g`` the
    value is not finite and has no derivative anyway). Zeroing the gradient
    with a ``where`` before the reduction would fix that too, but XLA:CPU then
    writes the selected gradient to a temporary buffer as large as the
    gradient; the custom derivative keeps the forward pass a bare reduction.
    ``together``: as :func:`tree_sq_norm` takes it.
    """
    return sq_norms(tree, rows, jnp.shape(take), per_leaf, take, together)


@_taken_sq_norm_custom.defjvp
def _taken_sq_norm_jvp(rows, per_leaf, together, primals, tangents):
    tree, take = primals
    d_tree, _ = tangents
    shape = jnp.shape(take)
    out = sq_norms(tree, rows, shape, per_leaf, take, together)

    def inner(g, dg):
        g, dg = jnp.asarray(g), jnp.asarray(dg)
        if jnp.issubdtype(dg.dtype, jax.dtypes.float0):
            return jnp.zeros(shape, out.dtype)
        keep = jnp.reshape(take, take.shape + (1,) * (g.ndim - take.ndim))
        g = jnp.where(keep & jnp.isfinite(g), g, jnp.zeros_like(g))
        # In the precision of the value (at least float32), as `sq_norms`
        # computes it: a float16 product g·dg overflows at |g·dg| > 65504, and
        # a bfloat16 one is rounded to 8 bits before the sum.
        dtype = compute_dtype(jnp.result_type(g, dg))
        g, dg = g.astype(dtype), dg.astype(dtype)
        prod = jnp.conj(g) * dg if jnp.iscomplexobj(g) else g * dg
        axes = tuple(range(1, g.ndim)) if rows else None
        dot = jnp.sum(jnp.real(prod), axis=axes).astype(out.dtype)
        return over_slices(dot, take)

    dots = [
        inner(g, dg) for g, dg in zip(jax.tree.leaves(tree), jax.tree.leaves(d_tree))
    ]
    if per_leaf:
        return out, 2 * _stacked(dots, shape).astype(out.dtype)
    return out, 2 * sum(dots, jnp.zeros(out.shape, out.dtype))


def materialized_on_gpu(tree: Any) -> Any:
    """``tree``, each leaf of two or more axes materialized on GPUs: for
    gradients that the accumulation and the statistics' squared norm both read.

    XLA:GPU fuses a reduction into a sibling elementwise pass over the same
    input (one pass over memory) when that input is a buffer, not when it is a
    matrix product's output, as a matrix's gradient usually is: the squared
    norm would read the gradient a second time. Behind an
    ``optimization_barrier`` (per leaf, so that no leaf's buffer lives longer
    than it must) each such gradient is a buffer, read once by both. Vectors
    and scalars (biases, scales) pass as they are: their gradients are sums
    over the batch, which XLA fuses into their accumulation, and their
    squares into :func:`tree_sq_norm`'s reduction of their shape of rows (a
    barrier costs them a kernel each, on every microbatch). Other platforms get
    ``tree`` as it is.
    """

    def leaf(x: Any) -> Any:
        if jnp.ndim(x) < 2:
            return x
        barrier = jax.lax.optimization_barrier
        return jax.lax.platform_dependent(
            x, cuda=barrier, rocm=barrier, default=lambda x: x
        )

    return jax.tree.map(leaf, tree)


def in_compute_precision(tree: Any) -> Any:
    """``tree`` with each floating (or complex) leaf in at least float32, the
    precision the running mean and the squared norms compute in; other leaves
    as they are.

    For a gradient that both read: converted once, the derivatives that flow
    back to a bfloat16 or float16 gradient from the two are summed in float32
    before they are rounded to its dtype, as one float32 computation of both
    would sum them (rounded apart, the large opposite terms of ``S`` cancel
    in the gradient's precision).
    """

    def leaf(x: Any) -> Any:
        dtype = jnp.result_type(x)
        if jnp.issubdtype(dtype, jnp.inexact):
            return jnp.asarray(x).astype(compute_dtype(dtype))
        return x

    return jax.tree.map(leaf, tree)


def _converted_apart(narrow: jax.Array) -> jax.Array:
    barrier = jax.lax.optimization_barrier
    narrow = jax.lax.platform_dependent(narrow, cpu=barrier, default=lambda x: x)
    return narrow.astype(compute_dtype(narrow.dtype))


@jax.custom_jvp
def _norm_view_leaf(wide: jax.Array, narrow: jax.Array) -> jax.Array:
    del wide  # only its derivative is taken (below)
    return _converted_apart(narrow)


@_norm_view_leaf.defjvp
def _norm_view_leaf_jvp(primals, tangents):
    _, narrow = primals
    return _converted_apart(narrow), tangents[0]


def for_squared_norms(wide: Any, narrow: Any) -> Any:
    """``wide`` (``in_compute_precision(narrow)``), for the statistics' squared
    norms to read while the accumulation reads ``wide`` itself.

    Its value is ``wide``'s, converted again from ``narrow`` where that is
    bfloat16 or float16: XLA:CPU fuses a bfloat16 conversion into a reduction,
    but one read by both the accumulation pass and a reduction is written to a
    float32 buffer of its own (twice the gradient's bytes). Behind an
    ``optimization_barrier`` on CPU the reduction converts its own copy (a
    float16 one XLA:CPU converts through a buffer either way). Its derivative
    is ``wide``'s, so the derivatives that flow back through the statistics and
    the running mean still meet in float32.
    """

    def leaf(w: Any, x: Any) -> Any:
        if jnp.result_type(w) == jnp.result_type(x):
            return w
        return _norm_view_leaf(w, x)

    return jax.tree.map(leaf, wide, narrow)
