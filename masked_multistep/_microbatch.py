"""In-jit microbatching: the full batch's token-mean gradient, one microbatch at a time.

One call splits the batch into ``k`` microbatches and runs them in a ``lax`` loop
inside the computation, so peak memory follows the microbatch while the result
is that of the full batch. The loop is a ``lax.fori_loop`` over the strided split
of ``optax.microbatching``; how the per-microbatch results combine is an
``optax.microbatching.Accumulator`` built on :func:`running_mean_update`, the same
token-weighted running mean that :class:`MaskedMultiSteps` uses across steps.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable
from typing import (
    Any,
    Concatenate,
    Literal,
    Never,
    Protocol,
    TypeVar,
    cast,
    overload,
)

import jax
import jax.numpy as jnp
import numpy as np
import optax

from masked_multistep import _equinox, _nnx_state, _stats, _stats_state
from masked_multistep._checks import (
    check_flag,
    check_microbatches,
    check_param_leaves,
    check_takes,
    count_weight,
    holds_equinox_module,
    leaf_paths,
    refuse_unknown_keywords,
    short_repr,
    signature,
    wider_than_float64,
    without_annotations,
    wrapped_host_ints,
)
from masked_multistep._collectives import reduced_leaf_of_types
from masked_multistep._placement import names_an_axis
from masked_multistep._running_mean import (
    compute_dtype,
    promote_types,
    running_mean_update,
)
from masked_multistep._shards import varying_axes_of_type, varying_like

__all__ = ["microbatched_value_and_grad"]

# Keywords of other APIs, for microbatched_value_and_grad (and its data
# parallel twin) to answer with where they went.
# Other libraries' names for the number of microbatches.
MICROBATCH_KEYWORDS = ("k", "microbatches", "n_microbatches", "accumulation_steps")
KEYWORD_HINTS = {
    **dict.fromkeys(
        MICROBATCH_KEYWORDS,
        "the number of microbatches is `num_microbatches` (or the second "
        "positional argument)",
    ),
    "argnums": (
        "gradients are taken with respect to the first argument of `loss_fn`, "
        "`params` (any pytree: put everything to differentiate in it)"
    ),
    "rng": "pass the key to the returned function: grad_fn(params, batch, rng=key)",
}

# Keywords a user may pass the returned grad_fn, which takes `rng=` alone.
CALL_HINTS: dict[str, str] = dict.fromkeys(
    ["key", "rngs", "prng_key", "dropout_rng", "seed"],
    "a PRNG key goes in grad_fn(params, batch, rng=key) (loss_fn gets each "
    "microbatch's as its `rng` keyword)",
)

# The gradients have the params' type (the same pytree; an NNX module passed
# whole with other state, or with `wrt=`, gives an `nnx.State` instead). The
# batch is typed by the call, not by `loss_fn`, which sees jax arrays where a
# loader may hand numpy ones.
ParamsT = TypeVar("ParamsT")
BatchT_contra = TypeVar("BatchT_contra", contravariant=True)


class GradFn(Protocol[ParamsT, BatchT_contra]):
    """What :func:`microbatched_value_and_grad` returns (and
    :func:`per_device_value_and_grad`, :func:`data_parallel_value_and_grad`):
    ``grad_fn(params, batch, *, rng=None) -> ((loss, count), grads)``, the
    gradients of the params' type. A type for annotations, as in a factory of
    such functions::

        def make_grad_fn(k: int) -> mm.GradFn[dict[str, jax.Array], Batch]:
            return mm.microbatched_value_and_grad(loss_fn, k)
    """

    def __call__(
        self,
        params: ParamsT,
        batch: BatchT_contra,
        *,
        rng: jax.typing.ArrayLike | None = None,
    ) -> tuple[Any, ParamsT]: ...


class GradFnWithStats(Protocol[ParamsT, BatchT_contra]):
    """What :func:`microbatched_value_and_grad` (and
    :func:`data_parallel_value_and_grad`) returns with ``with_stats=True``:
    ``grad_fn(params, batch, *, rng=None) -> ((loss, count), grads, stats)``,
    ``stats`` a :class:`WindowStats`."""

    def __call__(
        self,
        params: ParamsT,
        batch: BatchT_contra,
        *,
        rng: jax.typing.ArrayLike | None = None,
    ) -> tuple[Any, ParamsT, _stats_state.WindowStats[jax.Array]]: ...


class GradFnWithLeafStats(Protocol[ParamsT, BatchT_contra]):
    """What :func:`microbatched_value_and_grad` returns with ``with_stats=True,
    per_leaf_stats=True``: the statistics' per-leaf figures are pytrees."""

    def __call__(
        self,
        params: ParamsT,
        batch: BatchT_contra,
        *,
        rng: jax.typing.ArrayLike | None = None,
    ) -> tuple[Any, ParamsT, _stats_state.WindowStats[Any]]: ...


def _batch_size(batch: Any, num_microbatches: int) -> int:
    """The common leading size of ``batch``'s leaves, checked against ``k``."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise ValueError(
            f"`batch` must contain at least one array, got {jax.tree.structure(batch)}"
        )
    sizes = {}
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path) or "<root>"
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or not any(
            jnp.issubdtype(leaf.dtype, kind)
            for kind in (jnp.number, jnp.bool_, jax.dtypes.extended)
        ):
            raise TypeError(
                "`batch` leaves must be arrays of numbers (or keys), got "
                f"{type(leaf).__name__} {short_repr(leaf, 40)} at batch{name}: "
                "the rows to split into microbatches (close over anything else "
                "in `loss_fn`)"
            )
        shape = jnp.shape(leaf)
        if not shape:
            raise ValueError(
                f"`batch` leaves need a leading batch axis, but the leaf at {name} "
                "is a scalar"
            )
        if narrow := wrapped_host_ints(leaf):
            # Without x64 jax wraps a numpy int64 into int32 (3 * 2**30 became
            # negative) before `loss_fn` sees it; inside the caller's `jit`
            # that happens before this function runs.
            raise ValueError(
                f"The {leaf.dtype} `batch` leaf at batch{name} holds values "
                f"beyond {narrow} (without jax_enable_x64 jax would wrap them "
                f"into {narrow}): pass them in a dtype that holds them (float32 "
                "weights, say), or enable x64"
            )
        sizes[name] = shape[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(
            "`batch` leaves must share their leading (batch) size, got "
            + ", ".join(f"{name}: {size}" for name, size in sizes.items())
        )
    (size,) = set(sizes.values())
    if size % num_microbatches:
        raise ValueError(
            f"The batch size ({size}, leading axis of `batch`) must be divisible by "
            f"`num_microbatches`, got {num_microbatches}"
        )
    for path, leaf in leaves:
        sharding = jax.typeof(leaf).sharding
        axes = sharding.spec[0] if sharding.spec else None
        if axes is None:
            continue
        # Explicit sharding of the batch axis: each microbatch's rows must split
        # evenly over the axis' devices too (jax cannot reshape them otherwise).
        axes_t: tuple[Any, ...] = axes if isinstance(axes, tuple) else (axes,)
        devices = math.prod(sharding.mesh.shape[a] for a in axes_t)
        if (size // num_microbatches) % devices:
            raise ValueError(
                f"`batch`{jax.tree_util.keystr(path)} is sharded over the "
                f"AxisType.Explicit mesh axis {axes!r} "
                f"({devices} devices): each microbatch's {size} // "
                f"{num_microbatches} = {size // num_microbatches} rows must divide "
                "among them; choose `num_microbatches` so that they do"
            )
    return size


_REDUCTIONS = ("sum", "mean")

AuxReduction = Any
"""``"sum"``, ``"mean"``, or a pytree prefix of ``aux`` with those leaves."""


def _check_aux_reduction(aux_reduction: AuxReduction, has_aux: bool) -> None:
    """Checks the leaves of ``aux_reduction`` (when the function is built)."""
    if aux_reduction is None:
        return
    if not has_aux:
        raise ValueError(
            "`aux_reduction` says how `aux` leaves combine, so it needs "
            f"has_aux=True; got aux_reduction={aux_reduction!r} with has_aux=False"
        )
    for path, leaf in jax.tree_util.tree_flatten_with_path(aux_reduction)[0]:
        name = f"aux_reduction{jax.tree_util.keystr(path)}"
        if not isinstance(leaf, str):
            raise TypeError(
                f"`aux_reduction` leaves must be 'sum' or 'mean', got {leaf!r} of "
                f"type {type(leaf).__name__} at {name}"
            )
        if leaf not in _REDUCTIONS:
            raise ValueError(
                f"`aux_reduction` leaves must be 'sum' or 'mean', got {leaf!r} at "
                f"{name}"
            )


def _as_aux_leaf(leaf: Any, name: str) -> jax.Array:
    """An ``aux`` leaf as an array: Python float as float32, int as int32."""
    if isinstance(leaf, bool) or isinstance(leaf, np.bool_):
        raise TypeError(
            "`aux` leaves must be floating or integer arrays, got the bool "
            f"{leaf!r} at {name}"
        )
    if (wide := wider_than_float64(leaf)) is not None:
        # A numpy longdouble, which jax takes no array of: its float64 value.
        leaf = np.float64(wide)
    if isinstance(leaf, float) and not isinstance(leaf, np.generic):
        # (A numpy float64 scalar is a Python float too: it keeps its dtype,
        # as every numpy leaf does.)
        return jnp.asarray(leaf, jnp.float32)
    if isinstance(leaf, int):
        if not np.iinfo(np.int32).min <= leaf <= np.iinfo(np.int32).max:
            raise ValueError(
                f"The Python int {leaf} at {name} does not fit in int32 (Python "
                "int `aux` leaves are int32); return it as an array of the dtype "
                "you need"
            )
        return jnp.asarray(leaf, jnp.int32)
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        raise TypeError(
            "`aux` leaves must be floating or integer arrays, got "
            f"{type(leaf).__name__} {short_repr(leaf)} at {name}"
        )
    if narrow := wrapped_host_ints(leaf):
        # Without x64 jax wraps a numpy int64 into int32 (2**33 became 0).
        raise ValueError(
            f"The {leaf.dtype} `aux` leaf at {name} holds values beyond "
            f"{narrow} (without jax_enable_x64 jax would wrap them): "
            f"return it as a {narrow} array, or enable x64"
        )
    leaf = jnp.asarray(leaf)
    if not (
        jnp.issubdtype(leaf.dtype, jnp.floating)
        or jnp.issubdtype(leaf.dtype, jnp.integer)
    ):
        raise TypeError(
            "`aux` leaves must be floating or integer arrays, got dtype "
            f"{leaf.dtype} at {name}"
        )
    return leaf


def _aux_reductions(aux: Any, aux_reduction: AuxReduction) -> tuple[str, ...]:
    """``"sum"`` or ``"mean"`` for each leaf of ``aux``, in flattening order."""
    paths = leaf_paths(aux)
    leaves = jax.tree.leaves(aux)
    if aux_reduction is None:
        reductions = ["sum"] * len(leaves)
    else:
        try:
            expanded = jax.tree.map(
                lambda r, sub: jax.tree.map(lambda _: r, sub), aux_reduction, aux
            )
        except (ValueError, TypeError) as err:
            raise ValueError(
                "`aux_reduction` must be 'sum', 'mean', or a pytree prefix of "
                "`aux` with those leaves; got "
                f"{jax.tree.structure(aux_reduction)} for `aux` of structure "
                f"{jax.tree.structure(aux)}"
            ) from err
        reductions = jax.tree.leaves(expanded)
    for path, leaf, reduction in zip(paths, leaves, reductions, strict=True):
        is_float = jnp.issubdtype(leaf.dtype, jnp.floating)
        if aux_reduction is None and is_float:
            raise TypeError(
                f"aux{path} is floating ({leaf.dtype}): say how it combines over "
                "the microbatches with `aux_reduction`: 'mean' (weighted by the "
                "token counts like the loss: a metric computed as a masked mean, "
                "such as accuracy) or 'sum' (a metric summed over tokens, as "
                "Flax's examples return them); e.g. aux_reduction='sum', or a "
                "dict/tuple of 'sum' and 'mean' shaped like `aux`. Integer "
                "leaves are summed by default."
            )
        if reduction == "mean" and not is_float:
            raise TypeError(
                f"aux{path} is an integer ({leaf.dtype}) but `aux_reduction` "
                "says 'mean': a token-weighted mean needs a floating leaf; use "
                "'sum', or return the leaf as a float"
            )
    return tuple(reductions)


def _article(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"


def _describe(x: Any, inner: bool = False) -> str:
    """What ``x`` is, by structure, dtype and shape (never a tracer's class).

    >>> import jax.numpy as jnp
    >>> _describe(jnp.ones((4, 4)))
    'a float32[4,4] array'
    >>> _describe((jnp.array(3), {"acc": 1.0}))
    'a tuple of 2: (int32[], dict)'
    >>> _describe(2.5)
    'the Python float 2.5'
    """
    if x is None:
        return "None"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        array = f"{x.dtype}[{','.join(str(d) for d in x.shape)}]"
        return array if inner else f"{_article(array)} array"
    if isinstance(x, (tuple, list)):
        kind = f"{type(x).__name__} of {len(x)}"
        if inner:
            return kind
        return f"{_article(kind)}: ({', '.join(_describe(e, True) for e in x)})"
    if inner:
        return type(x).__name__
    if isinstance(x, (bool, numbers.Number)):
        return f"the Python {type(x).__name__} {x!r}"
    return _article(type(x).__name__)


def _is_scalar_number(x: Any) -> bool:
    """A scalar array or a Python number (what a count may be)."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(x.shape) == ()
    return isinstance(x, numbers.Number)


def _check_output(out: Any, has_aux: bool) -> tuple[Any, Any, Any]:
    """Splits ``loss_fn``'s output into ``(loss, weight, aux)``, checking each.

    ``weight`` is the count as float32 (converted by value); ``aux`` leaves are
    arrays (Python floats become float32, ints int32). Errors describe what
    ``loss_fn`` returned by structure, dtype and shape, and say how to fix it.
    """
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        if has_aux:
            raise TypeError(
                "With has_aux=True, `loss_fn` must return (mean_loss, (count, "
                f"aux)), got {_describe(out)}; `mean_loss, count = "
                "mm.masked_mean(values, mask)` gives the first two"
            )
        raise TypeError(
            f"`loss_fn` must return (mean_loss, count), got {_describe(out)}; "
            "`mm.masked_mean(values, mask)` returns that pair (to return more, "
            "pass has_aux=True and return (mean_loss, (count, aux)))"
        )
    loss, rest = out
    if has_aux:
        if not (isinstance(rest, (tuple, list)) and len(rest) == 2):
            fix = (
                "its second element is a plain count: drop has_aux=True, or "
                "return (mean_loss, (count, aux))"
                if _is_scalar_number(rest)
                else "its second element must be the pair (count, aux)"
            )
            raise TypeError(
                "With has_aux=True, `loss_fn` must return (mean_loss, (count, "
                f"aux)), got {_describe(out)}; {fix}"
            )
        count, aux = rest
    else:
        count, aux = rest, None
    if not (hasattr(loss, "dtype") or isinstance(loss, numbers.Number)):
        raise TypeError(
            "The loss returned by `loss_fn` must be a floating scalar (the "
            f"microbatch's mean loss), got {_describe(loss)}"
        )
    loss = jnp.asarray(loss)
    if loss.shape != ():
        raise ValueError(
            "The loss returned by `loss_fn` must be a floating scalar (the "
            f"microbatch's mean loss), got {_describe(loss)}; reduce it with "
            "`mm.masked_mean(values, mask)`, which returns (mean_loss, count)"
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        hint = ""
        if hasattr(count, "dtype") and _is_scalar_number(count):
            if jnp.issubdtype(count.dtype, jnp.floating):
                hint = "; it looks like the count: return (mean_loss, count)"
        raise TypeError(
            "The loss returned by `loss_fn` must be a floating scalar (the "
            f"microbatch's mean loss), got {_describe(loss)}{hint}"
        )
    if not jax.tree_util.treedef_is_leaf(jax.tree.structure(count)):
        # A container (its repr would show tracers): described by structure.
        if has_aux:
            hint = "; with has_aux=True the second element is (count, aux), count first"
        elif isinstance(count, (tuple, list)) and len(count) == 2:
            hint = "; if it is (count, aux), pass has_aux=True"
        else:
            hint = (
                "; `loss_fn` returns (mean_loss, count), and with has_aux=True "
                "(mean_loss, (count, aux)) to return metrics too"
            )
        raise TypeError(
            "The count returned by `loss_fn` must be a real scalar (the "
            f"microbatch's token count), got {_describe(count)}{hint}"
        )
    weight = count_weight(count, "The count returned by `loss_fn`")
    aux = jax.tree_util.tree_map_with_path(
        lambda path, leaf: _as_aux_leaf(leaf, f"aux{jax.tree_util.keystr(path)}"),
        aux,
    )
    return loss, weight, aux


def _check_params(params: Any, whole_ok: bool = False) -> None:
    """``params`` holds only floating (or complex) leaves, as ``jax.grad`` needs.

    An NNX module in ``params`` may hold only ``nnx.Param`` variables
    (``whole_ok``: the error says that the module itself may be passed whole).
    """
    _nnx_state.check_nnx_modules(params, whole_ok)
    check_param_leaves(
        params, "only floating (or complex) arrays, the variables to differentiate"
    )
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            hint = (
                ". An NNX module that holds RNG streams, batch statistics or "
                f"other non-parameter state: {_nnx_state.SPLIT_RECIPE}"
                if _nnx_state.holds_nnx(params)
                else ""
            )
            raise TypeError(
                "`params` must hold only floating (or complex) arrays, the "
                f"variables to differentiate, got dtype {dtype} at "
                f"params{jax.tree_util.keystr(path)}{hint}"
            )


def _vary_like(tree: Any, types: Any) -> Any:
    """``tree`` with each leaf made varying over the manual mesh axes over
    which the matching leaf of ``types`` varies.

    Inside ``jax.shard_map`` (with its replication check on), a loop's
    carry must keep its type: zeros built from shapes are the same on every
    shard, while the values folded into them (a shard's own gradients) vary.
    """
    return jax.tree.map(
        lambda x, t: varying_like(x, varying_axes_of_type(t)), tree, types
    )


def _shapes_of(traced: Any) -> Any:
    """``jax.eval_shape``'s answer for a traced call: its ``out_info``, each
    output's sharding on ``AxisType.Explicit`` axes kept.

    On a mesh that also has ``Auto`` axes, jax's ``out_info`` leaves every
    sharding out, and zeros built from it would be replicated where the
    values folded into them are split over an explicit axis (the gradient
    of a parameter sharded over an explicit model axis beside an automatic
    data axis): a loop carry of two types.
    """

    def shape(info: Any, aval: Any) -> Any:
        sharding = getattr(aval, "sharding", None)
        if (
            not isinstance(info, jax.ShapeDtypeStruct)
            or info.sharding is not None
            or sharding is None
            or not names_an_axis(sharding.spec)
        ):
            return info
        return jax.ShapeDtypeStruct(
            info.shape,
            info.dtype,
            sharding=sharding,
            weak_type=info.weak_type,
            manual_axis_type=info.manual_axis_type,
        )

    return jax.tree.map(shape, traced.out_info, traced.out_avals)


def _raw_key_shape() -> tuple[int, ...]:
    """The shape of a raw key: the default implementation's key data."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


def _is_single_key(x: Any) -> bool:
    """Whether ``x`` is one PRNG key: a typed key of shape ``()``, or a raw
    ``uint32`` key (``jax.random.PRNGKey``)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return jnp.shape(x) == ()
    return dtype == jnp.uint32 and jnp.shape(x) == _raw_key_shape()


def _check_rng(rng: Any) -> jax.Array:
    """``rng`` as a PRNG key array: a typed key or a raw ``uint32`` key."""
    try:
        key = jnp.asarray(rng)
    except TypeError as err:
        raise TypeError(
            "`rng` must be a PRNG key (jax.random.key(...) or "
            f"jax.random.PRNGKey(...)), got {type(rng).__name__}"
        ) from err
    if not _is_single_key(key):
        raise TypeError(
            "`rng` must be a single PRNG key (jax.random.key(...) or "
            f"jax.random.PRNGKey(...), raw keys of shape {_raw_key_shape()}), got "
            f"shape {key.shape} and dtype {key.dtype}"
        )
    return key


def _refuse_summed_gradients(shapes: Any, of_module: bool) -> None:
    """Inside ``shard_map``: raises if a microbatch's gradient is the same on
    every shard of an axis over which its count differs.

    The gradient with respect to a replicated (invariant) input is summed over
    the shards by the transpose of jax's implicit ``pcast``: each microbatch's
    gradient would already be the shards' sum, then weighed by this shard's own
    count, a wrong mean that ``weighted_mean_across`` could no longer tell.
    """
    _, count, _, grads = shapes
    if reduced := reduced_leaf_of_types(grads, count):
        path, axes = reduced
        # An NNX module's own copy: its parameters cast, the rest as it is.
        own = (
            f"(of an NNX module, its nnx.Param state: graphdef, params, rest = "
            f"nnx.split(model, nnx.Param, ...); model = nnx.merge(graphdef, "
            f"jax.lax.pcast(params, {axes[0]!r}, to='varying'), rest)) "
            if of_module
            else ""
        )
        raise ValueError(
            f"The gradient grads{path} is the same on every shard of {axes} "
            "while the count `loss_fn` returns differs between them: inside "
            "shard_map the gradient with respect to a replicated input is "
            "summed over the shards automatically, and each microbatch's sum "
            "would be weighed by this shard's own count. Pass this shard's own "
            f"copy, grad_fn(jax.lax.pcast(params, {axes[0]!r}, to='varying'), "
            f"batch) {own}and combine the shards' results with "
            f"mm.weighted_mean_across(grads, count, {axes[0]!r}); or use "
            "mm.data_parallel_value_and_grad, which does both"
        )


def _needs_rng(loss_fn: Callable[..., Any]) -> bool:
    """Whether ``loss_fn`` visibly needs the ``rng`` keyword: it cannot be
    called as ``loss_fn(params, microbatch)`` but can with ``rng=``."""
    try:
        sig = signature(loss_fn)
    except (TypeError, ValueError):  # builtins and the like
        return False
    try:
        sig.bind(None, None)
    except TypeError:
        try:
            sig.bind(None, None, rng=None)
        except TypeError:
            return False
        return True
    return False


def _check_accepts_rng(loss_fn: Callable[..., Any]) -> None:
    """Raises if ``loss_fn`` visibly cannot take the ``rng`` keyword."""
    try:
        sig = signature(loss_fn)
    except (TypeError, ValueError):  # builtins and the like: just call it
        return
    try:
        sig.bind(None, None, rng=None)
    except TypeError as err:
        raise TypeError(
            "`grad_fn` was called with `rng`, so `loss_fn` is called as "
            "loss_fn(params, microbatch, rng=key), but its signature "
            f"{without_annotations(sig)} does not accept an `rng` keyword argument"
            + _key_hint(loss_fn, required=False)
        ) from err


def _split(value: Any, reductions: tuple[str, ...]) -> tuple[Any, list, Any]:
    """``(means, sums, weight)``: the leaves to average, those to sum, the weight."""
    loss, weight, aux, grads = value
    leaves = jax.tree.leaves(aux)
    means = (loss, [x for x, r in zip(leaves, reductions) if r == "mean"], grads)
    sums = [x for x, r in zip(leaves, reductions) if r == "sum"]
    return means, sums, weight


def _sum_dtype(dtype: Any) -> Any:
    """Sums run, and are returned, in at least 32 bits: float32 for bfloat16
    and float16, int32 for int8 and int16, uint32 for uint8 and uint16. A total
    over the microbatches must not overflow where each microbatch's value fits
    (8 × 100 tokens in int8 would come back as 32, 8 × 10000 in float16 as
    inf)."""
    if jnp.issubdtype(dtype, jnp.floating):
        return compute_dtype(dtype)
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        return promote_types(dtype, jnp.uint32)
    return promote_types(dtype, jnp.int32)


def _token_weighted_accumulator(
    value_shapes: Any, reductions: tuple[str, ...], has_aux: bool
) -> optax.microbatching.Accumulator:
    """Folds per-microbatch ``(loss, weight, aux, grads)`` into full-batch values.

    The loss, the gradients and the ``"mean"`` aux leaves go through one
    :func:`running_mean_update` weighted by the microbatch's count; ``"sum"``
    aux leaves are summed over every microbatch. The carry holds the running
    means in at least float32, the sums and the float32 weight total.
    ``finalize`` casts back to the dtypes of ``value_shapes`` (one microbatch's
    ``(loss, count, aux, grads)`` as ``jax.ShapeDtypeStruct``; static, never
    written by ``init``: all four functions are pure) and returns
    ``microbatched_value_and_grad``'s output structure; ``aggregate`` folds a
    stack of values (leading microbatch axis) into one value of the same
    structure, as ``optax.microbatching.micro_vmap`` requires.
    """

    def init(value):
        means, sums, _ = _split(value, reductions)
        return (
            jax.tree.map(
                lambda s: jnp.zeros(
                    s.shape, compute_dtype(s.dtype), out_sharding=s.sharding
                ),
                means,
            ),
            [
                jnp.zeros(s.shape, _sum_dtype(s.dtype), out_sharding=s.sharding)
                for s in sums
            ],
            jnp.zeros((), jnp.float32),
        )

    def update(carry, value, index):
        del index
        acc_means, acc_sums, total = carry
        means, sums, weight = _split(value, reductions)
        # The counts are data (masks): constants to differentiation, as the
        # grads treat them, so the loss's derivative is the returned grads.
        weight = jax.lax.stop_gradient(weight)
        # A microbatch with no (or a non-finite, or a negative: weight 0) count
        # holds no tokens: it leaves the means as they were, whatever NaN its 0/0
        # mean produced.
        acc_means, total = running_mean_update(acc_means, total, means, weight)
        acc_sums = [a + s.astype(a.dtype) for a, s in zip(acc_sums, sums, strict=True)]
        return acc_means, acc_sums, total

    def combined(carry):
        """The carry as one value ``(loss, total, aux, grads)`` in its dtypes."""
        (loss, mean_aux, grads), sum_aux, total = carry
        loss_s, _, aux_s, grads_s = value_shapes
        mean_it, sum_it = iter(mean_aux), iter(sum_aux)
        aux_leaves = [
            next(mean_it if r == "mean" else sum_it).astype(
                _sum_dtype(s.dtype) if r == "sum" else s.dtype
            )
            for s, r in zip(jax.tree.leaves(aux_s), reductions, strict=True)
        ]
        return (
            loss.astype(loss_s.dtype),
            total,
            jax.tree.unflatten(jax.tree.structure(aux_s), aux_leaves),
            jax.tree.map(lambda g, s: g.astype(s.dtype), grads, grads_s),
        )

    def finalize(carry):
        loss, total, aux, grads = combined(carry)
        if has_aux:
            return (loss, (total, aux)), grads
        return (loss, total), grads

    def aggregate(stacked):
        one = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked
        )
        carry, _ = jax.lax.scan(
            lambda c, v: (update(c, v, None), None), init(one), stacked
        )
        return combined(carry)

    return optax.microbatching.Accumulator(init, update, finalize, aggregate)


@overload
def microbatched_value_and_grad(
    loss_fn: Callable[Concatenate[ParamsT, ...], Any],
    num_microbatches: int | np.integer,
    *,
    has_aux: bool | np.bool_ = False,
    aux_reduction: AuxReduction = None,
    with_stats: Literal[False] = False,
    per_leaf_stats: Literal[False] = False,
    wrt: None = None,
) -> GradFn[ParamsT, Any]: ...


@overload
def microbatched_value_and_grad(
    loss_fn: Callable[Concatenate[ParamsT, ...], Any],
    num_microbatches: int | np.integer,
    *,
    has_aux: bool | np.bool_ = False,
    aux_reduction: AuxReduction = None,
    with_stats: Literal[True],
    per_leaf_stats: Literal[False] = False,
    wrt: None = None,
) -> GradFnWithStats[ParamsT, Any]: ...


@overload
def microbatched_value_and_grad(
    loss_fn: Callable[Concatenate[ParamsT, ...], Any],
    num_microbatches: int | np.integer,
    *,
    has_aux: bool | np.bool_ = False,
    aux_reduction: AuxReduction = None,
    with_stats: Literal[True],
    per_leaf_stats: Literal[True],
    wrt: None = None,
) -> GradFnWithLeafStats[ParamsT, Any]: ...


@overload
def microbatched_value_and_grad(  # flags known at run time only (`cfg.stats`)
    loss_fn: Callable[Concatenate[ParamsT, ...], Any],
    num_microbatches: int | np.integer,
    *,
    has_aux: bool | np.bool_ = False,
    aux_reduction: AuxReduction = None,
    with_stats: bool | np.bool_,
    per_leaf_stats: bool | np.bool_ = False,
    wrt: None = None,
) -> (
    GradFn[ParamsT, Any]
    | GradFnWithStats[ParamsT, Any]
    | GradFnWithLeafStats[ParamsT, Any]
): ...


@overload
def microbatched_value_and_grad(  # with `wrt`: the gradients are an nnx.State
    loss_fn: Callable[..., Any],
    num_microbatches: int | np.integer,
    *,
    has_aux: bool | np.bool_ = False,
    aux_reduction: AuxReduction = None,
    with_stats: Literal[False] = False,
    per_leaf_stats: Literal[False] = False,
    wrt: Any,
) -> GradFn[Any, Any]: ...


@overload
def microbatched_value_and_grad(
    loss_fn: Callable[..., Any],
    num_microbatches: int | np.integer,
    *,
    has_aux: bool | np.bool_ = False,
    aux_reduction: AuxReduction = None,
    with_stats: Literal[True],
    per_leaf_stats: Literal[False] = False,
    wrt: Any,
) -> GradFnWithStats[Any, Any]: ...


@overload
def microbatched_value_and_grad(
    loss_fn: Callable[..., Any],
    num_microbatches: int | np.integer,
    *,
    has_aux: bool | np.bool_ = False,
    aux_reduction: AuxReduction = None,
    with_stats: Literal[True],
    per_leaf_stats: Literal[True],
    wrt: Any,
) -> GradFnWithLeafStats[Any, Any]: ...


@overload
def microbatched_value_and_grad(
    loss_fn: Callable[..., Any],
    num_microbatches: int | np.integer,
    *,
    has_aux: bool | np.bool_ = False,
    aux_reduction: AuxReduction = None,
    with_stats: bool | np.bool_,
    per_leaf_stats: bool | np.bool_ = False,
    wrt: Any,
) -> GradFn[Any, Any] | GradFnWithStats[Any, Any] | GradFnWithLeafStats[Any, Any]: ...


def microbatched_value_and_grad(
    loss_fn: Callable[Concatenate[ParamsT, ...], Any],
    # Required (the overloads above say so); None at run time, so that
    # `k=4` alone gets the hint below rather than Python's "missing argument".
    num_microbatches: int | np.integer | None = None,
    *,
    has_aux: bool | np.bool_ = False,
    aux_reduction: AuxReduction = None,
    with_stats: bool | np.bool_ = False,
    per_leaf_stats: bool | np.bool_ = False,
    wrt: Any = None,
    # Typed Never so that a type checker flags a misspelt keyword; at run time
    # it gets an error with a hint.
    **unknown: Never,
) -> (
    GradFn[ParamsT, Any]
    | GradFnWithStats[ParamsT, Any]
    | GradFnWithLeafStats[ParamsT, Any]
):
    """``jax.value_and_grad`` of a masked mean loss, one microbatch at a time.

    ``loss_fn(params, microbatch)`` returns the microbatch's mean loss and its
    token count ``nᵢ`` (as :func:`masked_mean` does). The returned function splits
    ``batch`` into ``k = num_microbatches`` microbatches, evaluates
    ``jax.value_and_grad`` on each in a ``lax`` loop inside the computation, and
    combines them with the token-weighted running mean (West 1979)::

        loss  = Σ nᵢ ℓᵢ / Σ nᵢ        grads = Σ nᵢ ∇ℓᵢ / Σ nᵢ        count = Σ nᵢ

    which is ``jax.value_and_grad`` of the full batch's masked mean loss (up to
    float rounding): exactly what one full-batch step would see, at the peak
    memory of one microbatch. (A loss that couples the examples of a batch,
    such as ``BatchNorm`` in training mode, sees each microbatch as a batch of
    its own; the README's section on in-jit microbatching has a recipe for
    linen's batch statistics.) The means are kept in at least float32 and returned
    in the dtypes ``loss_fn`` and its gradient have. Use it inside ``jit``; one
    call is one compiled loop, with no host round trips (outside ``jit`` the
    loop is traced and compiled again on every call).

    Semantics:
      * Microbatch ``j`` is ``batch[j::k]`` (rows ``j, j + k, j + 2k, …`` of every
        leaf), the strided split of ``optax.microbatching``: a batch sharded over
        devices along its leading axis stays evenly sharded in every microbatch,
        so each loop step runs data-parallel on all devices with no resharding.
        The combined result does not depend on the split (only rounding does)
        for a loss that is a mean over rows; one that couples rows (pairs, in-batch
        negatives) sees each microbatch as a batch of its own: keep coupled rows
        in one row (pairs stacked along a second axis, not consecutive rows). To
        reproduce a microbatch on the host, take ``batch[j::k]``.
      * Counts are weights in float32, and the returned total ``count`` is a
        float32 scalar: ``loss_fn`` may return any integer (8-64 bit, signed or
        unsigned), float32 or float64 count (not bfloat16 or float16, whose
        sums of a mask are already rounded), converted by value (never through
        int32), so the total is exact for integer totals up to 2**24 (16,777,216
        tokens), never wrapped. Beyond, it is a float32 running sum: each of
        the ``k`` additions rounds it by at most 2**-24 of it (6e-8), so it is
        within ``k·6e-8`` relative of the token total (as the weights are), and
        ``int(count)`` is the token total exactly only up to 2**24. Under x64
        too: float64 gradients weighed by fractional float64 counts (soft
        masks) are then as precise as float32 weights (about 6e-8 relative,
        per element more where terms cancel), not float64; whole counts up to
        2**24 are exact weights.
      * Counts are constants to differentiation (data, like a mask): ``grads``
        is ``Σ nᵢ ∇ℓᵢ / Σ nᵢ``, and derivatives of the returned ``loss`` and
        ``count`` treat the ``nᵢ`` alike. That is the full batch's gradient
        whenever the counts do not depend on ``params`` (masks, counts of real
        tokens). Weights computed from ``params`` (a learned soft mask) get
        their derivative only inside each microbatch's ``ℓᵢ``, not the
        ``Σ (ℓᵢ − loss) ∇nᵢ / Σ nᵢ`` between microbatches.
      * A microbatch whose count is not positive (``0``, and also negative or
        non-finite), or would take the float32 total past float32's range,
        contributes nothing to the means, even if its mean loss and
        gradients are NaN (an all-masked microbatch gives ``0/0``). If no
        microbatch has tokens, loss, gradients and ``"mean"`` aux are zeros and
        the count is ``0``. Reverse-mode derivatives through the outputs (a
        gradient-norm penalty, say) are finite and equal those of leaving the
        empty microbatches out, provided ``loss_fn``'s own derivatives are
        (compute its mean with :func:`masked_mean`, not ``sum / count``).
      * A microbatch with tokens whose loss or gradient is not finite makes
        the result non-finite, but not always the same non-finite value as
        the full batch's: an infinite mean comes back NaN once a later
        microbatch is folded in (the running mean subtracts it), so test
        results with ``isfinite``, not ``isinf``.
      * ``aux`` (with ``has_aux=True``): each leaf is either summed over the
        microbatches (``"sum"``: counts of correct tokens, the metric sums
        Flax's examples return; every microbatch is added, whatever its count,
        as the full batch's sum would) or averaged weighted by the token counts
        like the loss (``"mean"``: a metric computed as a masked mean over the
        same tokens, such as accuracy, comes back as its full-batch value).
        ``aux_reduction`` says which: ``"sum"``, ``"mean"``, or a pytree prefix
        of ``aux`` with those leaves (``{"acc": "mean", "hits": "sum"}``).
        Without it, integer leaves are summed and a floating leaf raises a
        ``TypeError`` naming it: the library cannot tell a sum from a mean.
        ``"mean"`` needs a floating leaf. Python floats in ``aux`` are float32,
        Python ints int32. Sums run and come back in at least 32 bits
        (bfloat16 and float16 as float32, int8 and int16 as int32, uint8 and
        uint16 as uint32), so that a total over the microbatches does not
        overflow where each microbatch's value fits; 32- and 64-bit integer
        totals keep their dtype and wrap past its range, as ``jnp.sum``'s do.
        Every other leaf comes back in its own dtype.
        Per-example outputs with a batch axis are
        not gathered: compute those in a separate forward pass.
      * Randomness: ``grad_fn(params, batch, rng=key)`` calls
        ``loss_fn(params, microbatch_j, rng=jax.random.fold_in(key, j))``, so
        each microbatch draws its own dropout masks, reproducibly for a given
        ``key`` (not the masks the full batch would draw with ``key``). Without
        ``rng``, ``loss_fn`` is called with two arguments.
      * ``params`` is any pytree of floating arrays, and so is an NNX module
        whose state is only ``nnx.Param`` (NNX modules are pytrees): pass the
        module as ``params`` and ``loss_fn`` receives it rebuilt around the
        traced parameters; the gradients come back as a module of the same
        class, which ``nnx.Optimizer.update(model, grads)`` takes (example
        below). A module that also holds RNG streams (``nnx.Rngs``), batch
        statistics or other variables goes in whole too: the gradients are
        taken with respect to its ``nnx.Param`` variables and come back as an
        ``nnx.State`` of them (as ``nnx.grad``'s do), and the rest of its
        state is carried from one microbatch to the next, in order, and
        written back into the module: each microbatch's dropout draws from
        the stream where the previous one left it, and the running batch
        statistics end where ``k`` calls of the module one after the other
        leave them (under ``jax.jit``, return the module from the step, as
        for ``nnx.Optimizer.update``; ``nnx.jit`` writes it back itself),
        except that a microbatch without tokens (all padding) leaves every
        variable but the RNG streams as it found them (a masked
        ``BatchNorm``'s statistics of no rows are ``0/0``; inside
        ``shard_map``, a value that is the same on every device, such as a
        call counter, is not held by one device alone). A
        ``loss_fn`` that adds variables to the module (``sow``) or changes a
        variable's dtype is an error: return such values as ``aux``. Only the
        variables are carried: a change ``loss_fn`` makes to the module's
        other attributes (``model.eval()`` inside it) is not seen by the next
        microbatch nor written back; set them before the call. The split form
        works as well:
        ``graphdef, params, rest = nnx.split(model, nnx.Param, ...)``, pass
        ``params``, and rebuild the module in ``loss_fn`` with
        ``nnx.merge(graphdef, params, rest, copy=True)``; state that such a
        ``loss_fn`` writes is not returned (``nnx.reseed(module,
        default=rng, dropout=rng)`` with ``rng=`` gives each microbatch its
        own dropout key). ``wrt=`` (an ``nnx`` filter, as
        ``nnx.Optimizer(..., wrt=...)`` takes it: ``nnx.LoRAParam`` for LoRA
        adapters) differentiates a module passed whole in those variables
        only (``nnx.Param`` variables, or a subclass: a filter that selects
        other variable types is a ``TypeError``): the gradients come
        back as an ``nnx.State`` of them, the module's other ``nnx.Param``
        variables are held fixed (no gradient of theirs is computed or kept,
        nor counted in the statistics; like the differentiated ones, a value
        that ``loss_fn`` writes to one is not kept), and its other state is
        carried as above.
      * An equinox module goes in whole as well, as
        ``eqx.filter_value_and_grad`` takes it: its floating (and complex)
        arrays are differentiated and the rest (its functions, Python numbers,
        integer arrays, PRNG keys) held fixed; the gradients are a module of
        the same structure with ``None`` there, the structure of
        ``eqx.filter(model, eqx.is_inexact_array)`` that the wrapper's state
        is built from. No ``eqx.nn.State`` is carried from microbatch to
        microbatch. A tree that holds an equinox module (a dict of modules
        and other arrays) is filtered whole the same way, as
        ``eqx.filter_value_and_grad`` filters it. Frozen layers: ``params,
        static = eqx.partition(model, spec)``, pass ``params`` and rebuild
        the module in ``loss_fn`` with ``eqx.combine(params, static)``.
      * ``with_stats=True`` also returns the call's :class:`WindowStats`, the
        statistics :class:`MaskedMultiSteps` keeps per window (the call is one
        window of ``k`` microbatches, a microbatch with an invalid count one
        with no tokens, where the wrapper under ``jit`` skips it): tokens,
        microbatches with tokens, loss, ``‖ḡ‖²`` and the gradient noise scale
        ``B_simple`` with its parts. It
        costs one squared-norm reduction of each microbatch's gradient.
        ``smoothed_noise_scale`` is this call's ``noise_scale``; smooth over
        calls with your own moving averages. With ``per_leaf_stats=True`` as
        well, each parameter leaf's: ``grad_sq_norm``, ``grad_var_trace``,
        ``true_grad_sq_norm``, ``noise_scale`` and ``smoothed_noise_scale``
        are then pytrees shaped like the gradients (as
        ``mm.window_stats(state, per_leaf=True)`` reads a wrapper's), the
        other fields the call's. A group of leaves' noise scale is the sum of
        its leaves' ``grad_var_trace`` over the sum of their
        ``true_grad_sq_norm`` (both add up over leaves; noise scales do not).

    Args:
      loss_fn: ``loss_fn(params, microbatch) -> (mean_loss, count)``, or
        ``(mean_loss, (count, aux))`` with ``has_aux=True``. ``mean_loss`` is a
        floating scalar; ``count`` an integer or floating scalar. When the
        returned function is called with ``rng``, ``loss_fn`` also takes the
        keyword argument ``rng`` (a PRNG key).
      num_microbatches: ``k``, an integer >= 1 (Python's, numpy's or a
        concrete 0-d jax array) that divides the batch size.
      has_aux: whether ``loss_fn`` returns ``aux`` beside the count.
      aux_reduction: how ``aux`` leaves combine: ``"sum"``, ``"mean"``, or a
        pytree prefix of ``aux`` with those leaves. Required when ``aux`` has a
        floating leaf; integer leaves default to ``"sum"``.
      with_stats: also return the call's :class:`WindowStats`.
      per_leaf_stats: with ``with_stats=True``, each parameter leaf's
        statistics (the squared norms are taken leaf by leaf anyway).
      wrt: for an NNX module passed whole as ``params``, an ``nnx`` filter of
        the variables to differentiate (default: its ``nnx.Param``
        variables); a pytree ``params`` takes none.

    Returns:
      ``grad_fn(params, batch, *, rng=None) -> ((loss, count), grads)``, or
      ``((loss, (count, aux)), grads)`` with ``has_aux=True``. ``batch`` is a
      pytree whose leaves share a leading batch axis; gradients are taken with
      respect to ``params`` (a pytree of floating arrays, or an NNX module of
      parameters) and have its structure (for a module with other state: an
      ``nnx.State`` of its parameters); ``count`` is float32; ``rng`` is a
      PRNG key (``jax.random.key`` or ``jax.random.PRNGKey``). With
      ``with_stats=True``, a third element: the :class:`WindowStats`.

    Raises:
      TypeError: if ``loss_fn`` is not callable, ``num_microbatches`` is not an
        integer, ``has_aux``, ``with_stats`` or ``per_leaf_stats`` is not a
        bool, ``per_leaf_stats=True`` comes without ``with_stats=True``, an
        ``aux_reduction`` leaf is not a string, ``wrt`` is not an ``nnx``
        filter; when called, if ``wrt`` is given with ``params`` that is not
        an NNX module, or selects none of its variables or ones that are not
        parameters, if ``params`` has
        a leaf that is not floating (the error names it; a tree holding an
        equinox module is filtered instead) or holds, below its
        top level, an NNX module with state other than ``nnx.Param`` (the
        error names its variables), ``loss_fn`` changes the variables of a
        module passed whole, their shapes or dtypes, ``rng`` is not a PRNG
        key or ``loss_fn`` cannot take it, or ``loss_fn``
        returns something other than the documented structure, a
        non-floating loss, a boolean or complex count or one in a float
        narrower than float32, an ``aux`` leaf that is
        neither float nor integer, a floating ``aux`` leaf without
        ``aux_reduction``, or an integer one marked ``"mean"``. Errors about
        what ``loss_fn`` returned describe it by structure, dtype and shape
        and say how to fix it.
      ValueError: if ``num_microbatches < 1``, an ``aux_reduction`` leaf is
        neither ``"sum"`` nor ``"mean"``, or ``aux_reduction`` is given without
        ``has_aux``; when called, if ``batch`` has no leaves, a scalar leaf,
        leaves of different batch sizes, a batch size not divisible by
        ``num_microbatches``, a batch leaf sharded over an
        ``AxisType.Explicit`` mesh axis whose devices do not divide each
        microbatch's rows, a 64-bit numpy integer leaf holding values that
        jax (without x64) would wrap into 32 bits, ``aux_reduction`` is not
        a prefix of ``aux``, or ``loss_fn``'s loss or count is not a scalar
        (or the count is a Python or numpy constant that is negative,
        non-finite or beyond float32's range; a jax array made inside
        ``loss_fn`` is traced with it, and such a count leaves its microbatch
        out, as under ``jit``); inside ``jax.shard_map``, if a gradient leaf
        is the same on every shard of an axis over which the count differs
        (the gradient of replicated params, already summed over the shards:
        pass ``jax.lax.pcast(params, axis, to="varying")``).

    Examples:
      Four rows with 1, 0, 2 and 1 real tokens, two microbatches (rows 0, 2 and
      rows 1, 3). The result is the full batch's token mean:

      >>> import jax, jax.numpy as jnp
      >>> import masked_multistep as mm
      >>> def loss_fn(w, mb):
      ...     return mm.masked_mean(w * mb["x"], mb["mask"])
      >>> batch = {"x": jnp.array([[1.0, 9.0], [5.0, 5.0], [2.0, 4.0], [3.0, 7.0]]),
      ...          "mask": jnp.array([[1, 0], [0, 0], [1, 1], [1, 0]], bool)}
      >>> grad_fn = jax.jit(mm.microbatched_value_and_grad(loss_fn, 2))
      >>> (loss, count), grad = grad_fn(jnp.array(2.0), batch)
      >>> print(loss, count, grad)  # 2 * (1 + 2 + 4 + 3) / 4, 4, (1 + 2 + 4 + 3) / 4
      5.0 4.0 2.5
      >>> (loss, count), grad = jax.value_and_grad(loss_fn, has_aux=True)(
      ...     jnp.array(2.0), batch)  # the full batch at once: the same values
      >>> print(loss, count, grad)
      5.0 4 2.5

      A metric sum (``"sum"``) and a masked-mean metric (``"mean"``) as aux:

      >>> def loss_with_aux(w, mb):
      ...     loss, n = mm.masked_mean(w * mb["x"], mb["mask"])
      ...     big = (mb["x"] > 2) & mb["mask"]
      ...     frac_big, _ = mm.masked_mean(big.astype(jnp.float32), mb["mask"])
      ...     return loss, (n, {"x_sum": jnp.sum(jnp.where(mb["mask"], mb["x"], 0)),
      ...                       "frac_big": frac_big})
      >>> grad_fn = mm.microbatched_value_and_grad(
      ...     loss_with_aux, 2, has_aux=True,
      ...     aux_reduction={"x_sum": "sum", "frac_big": "mean"})
      >>> (loss, (count, aux)), grad = jax.jit(grad_fn)(jnp.array(2.0), batch)
      >>> print(aux["x_sum"], aux["frac_big"])  # 1 + 2 + 4 + 3, 2 of 4 tokens > 2
      10.0 0.5

      An NNX module in place of ``params``, with dropout: ``rng=`` gives
      microbatch ``j`` the key ``fold_in(key, j)``, the same on every call:

      >>> import optax
      >>> from flax import nnx
      >>> model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
      >>> def model_loss(model, mb, rng):
      ...     y = nnx.Dropout(0.5)(model(mb["x"][..., None]), rngs=rng)
      ...     return mm.masked_mean(y[..., 0] ** 2, mb["mask"])
      >>> grad_fn = jax.jit(mm.microbatched_value_and_grad(model_loss, 2))
      >>> (loss, count), grads = grad_fn(model, batch, rng=jax.random.key(0))
      >>> print(type(grads).__name__, count)  # gradients: a module, like `model`
      Linear 4.0
      >>> (again, _), _ = grad_fn(model, batch, rng=jax.random.key(0))
      >>> bool(again == loss)
      True
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> _ = optimizer.update(model, grads)  # updates `model` in place

      LoRA adapters alone: ``wrt=`` takes the filter ``nnx.Optimizer`` does,
      and the frozen base gets no gradient:

      >>> lora = nnx.LoRA(1, 1, 1, base_module=nnx.Linear(1, 1, rngs=nnx.Rngs(0)),
      ...                 rngs=nnx.Rngs(1))
      >>> def lora_loss(model, mb):
      ...     return mm.masked_mean(model(mb["x"][..., None])[..., 0] ** 2, mb["mask"])
      >>> lora_fn = mm.microbatched_value_and_grad(lora_loss, 2, wrt=nnx.LoRAParam)
      >>> _, grads = lora_fn(lora, batch)
      >>> sorted(str(path[0]) for path, _ in nnx.to_flat_state(grads))
      ['lora_a', 'lora_b']
      >>> adapters = nnx.Optimizer(lora, optax.sgd(0.1), wrt=nnx.LoRAParam)
      >>> _ = adapters.update(lora, grads)  # the base weights stay as they were

      With ``with_stats=True`` the call also returns its :class:`WindowStats`.
      Here microbatch 0 (rows 0, 2) has 4 tokens of ``x = 1`` and microbatch 1
      (rows 1, 3) 4 tokens of ``x = 3``: gradients 1 and 3, mean 2, spread
      ``S = 4·1² + 4·1² = 8`` over ``K − 1 = 1``, ``|G|² = 4 − 8 / 8 = 3``:

      >>> batch = {"x": jnp.array([[1.0, 1.0], [3.0, 3.0], [1.0, 1.0], [3.0, 3.0]]),
      ...          "mask": jnp.ones((4, 2), bool)}
      >>> grad_fn = jax.jit(mm.microbatched_value_and_grad(loss_fn, 2,
      ...                                                  with_stats=True))
      >>> (loss, count), grad, stats = grad_fn(jnp.array(2.0), batch)
      >>> print(grad, stats.microbatches, stats.grad_var_trace,
      ...       stats.true_grad_sq_norm, stats.noise_scale)
      2.0 2 8.0 3.0 2.6666667

    References:
      D. H. D. West, "Updating mean and variance estimates: an improved method",
      Communications of the ACM 22(9), 1979.
    """
    refuse_unknown_keywords(
        "microbatched_value_and_grad",
        unknown,
        microbatched_value_and_grad,
        KEYWORD_HINTS,
    )
    if num_microbatches is None:
        raise TypeError(
            "microbatched_value_and_grad needs the number of microbatches: "
            "microbatched_value_and_grad(loss_fn, num_microbatches)"
        )
    k, has_aux, with_stats = _check_args(
        loss_fn, num_microbatches, has_aux, aux_reduction, with_stats
    )
    per_leaf = check_per_leaf_stats(per_leaf_stats, with_stats)
    return _grad_fn(
        loss_fn,
        k,
        has_aux,
        aux_reduction,
        "window" if with_stats else None,
        module_state=True,
        per_leaf=per_leaf,
        wrt=_nnx_state.check_wrt(wrt),
    )


def check_per_leaf_stats(per_leaf_stats: Any, with_stats: bool) -> bool:
    """``per_leaf_stats`` checked: a bool, and only with ``with_stats=True``."""
    per_leaf = check_flag(per_leaf_stats, "`per_leaf_stats`")
    if per_leaf and not with_stats:
        raise TypeError(
            "`per_leaf_stats=True` reads each leaf's share of the statistics the "
            "call returns with `with_stats=True`: pass both"
        )
    return per_leaf


def _looks_like_a_key(name: str) -> bool:
    """A parameter name for a PRNG key (``key``, ``dropout_key``, ``rngs``)."""
    return name == "key" or name.endswith("_key") or name.startswith(("rng", "prng"))


def _key_hint(loss_fn: Callable[..., Any], required: bool = True) -> str:
    """For a ``loss_fn`` whose third argument is a PRNG key by another name
    than ``rng`` (equinox names a dropout key ``key``): how its key goes in.
    (``required``: only a third argument without a default counts.)"""
    try:
        parameters = list(signature(loss_fn).parameters.values())
    except (TypeError, ValueError):
        return ""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    extra = [
        q.name
        for q in parameters[2:]
        if q.kind not in variadic
        and (q.default is inspect.Parameter.empty or not required)
    ]
    if len(extra) != 1 or extra[0] == "rng" or not _looks_like_a_key(extra[0]):
        return ""
    name = getattr(loss_fn, "__name__", "")
    name = name if name.isidentifier() else "loss_fn"
    return (
        f". A third argument, a PRNG key, must be named `rng` (`grad_fn(params, "
        f"batch, rng=key)` gives each microbatch a key of its own): rename "
        f"`{extra[0]}`, or pass `lambda params, microbatch, rng: "
        f"{name}(params, microbatch, {extra[0]}=rng)`"
    )


def _check_args(
    loss_fn: Any,
    num_microbatches: Any,
    has_aux: Any,
    aux_reduction: Any,
    with_stats: Any = False,
) -> tuple[int, bool, bool]:
    """The checks of :func:`microbatched_value_and_grad`'s arguments: ``k``,
    ``has_aux`` and ``with_stats`` as Python values."""
    if not callable(loss_fn):
        raise TypeError(
            f"`loss_fn` must be callable, got {loss_fn!r} of type "
            f"{type(loss_fn).__name__}"
        )
    check_takes(
        loss_fn,
        "`loss_fn`",
        "two arguments",
        2,
        "params, microbatch",
        _key_hint(loss_fn),
    )
    k = check_microbatches(num_microbatches, "`num_microbatches`")
    has_aux = check_flag(has_aux, "`has_aux`")
    with_stats = check_flag(with_stats, "`with_stats`")
    _check_aux_reduction(aux_reduction, has_aux)
    return k, has_aux, with_stats


def _grad_fn(
    loss_fn: Callable[..., Any],
    k: int,
    has_aux: bool,
    aux_reduction: AuxReduction,
    stats: Literal["window", "sums"] | None,
    module_state: bool = False,
    per_leaf: bool = False,
    wrt: Any = None,
) -> Any:
    """:func:`microbatched_value_and_grad`'s function, arguments checked.

    ``stats``: ``"window"`` appends the call's :class:`WindowStats`;
    ``"sums"`` its running sums ``(Σ nᵢ‖gᵢ‖², K)`` instead, for a caller that
    combines several calls into one window (:func:`data_parallel_value_and_grad`).
    ``module_state``: an NNX module passed whole may hold state other than its
    parameters (RNG streams, batch statistics), threaded through the
    microbatches in order and written back (:class:`_nnx_state.ModuleState`).
    ``per_leaf``: the statistics (or sums) of each parameter leaf as well.
    ``wrt``: an ``nnx`` filter of a module's variables to differentiate (with
    ``module_state``); its other ``nnx.Param`` variables are held fixed.
    """

    def normalized_loss(params, microbatch, key, rest, *, module, held):
        if module is not None:  # the module, rebuilt around traced params
            params = module.merge(params, rest)
        elif held is not None:  # an equinox module's functions and the like
            params = _equinox.combine(params, held)
        if key is None:
            out = loss_fn(params, microbatch)
        else:
            out = loss_fn(params, microbatch, rng=key)
        loss, weight, aux = _check_output(out, has_aux)
        rest = None if module is None else module.rest_of(params)
        return loss, (weight, aux, rest)

    def value_and_grad(
        module: _nnx_state.ModuleState | None, held: Any
    ) -> Callable[..., Any]:
        """One microbatch's ``((loss, weight, aux, grads), rest)``."""
        # The module's split is closed over, not traced: only `rest` changes.
        fn = functools.partial(normalized_loss, module=module, held=held)
        grad_of = jax.value_and_grad(fn, has_aux=True)

        def per_microbatch(params, microbatch, key, rest):
            (loss, (weight, aux, rest)), grads = grad_of(params, microbatch, key, rest)
            return (loss, weight, aux, grads), rest

        return per_microbatch

    def grad_fn(
        params: Any,
        batch: Any,
        *args: Any,
        rng: jax.typing.ArrayLike | None = None,
        **keywords: Any,
    ) -> tuple[Any, ...]:
        refuse_unknown_keywords("grad_fn", keywords, grad_fn, CALL_HINTS)
        if len(args) == 1 and _is_single_key(args[0]):
            raise TypeError(
                "grad_fn takes the PRNG key as a keyword: grad_fn(params, batch, "
                "rng=key); got it as a third positional argument"
            )
        if args:
            raise TypeError(
                f"grad_fn takes (params, batch, *, rng=None), got {len(args)} "
                "more positional argument(s): pack the batch's arrays into one "
                'pytree, e.g. grad_fn(params, {"x": x, "mask": mask}) (loss_fn '
                "gets each microbatch of it), and pass a PRNG key as rng=key"
            )
        if wrt is not None:
            _nnx_state.refuse_non_module(params, wrt)
        module = _nnx_state.ModuleState.of(params, wrt) if module_state else None
        held = None
        if module is not None:
            params = module.params
        elif holds_equinox_module(params):
            # Its floating arrays differentiated, the rest held fixed (as
            # `eqx.filter_value_and_grad` does).
            params, held = _equinox.split(params)
        # Traced once: the shapes' evaluation below traces it, and the loop's
        # body calls it on arguments of the same types, which hits jax's trace
        # cache and inlines the cached jaxpr (the same instructions as the
        # plain function's). `loss_fn` and its derivative are then traced once
        # per call, not twice.
        per_microbatch = jax.jit(value_and_grad(module, held), inline=True)
        rest = None if module is None else module.rest
        _check_params(params, whole_ok=module_state)
        batch_size = _batch_size(batch, k)
        if rng is not None:
            rng = _check_rng(rng)
            _check_accepts_rng(loss_fn)
        # Row r * k + j of a leaf is row r of microbatch j: a free (row-major)
        # reshape to (batch_size // k, k, ...), sliced along axis 1 in the loop.
        # The same strided split as `optax.microbatching.microbatch`, without its
        # column-major reshape, which copies the whole batch up front (time, and
        # a batch-sized temporary).
        strided = jax.tree.map(
            lambda x: jnp.reshape(x, (batch_size // k, k, *jnp.shape(x)[1:])), batch
        )

        def microbatch(j):
            return jax.tree.map(
                lambda x: jax.lax.dynamic_index_in_dim(x, j, 1, keepdims=False),
                strided,
            )

        def key(j):
            return None if rng is None else jax.random.fold_in(rng, j)

        with jax.named_scope("masked_multistep/microbatch"):
            try:
                shapes, rest_after = _shapes_of(
                    per_microbatch.trace(params, microbatch(0), key(0), rest)
                )
            except Exception as err:
                if type(err).__name__ == "TraceContextError":
                    # flax's: a variable (an nnx.Rngs' counter) that `loss_fn`
                    # closes over is written inside the loop's trace.
                    err.add_note(
                        "(`loss_fn` writes an NNX variable it closes over, such "
                        "as an nnx.Rngs' counter: keep it in the module passed "
                        "as `params`, which is carried from microbatch to "
                        "microbatch, or pass a key as grad_fn(..., rng=key))"
                    )
                    raise
                if rng is None and _needs_rng(loss_fn):
                    err.add_note(
                        "(`loss_fn` requires an `rng` argument, which `grad_fn` "
                        "passes only when given a key: grad_fn(params, batch, "
                        "rng=key); microbatch j gets jax.random.fold_in(key, j))"
                    )
                    raise
                err.add_note(
                    f"(raised while tracing `loss_fn` on one microbatch: "
                    f"num_microbatches={k} splits the batch's {batch_size} rows "
                    f"into {k} microbatches of {batch_size // k} (microbatch j "
                    f"holds rows j, j + {k}, ...); the shapes above are a "
                    "microbatch's)"
                )
                raise
            if module is not None:
                module.check_kept(rest_after)
            _refuse_summed_gradients(shapes, module is not None)
            accumulator = _token_weighted_accumulator(
                shapes, _aux_reductions(shapes[2], aux_reduction), has_aux
            )
            if stats is not None:
                accumulator = _stats.with_window_stats(
                    accumulator,
                    grads_and_weight=lambda value: (value[3], value[1]),
                    # ((loss, mean aux, grads), sum aux, total): the means in
                    # at least float32, before `finalize` casts them back.
                    window_of=lambda c: (c[0][0], c[2], c[0][2]),
                    sums_only=stats == "sums",
                    per_leaf=per_leaf,
                    # (Inside shard_map, the loss tells split parameters'
                    # slices, which it is the same for, from shards' own.)
                    window=lambda value: value[0],
                )

            def body(j, carry):
                carry, rest = carry
                value, after = per_microbatch(params, microbatch(j), key(j), rest)
                if module is not None:
                    # A microbatch without tokens (all padding) leaves the
                    # module's state as it was, its RNG streams aside.
                    after = module.held_without_tokens(value[1], after, rest)
                return accumulator.update(carry, value, j), after

            carry = (accumulator.init(shapes), rest)
            if any(
                varying_axes_of_type(t) for t in jax.tree.leaves((shapes, rest_after))
            ):
                # Inside shard_map: the carry starts as varying as one
                # microbatch leaves it.
                carry = _vary_like(
                    carry, jax.eval_shape(functools.partial(body, 0), carry)
                )
            carry, rest = jax.lax.fori_loop(0, k, body, carry)
            out = accumulator.finalize(carry)
            if module is not None:
                module.write_back(rest)
        # optax types `finalize` as returning any pytree; ours returns
        # `(value, grads[, stats])`, the grads a pytree like `params`.
        return cast("tuple[Any, ...]", out)

    return grad_fn
