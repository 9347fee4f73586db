"""The token-weighted running mean: the one piece of arithmetic the package uses.

Microbatch ``i`` contributes its mean ``gᵢ`` with weight ``nᵢ`` (its number of
real tokens). The weighted mean ``Σ nᵢ gᵢ / Σ nᵢ`` is kept as a running mean
(West 1979)::

    N ← N + n
    m ← m + (g − m) / (N / n)

which never forms the sum ``Σ nᵢ gᵢ`` (so it cannot overflow fp16/bf16), needs no
total known in advance, and, with equal weights, is bit-identical under ``jit``
to the unweighted running mean ``m + (g − m) / j`` used by ``optax.MultiSteps``
(while the total stays below 2²⁴, where the float32 ratio ``N / n`` is the
exact integer ``j``).

The same pass can carry the spread of the values (West 1979's weighted variance
update): with ``δ = g − m`` taken before the update,

    S ← S + n·(N_old / N)·‖δ‖²

gives ``S = Σ nᵢ ‖gᵢ − m‖²`` over everything folded in, a scalar. With
``with_sq_deviation=True``, :func:`running_mean_update` also returns this
increment, reduced over all leaves in the same elementwise pass.

All functions here are total: a zero weight leaves ``(m, N)`` bit-identical even
when ``g`` holds NaN or inf (and its increment of ``S`` is exactly 0), and the
first positive weight after ``N == 0`` overwrites whatever ``m`` held.

References:
  D. H. D. West, "Updating mean and variance estimates: an improved method",
  Communications of the ACM 22(9), 1979.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
import numpy as np

from masked_multistep._branch import cond
from masked_multistep._checks import (
    check_flag,
    host_float_scalar,
    host_int_to_float,
    is_host_int,
    real_array,
    refuse_narrow_float,
    short_repr,
)
from masked_multistep._placement import zeros_placed_as
from masked_multistep._shards import (
    over_slices,
    varying_axes,
    varying_like,
    window_axes,
)

__all__ = [
    "accumulator_dtype",
    "accumulator_fits",
    "all_finite",
    "compute_dtype",
    "fits",
    "placed_by_type",
    "promote_types",
    "result_type",
    "running_mean_update",
    "safe_fraction",
    "sq_norm",
    "sum_scalars",
    "summed_by_kind",
    "sums_of_leaves",
]


def promote_types(a: jax.typing.DTypeLike, b: jax.typing.DTypeLike) -> jnp.dtype:
    """``jnp.promote_types`` by jax's standard rules, whatever the caller's:
    the library picks its computation dtypes this way and casts its operands
    explicitly, so ``jax_numpy_dtype_promotion="strict"`` finds nothing to
    refuse in it."""
    with jax.numpy_dtype_promotion("standard"):
        return jnp.promote_types(a, b)


def result_type(*args: Any) -> jnp.dtype:
    """``jnp.result_type`` by jax's standard rules, whatever the caller's (see
    :func:`promote_types`): for arrays, whose weak types it honours."""
    with jax.numpy_dtype_promotion("standard"):
        return jnp.result_type(*args)


def compute_dtype(dtype: jax.typing.DTypeLike) -> jnp.dtype:
    """The dtype the update is computed in: at least float32."""
    return promote_types(dtype, jnp.float32)


def accumulator_dtype(leaf_dtype: Any, setting: Any) -> jnp.dtype:
    """The accumulator dtype of one leaf, under the wrapper's
    ``accumulator_dtype=`` ``setting``.

    ``None`` follows the leaf (at least float32); an explicit dtype is taken as
    given, even when it is less precise than the gradient (bfloat16 for float32
    gradients saves memory); complex leaves always get a complex accumulator,
    so the imaginary part is never dropped.

    Examples:
      >>> import jax.numpy as jnp
      >>> from masked_multistep._running_mean import accumulator_dtype
      >>> [str(accumulator_dtype(d, None)) for d in (jnp.bfloat16, jnp.complex64)]
      ['float32', 'complex64']
      >>> str(accumulator_dtype(jnp.complex64, jnp.bfloat16))
      'complex64'
    """
    leaf_dtype = jnp.dtype(leaf_dtype)
    if setting is None:
        return compute_dtype(leaf_dtype)
    if jnp.issubdtype(leaf_dtype, jnp.complexfloating):
        return promote_types(setting, leaf_dtype)
    return setting


def accumulator_fits(dtype: Any, setting: Any) -> bool:
    """Whether an accumulator leaf of ``dtype`` is one that
    :func:`accumulator_dtype` gives for some leaf under ``setting``."""
    dtype = jnp.dtype(dtype)
    if setting is None:
        return compute_dtype(dtype) == dtype
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return promote_types(setting, dtype) == dtype
    return dtype == setting


def fits(total: jax.Array, count: jax.Array) -> jax.Array:
    """Where ``total + count`` is representable in ``total``'s dtype (an
    integer total would wrap; a float one would be infinite)."""
    if jnp.issubdtype(total.dtype, jnp.integer):
        return count <= jnp.iinfo(total.dtype).max - total
    return jnp.isfinite(total + count)


def safe_fraction(num: jax.Array, den: jax.Array) -> jax.Array:
    """``num / den`` in float32 (or wider), and 0 where ``den == 0``.

    The denominator is replaced before dividing *and* the result is masked, so a
    zero denominator never produces ``0/0`` and never leaks NaN into gradients.
    """
    dtype = compute_dtype(result_type(num, den))
    num = jnp.asarray(num, dtype)
    den = jnp.asarray(den, dtype)
    nonzero = den != 0
    return jnp.where(nonzero, num / jnp.where(nonzero, den, 1), 0)


def sum_scalars(xs: Any, dtype: Any = None) -> jax.Array:
    """``Σ xs`` (scalars or arrays of one shape, of any inexact dtypes) in
    ``dtype``, by default theirs promoted by jax's standard rules, each cast
    explicitly: under ``jax_numpy_dtype_promotion="strict"`` a float32 and a
    float64 (or a complex) leaf's sums add up too. ``0.0`` if ``xs`` is empty
    (``dtype`` float32 if not given)."""
    xs = list(xs)
    if dtype is None:
        dtype = result_type(*xs) if xs else jnp.float32
    zero = jnp.zeros(jnp.shape(xs[0]) if xs else (), dtype)
    return sum((x if x.dtype == dtype else x.astype(dtype) for x in xs), zero)


def sq_norm(x: jax.Array) -> jax.Array:
    """``‖x‖² = Σ |xⱼ|²`` of one array, summed in at least float32 (real result)."""
    return jnp.sum(squares(x))


def squares(x: jax.Array) -> jax.Array:
    """``|xⱼ|²`` elementwise, in at least float32 (real, for complex ``x`` too)."""
    dtype = compute_dtype(x.dtype)
    x = x.astype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.square(x.real) + jnp.square(x.imag)
    return jnp.square(x)


# On CPUs, leaves of fewer elements are reduced together with the others of
# their shape (`sums_of_leaves`); a larger one alone, with all of XLA:CPU's
# threads.
SMALL_LEAF = 1 << 12


def sums_of_leaves(
    leaves: list[jax.Array],
    elementwise: Callable[[jax.Array], jax.Array],
    window: Any = None,
    together: bool = True,
) -> list[jax.Array]:
    """``Σ elementwise(x)`` over the elements of the leaves, in parts whose sum
    is the whole: each leaf's, combined over the shards that hold slices of it
    (``over_slices`` with ``window``), but on CPUs, with ``together``, the
    small leaves of one shape, dtype and placement in one reduction.

    XLA:CPU runs each reduction as a kernel of its own, whose launch costs
    more than a small leaf's work, and compiling it more than its share of
    the step (the window's finiteness test was 200 kernels of a 200-leaf
    model's step). Small leaves (fewer than :data:`SMALL_LEAF` elements) of
    one shape are added up elementwise (``elementwise`` of each) and the sum
    reduced, which XLA fuses into one kernel that reads each leaf where it
    lies. Such a kernel needs all its leaves at once: pass ``together=False``
    for leaves computed in the same step (a microbatch's gradients), which
    it would keep alive until the last of them is computed. The sums differ
    from the leaves' one by one in the last bits.

    Examples:
      >>> import jax.numpy as jnp
      >>> from masked_multistep._running_mean import sums_of_leaves, squares
      >>> parts = sums_of_leaves([jnp.ones(3), jnp.full(3, 2.0)], squares)
      >>> print(sum(parts))
      15.0
    """
    leaves = [jnp.asarray(x) for x in leaves]
    small = [together and _reduced_together(x) for x in leaves]
    parts = [
        over_slices(jnp.sum(elementwise(x)), window)
        for x, joins in zip(leaves, small, strict=True)
        if not joins
    ]
    joined = [elementwise(x) for x, joins in zip(leaves, small, strict=True) if joins]
    return parts + summed_by_kind(joined, window)


def summed_by_kind(arrays: list[jax.Array], window: Any = None) -> list[jax.Array]:
    """The sums of ``arrays`` grouped by kind (shape, dtype, the manual axes
    they vary over, sharding): each group added up elementwise, then reduced
    (and combined over the shards that hold slices, ``over_slices`` with
    ``window``), one kernel per group where XLA fuses the additions into the
    reduction. Arrays of one kind lie alike, so adding them moves nothing
    between devices (the sharding as their type says it: on one device too,
    a mesh's explicit axes of size 1 name them apart).

    Examples:
      >>> import jax.numpy as jnp
      >>> from masked_multistep._running_mean import summed_by_kind
      >>> print(*summed_by_kind([jnp.ones(2), jnp.ones(3), jnp.full(2, 2.0)]))
      6.0 3.0
    """
    groups: dict[Any, list[jax.Array]] = {}
    for x in arrays:
        kind = (x.shape, x.dtype, varying_axes(x), jax.typeof(x).sharding)
        groups.setdefault(kind, []).append(x)
    return [
        over_slices(jnp.sum(functools.reduce(operator.add, xs)), window)
        for xs in groups.values()
    ]


def _reduced_together(x: jax.Array) -> bool:
    """Whether :func:`sums_of_leaves` reduces ``x`` with other small leaves: on
    CPUs, a leaf of fewer than :data:`SMALL_LEAF` elements that its type says
    is replicated, or in a process of one device and not split by its type
    (adding it to another then moves nothing between devices)."""
    if x.size >= SMALL_LEAF or jax.default_backend() != "cpu":
        return False
    spec = getattr(jax.typeof(x).sharding, "spec", None)
    if spec is not None and any(spec):
        return False  # split where its type says
    return placed_by_type(x) or jax.device_count() == 1


def placed_by_type(x: jax.Array) -> bool:
    """Whether ``x``'s type says where it is: on a mesh of explicit or manual
    axes only."""
    mesh: Any = getattr(jax.typeof(x).sharding, "mesh", None)
    types: tuple[Any, ...] = tuple(getattr(mesh, "axis_types", ()))
    typed = (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Manual)
    return bool(types) and all(t in typed for t in types)


def all_finite(tree: Any, reduced: Any = (), window: Any = None) -> jax.Array:
    """Whether every element of every leaf of ``tree`` is finite (exact).

    ``x - x`` is 0 for every finite ``x`` and NaN for an inf or NaN, and a sum
    of zeros cannot overflow: one reduction per leaf, ``Σ (x − x)``, is finite
    exactly when every element is, with no conditional around it (XLA keeps
    ``x - x`` for floats: its simplifier folds it only for integers, as IEEE
    arithmetic requires). On 4 × 2048² float32 (XLA:CPU, two cores) it takes
    3.6 ms, a test of each element 9 ms, and a plain sum 2.6 ms.

    Args:
      tree: a pytree of arrays.
      reduced: optionally, a scalar already reduced from every element of
        ``tree`` by sums of finite terms (e.g. its squared norm); where it is
        finite the leaves are not read again.
      window: the window's figures (its token count and loss, or a flag made
        from them): inside ``shard_map``, a leaf that varies over a manual
        axis over which none of them does is a slice of the gradient, and the
        shards answer together (see ``_shards``).

    Returns:
      A boolean scalar.

    Examples:
      >>> import jax.numpy as jnp
      >>> from masked_multistep._running_mean import all_finite
      >>> big = jnp.full(4, 3e38)  # finite, but sums to inf
      >>> print(all_finite({"a": big}), all_finite({"a": big.at[1].set(jnp.inf)}))
      True False
    """
    leaves = [
        x
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    if not leaves:
        return jnp.ones([], jnp.bool_)

    def sums_of_zeros(leaves):
        return jnp.isfinite(sum_scalars(sums_of_leaves(leaves, _zeros, window)))

    if isinstance(reduced, tuple):
        return sums_of_zeros(leaves)
    # Inside shard_map, the leaves' answer varies as they do over the axes
    # that are not combined (those of the count): the constant too.
    axes = frozenset().union(*(varying_axes(x) for x in leaves))
    if window is not None:
        axes &= window_axes(window)
    return cond(
        jnp.isfinite(reduced),
        lambda _: varying_like(jnp.ones([], jnp.bool_), axes),
        sums_of_zeros,
        leaves,
    )


def _zeros(x: jax.Array) -> jax.Array:
    """``x − x``: 0 where ``x`` is finite, NaN elsewhere (see :func:`all_finite`)."""
    return x - x


def _host_int(x: Any, dtype: Any, name: str, dtype_text: str) -> Any:
    """A Python or numpy integer ``x`` by value in the integer ``dtype``, or a
    ``ValueError`` naming ``name`` where it does not fit (``jnp.asarray`` would
    wrap a numpy int64 into int32 without x64, or refuse a large Python int);
    anything else as it is."""
    if not is_host_int(x):
        return x
    info = np.iinfo(dtype)
    value = np.asarray(x, object)
    if not np.all((info.min <= value) & (value <= info.max)):
        raise ValueError(f"`{name}` ({value}) does not fit {dtype_text}")
    return np.asarray(value, dtype)


def _host_total(total: Any) -> Any:
    """A host integer ``total`` in jax's integer dtype (int32 without x64): a
    numpy int64 of 2**40 would wrap to 0, and the mean be overwritten."""
    dtype = jax.dtypes.canonicalize_dtype(np.int64)
    return _host_int(
        total,
        dtype,
        "total",
        f"{dtype.name}, jax's integer dtype here: pass it as a float "
        "(e.g. jnp.float32(total))",
    )


def _beyond_float_range(x: Any) -> bool:
    """Whether ``x`` is a host floating scalar (Python, numpy, 0-d array) of
    float32 or wider beyond the range of the float jax makes of it (float32
    without x64). (Narrower floats are refused as they are.)"""
    a = host_float_scalar(x)
    if a is None or a.dtype.itemsize < 4:
        return False
    top = np.finfo(jax.dtypes.canonicalize_dtype(a.dtype)).max
    return not bool(np.abs(a) <= top)


def _host_count(count: Any, total_dtype: Any) -> Any:
    """A host integer ``count`` by value: into an integer ``total``'s dtype if
    it fits, else a ``ValueError``; as a float otherwise."""
    if not jnp.issubdtype(total_dtype, jnp.integer):
        return host_int_to_float(count)
    info = np.iinfo(total_dtype)
    return _host_int(
        count,
        total_dtype,
        "count",
        f"`total`'s dtype {total_dtype} ([{info.min}, {info.max}])",
    )


def _as_array(x: Any, what: str, path: Any) -> jax.Array:
    """A leaf of ``what`` as an array, or a ``TypeError`` naming it (a string
    or an object that is no number)."""
    try:
        return jnp.asarray(x)
    except TypeError as err:
        raise TypeError(
            f"{what} at {jax.tree_util.keystr(path) or '<root>'} must be an "
            f"array or a number, got {short_repr(x)} of type {type(x).__name__}"
        ) from err


@overload
def running_mean_update(
    mean: Any,
    total: jax.typing.ArrayLike,
    value: Any,
    count: jax.typing.ArrayLike,
    *,
    with_sq_deviation: Literal[False] = False,
) -> tuple[Any, jax.Array]: ...


@overload
def running_mean_update(
    mean: Any,
    total: jax.typing.ArrayLike,
    value: Any,
    count: jax.typing.ArrayLike,
    *,
    with_sq_deviation: Literal[True],
) -> tuple[Any, jax.Array, jax.Array]: ...


def running_mean_update(
    mean: Any,
    total: jax.typing.ArrayLike,
    value: Any,
    count: jax.typing.ArrayLike,
    *,
    with_sq_deviation: bool = False,
) -> tuple[Any, jax.Array] | tuple[Any, jax.Array, jax.Array]:
    """Folds ``value`` with weight ``count`` into the running mean ``(mean, total)``.

    Args:
      mean: pytree, the current running mean (any float dtype; kept).
      total: scalar, the sum of the weights folded in so far.
      value: pytree with the structure of ``mean``, the new microbatch's mean.
      count: scalar, non-negative weight of ``value`` (any integer dtype with
        an integer ``total``, compared by value with the room left in it; any
        integer dtype, float32 or float64 with a float ``total``; a float
        ``count`` with an integer ``total``, and a bfloat16 or float16 one,
        are a ``TypeError``).
        Zero leaves ``mean`` and ``total`` bit-identical, whatever ``value`` holds;
        so does an array weight that is negative, NaN or infinite (a Python or
        numpy number such is a ``ValueError``, as is such a ``total``, or a
        host float ``total`` beyond its dtype's range), or that would take
        ``total`` past its dtype's range (an integer's maximum, a float's
        largest finite value: a Python or numpy number beyond a float
        ``total``'s range too; a Python or numpy integer that does not fit an
        integer ``total``'s dtype is a ``ValueError``), and so does any weight
        when ``total`` is negative, NaN or infinite (no sum of weights is).
      with_sq_deviation: also return ``n·(N_old/N)·Σ_leaves ‖value − mean‖²``,
        the increment of West's weighted sum of squared deviations, reduced in
        the same pass over the leaves (at least float32; exactly 0 when
        ``count == 0`` or when ``total == 0``, whatever ``mean`` holds).

    Returns:
      ``(new_mean, new_total)`` with the dtypes of ``(mean, total)``; with
      ``with_sq_deviation``, ``(new_mean, new_total, sq_deviation_increment)``.

    Raises:
      TypeError: if ``total`` or ``count`` is not a real number (a bool,
        complex or non-numeric one) or is in a float narrower than float32
        (bfloat16 rounds 3001 to 3008), a float ``count`` meets an integer
        ``total``, a leaf of ``mean`` is not floating (or complex), or a leaf
        of ``value`` is complex where ``mean``'s is real, or
        ``with_sq_deviation`` is not a bool.
      ValueError: if ``total`` or ``count`` is not a scalar, ``value`` does not
        have ``mean``'s tree structure and shapes, a host ``total`` or
        ``count`` is negative, NaN or infinite, a host float ``total`` is
        beyond its dtype's range, or a host integer ``count`` does not fit an
        integer ``total``'s dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> import masked_multistep as mm
      >>> m, n = jnp.zeros(()), jnp.array(0)
      >>> m, n = mm.running_mean_update(m, n, jnp.array(1.0), jnp.array(1))
      >>> m, n = mm.running_mean_update(m, n, jnp.array(4.0), jnp.array(2))
      >>> m, n = mm.running_mean_update(m, n, jnp.array(jnp.nan), jnp.array(0))
      >>> print(m, n)  # (1 * 1 + 2 * 4) / 3
      3.0 3

      The spread ``S = Σ nᵢ (gᵢ − m)²`` rides along:

      >>> m, n, s = jnp.zeros(()), jnp.array(0), jnp.zeros(())
      >>> for g, c in [(1.0, 1), (4.0, 2)]:
      ...     m, n, ds = mm.running_mean_update(m, n, jnp.array(g), jnp.array(c),
      ...                                       with_sq_deviation=True)
      ...     s = s + ds
      >>> print(s)  # 1 * (1 - 3)**2 + 2 * (4 - 3)**2
      6.0

    References:
      D. H. D. West, "Updating mean and variance estimates: an improved method",
      Communications of the ACM 22(9), 1979.
    """
    with_sq_deviation = check_flag(with_sq_deviation, "`with_sq_deviation`")
    for name, x, what in (
        ("`total`", total, "a sum of weights"),
        ("`count`", count, "a weight"),
    ):
        # A Python or numpy number is known here: negative or non-finite is a
        # mistake, as `tx.update` says of its count (arrays stay total).
        if isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(
            x, bool
        ):
            # (A Python int is finite, however large: one beyond float64 is
            # the documented no-op.)
            if not (x >= 0 and (isinstance(x, (int, np.integer)) or math.isfinite(x))):
                raise ValueError(
                    f"{name} must be a finite number >= 0 ({what}), got {x!r}"
                )
    if _beyond_float_range(total):
        # (As a sum of weights it would hold every later update.)
        raise ValueError(
            "`total` must be a finite number its dtype holds (float32 without "
            f"x64), got {total!r}"
        )
    total = real_array(_host_total(total), "`total`", scalar=True)
    count = _host_count(count, total.dtype)
    if _beyond_float_range(count):
        # A weight past any float total's range, which leaves the mean as it
        # was; made inf here, not by a cast that numpy warns of.
        count = math.inf
    count = real_array(count, "`count`", scalar=True)
    refuse_narrow_float(total.dtype, "`total`")
    refuse_narrow_float(count.dtype, "`count`")
    if jax.tree.structure(mean) != jax.tree.structure(value):
        raise ValueError(
            "`value` must have the tree structure of `mean`, got "
            f"{jax.tree.structure(value)} and {jax.tree.structure(mean)}"
        )
    if jnp.issubdtype(total.dtype, jnp.integer) and not jnp.issubdtype(
        count.dtype, jnp.integer
    ):
        # `total + count` would be cast back to the integer dtype, truncating a
        # fractional total (0.5 + 0.5 -> 0) and discarding the mean so far.
        raise TypeError(
            f"`count` has dtype {count.dtype} but `total` has the integer dtype "
            f"{total.dtype}, which would truncate it: pass a float `total` (e.g. "
            "jnp.zeros([], jnp.float32)) for fractional weights"
        )
    # A weight that is not a positive number, or whose addition overflows the
    # total (an integer total would wrap; an infinite weight makes N / n NaN),
    # is ignored like a zero weight. The test runs in the total's own dtype: a
    # count of another dtype is compared with the total's range first (an
    # int32 total and a uint32 count would be compared as int32, wrapped).
    if jnp.issubdtype(total.dtype, jnp.integer):
        top = np.iinfo(total.dtype).max
        in_range = count > 0
        if np.iinfo(count.dtype).max > top:
            in_range = in_range & (count <= jnp.asarray(top, count.dtype))
        addend = jnp.where(in_range, count, jnp.zeros_like(count)).astype(total.dtype)
        fits = in_range & (addend <= jnp.asarray(top, total.dtype) - total)
        new_total = total + addend
    else:
        # In the wider of the two dtypes, rounded once, as jax's standard rules
        # add them (cast explicitly: strict promotion refuses a mixed sum).
        wide = result_type(total, count)
        new_total = (total.astype(wide) + count.astype(wide)).astype(total.dtype)
        fits = jnp.isfinite(new_total)
    # A negative total is no sum of weights (a NaN or infinite one fails `fits`):
    # nothing is folded into a mean it could only corrupt.
    take = (count > 0) & fits & (total >= 0)
    first = total == 0
    # West's weight of δ below uses the window's ratio N / n (each leaf's update
    # forms its own in the leaf's precision).
    # Where the weight is not taken, 1 / 1 instead of N / n: an infinite count
    # would make inf / inf, whose NaN reaches the count's cotangent.
    count_or_1 = jnp.where(take, count, jnp.ones_like(count))
    total_or_1 = jnp.where(take, new_total, jnp.ones_like(new_total))
    sq_devs = []

    def leaf(path, m, g):
        m, g = _as_array(m, "`mean`", path), _as_array(g, "`value`", path)
        if not jnp.issubdtype(m.dtype, jnp.inexact):
            raise TypeError(
                f"`mean` at {jax.tree_util.keystr(path) or '<root>'} must be "
                f"floating (or complex), got dtype {m.dtype}"
            )
        if m.shape != g.shape:
            raise ValueError(
                f"`value` at {jax.tree_util.keystr(path) or '<root>'} has shape "
                f"{g.shape}, but `mean` has {m.shape}"
            )
        if jnp.iscomplexobj(g) and not jnp.iscomplexobj(m):
            raise TypeError(
                f"`value` at {jax.tree_util.keystr(path) or '<root>'} is complex "
                f"({g.dtype}) but `mean` is real ({m.dtype}): its imaginary part "
                "would be dropped"
            )
        dtype = compute_dtype(m.dtype)
        # N / n rather than n / N: with equal weights N / n is the exact integer
        # j, so the update equals optax.MultiSteps' `acc + (g - acc) / j` bit for
        # bit. Where the weight is zero the ratio is 1, not 0: the unselected
        # side of the `where` below then stays finite, so its cotangent
        # (0 / ratio) is 0, not NaN, and reverse-mode derivatives through a
        # zero-count microbatch are finite. It is computed in the leaf's own
        # precision: a float32 ratio would cap a float64 accumulator (under x64)
        # at float32 accuracy. Float64 weights (under x64) beside a float32
        # leaf keep their own range for it: 1e-40 is no float32 normal.
        real = result_type(jnp.finfo(dtype).dtype, count_or_1, total_or_1)
        n, total_n = jnp.asarray(count_or_1, real), jnp.asarray(total_or_1, real)
        ratio = jnp.where(take, safe_fraction(total_n, n), 1)
        m_c = m.astype(dtype)
        # A zero weight must not leak its (possibly NaN) value into the cotangent
        # of `g` either: zero it before any arithmetic. (Zeros laid out as the
        # mean: per device under `mm.deferred`'s vmap, split over a model axis.)
        g_c = jnp.where(take, g.astype(dtype), zeros_placed_as(m_c))
        # For the first value δ is 0, not measured from the stale mean (NaN
        # after a non-finite window), whose NaN would reach the cotangent of
        # the ratio, and so of a float count, through `δ / ratio`.
        delta = g_c - jnp.where(first, g_c, m_c)
        new = jnp.where(first, g_c, m_c + delta / ratio.astype(dtype))
        if with_sq_deviation:
            sq_devs.append(sq_norm(delta))
        return jnp.where(take, new, m_c).astype(m.dtype)

    with jax.named_scope("masked_multistep/running_mean"):
        new_mean = jax.tree_util.tree_map_with_path(leaf, mean, value)
        new_total_out = jnp.where(take, new_total, total).astype(total.dtype)
        if not with_sq_deviation:
            return new_mean, new_total_out
        # n·N_old/N = N_old / (N/n): the weight of δ in West's update, formed
        # in the spread's precision (float64 leaves under x64 with an integer
        # total would otherwise get a float32 weight). It is 0 for the first
        # value (N_old = 0, δ = 0), and that case is selected away anyway.
        sq_dtype = result_type(jnp.float32, *(d.dtype for d in sq_devs))
        ratio = safe_fraction(total_or_1.astype(sq_dtype), count_or_1.astype(sq_dtype))
        weight = safe_fraction(total.astype(sq_dtype), ratio)
        spread = sum_scalars(sq_devs, sq_dtype)
        keep = take & ~first
        sq_dev = jnp.where(keep, weight * jnp.where(keep, spread, 0), 0)
    return new_mean, new_total_out, sq_dev.astype(sq_dtype)
