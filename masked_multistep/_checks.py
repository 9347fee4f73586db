"""Argument checks and the count contract, in one place.

One rule for the exception class: ``TypeError`` for an argument of the wrong
kind or dtype, ``ValueError`` for a wrong value or shape (a dtype *setting*
that cannot serve, such as ``count_dtype=jnp.float16``, is a wrong value).
Configuration is checked when the wrapper is built, shapes and dtypes at trace
time, concrete values eagerly.

The count contract (what :class:`MaskedMultiSteps` accepts as ``count=``):

* any real scalar: a Python ``int`` or ``float``, a numpy or jax scalar of any
  integer dtype (8 to 64 bits, signed or unsigned), float32 or float64.
  Booleans, complex numbers, floats narrower than float32 (bfloat16 rounds a
  mask's count of 3001 to 3008) and arrays of other shapes are refused.
* It is converted *by value* to the state's count dtype (never through a
  narrower integer type, so nothing is wrapped or clipped). With the default
  ``float32``, integer token totals are exact up to 2²⁴ (16,777,216) per
  window; beyond that they are rounded to float32's 24-bit precision (each
  addition by at most 6e-8 of the total, far below the gradient's own
  rounding; a count of at most half the total's last bit may be lost:
  2²⁴ + 1 rounds to 2²⁴).
  ``count_dtype=jnp.int32`` is exact up to 2³¹ − 1 per window and takes
  integer counts only (a floating array is refused by its dtype, a Python
  float unless whole); ``float64``/``int64`` need ``jax_enable_x64``.
* A concrete negative, NaN, infinite or too large count raises ``ValueError``.
  Under ``jit``, where the value is unknown, such a count (or one that would
  overflow the window's total) is treated as a skipped microbatch and counted
  in ``state.num_invalid_counts``; it is never accumulated. A window whose
  total cannot take a count is full: it closes on that microbatch (with
  ``mm.deferred`` and ``every_k_schedule`` alone, where each device keeps its
  own total, a device's overflow drops only its share).

The same contract, with ``float32``, holds for the counts that
:func:`microbatched_value_and_grad` (returned by ``loss_fn``) and
:func:`weighted_mean_across` (one per shard) weight by (:func:`count_weight`):
their returned totals are float32, exact to 2²⁴ tokens and never wrapped; a
traced invalid count weighs 0 (that microbatch or shard contributes nothing).
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "INT32_MAX",
    "OWN_KEYWORDS",
    "PARAM_LEAF_TYPES",
    "check_accumulator_dtype",
    "check_count_dtype",
    "check_extra_args",
    "guessed_keyword",
    "check_flag",
    "check_grads_match",
    "check_microbatches",
    "check_param_leaves",
    "check_real",
    "check_value",
    "EQX_RECIPE",
    "count_weight",
    "equinox_hint",
    "holds_equinox_module",
    "holds_instance",
    "host_int_to_float",
    "is_host_int",
    "python_scalar",
    "real_array",
    "refuse_count_as_value",
    "refuse_narrow_float",
    "short_repr",
    "signature",
    "without_annotations",
    "same_avals",
    "to_count",
    "traced",
]

# The count dtypes a state may use: they hold token totals exactly (integers) or
# to 24/53 bits (floats). float16/bfloat16 would round 257 to 256.
_COUNT_DTYPES = ("float32", "float64", "int32", "int64")


def _x64() -> bool:
    return bool(jax.config.read("jax_enable_x64"))


def check_count_dtype(count_dtype: Any) -> jnp.dtype:
    """``count_dtype`` as a numpy dtype, refusing those that cannot hold counts."""
    try:
        if count_dtype is None:  # jnp.dtype(None) is float64
            raise TypeError
        dtype = jnp.dtype(count_dtype)
    except TypeError as err:
        raise TypeError(f"`count_dtype` must be a dtype, got {count_dtype!r}") from err
    if dtype.name not in _COUNT_DTYPES:
        raise ValueError(
            f"`count_dtype` must be one of {', '.join(_COUNT_DTYPES)}, got {dtype}: "
            "counts need an exact integer or at least float32 representation "
            "(float16 rounds 2049 to 2048 and overflows at 65504)."
        )
    if dtype.itemsize == 8 and not _x64():
        raise ValueError(
            f"`count_dtype={dtype}` needs `jax.config.update('jax_enable_x64', True)`"
            f"{_python_type_hint(count_dtype)}"
        )
    return dtype


def _python_type_hint(dtype: Any) -> str:
    """Says what a Python type given as a dtype means (``float`` is float64)."""
    # `is`, not `in`: numpy says np.dtype("float64") == float.
    if dtype is int or dtype is float:
        return f" (`{dtype.__name__}` is {dtype.__name__}64)"
    return ""


def check_accumulator_dtype(accumulator_dtype: Any) -> jnp.dtype | None:
    """``None`` (follow each gradient leaf) or a floating dtype."""
    if accumulator_dtype is None:
        return None
    try:
        dtype = jnp.dtype(accumulator_dtype)
    except TypeError as err:
        raise TypeError(
            f"`accumulator_dtype` must be a floating dtype or None, got "
            f"{accumulator_dtype!r}"
        ) from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"`accumulator_dtype` must be a floating dtype or None, got {dtype}"
        )
    if dtype.itemsize < 2 or dtype.itemsize > 8:
        # float8 and float4 keep 1-3 mantissa bits: a running mean in them
        # loses the gradient, and jax refuses to mix them with other floats.
        # numpy's longdouble is no jax dtype at all.
        raise ValueError(
            "`accumulator_dtype` must be a floating dtype of 16 to 64 bits "
            f"(bfloat16, float16, float32, float64 under x64) or None, got {dtype}"
        )
    if dtype.itemsize == 8 and not _x64():
        # Without x64 the arrays would be float32, and every update would then
        # refuse the state that `init` built as another wrapper's.
        raise ValueError(
            f"`accumulator_dtype={dtype}` needs "
            "`jax.config.update('jax_enable_x64', True)` (without it, jax "
            f"computes in float32){_python_type_hint(accumulator_dtype)}"
        )
    return dtype


def _kind(dtype: Any) -> str:
    if isinstance(dtype, np.dtype) and dtype.kind in "mM":
        return "other"  # numpy's timedelta64 is a signedinteger, not a number
    if jnp.issubdtype(dtype, jnp.bool_):
        return "bool"
    if jnp.issubdtype(dtype, jnp.integer):
        return "int"
    if jnp.issubdtype(dtype, jnp.floating):
        return "float"
    return "other"


_MISSING_COUNT = (
    "MaskedMultiSteps.update needs the microbatch's token count: call "
    "`tx.update(grads, state, params, count=n)`. Where another call runs it:\n"
    "- `optax.chain`: pass `count=n` to the chain's update (the chain "
    "forwards it);\n"
    "- flax linen: flax's `train_state.TrainState.apply_gradients` passes no "
    "extra arguments; use `masked_multistep.TrainState`, whose "
    "`apply_gradients(grads=..., count=n)` does;\n"
    "- flax NNX: `optimizer.update(model, grads, count=n)`;\n"
    "- a transformation around the wrapper must forward `count=` to it: "
    "`optax.lookahead` and `optax.contrib.sam` do not (put sam inside the "
    "wrapper, `MaskedMultiSteps(optax.contrib.sam(...), k)`)."
)


def _check_concrete(
    value: int | float, dtype: jnp.dtype, what: str, dtype_name: str | None = None
) -> None:
    """Refuses a bad concrete count; ``dtype_name`` names the dtype it is summed
    in (``count_dtype ...`` by default)."""
    dtype_name = dtype_name or f"count_dtype {dtype}"
    if isinstance(value, np.floating):
        # A float wider than Python's (`np.longdouble`), which `.tolist()`
        # leaves as it is: read as a Python float where it is one.
        if not np.isfinite(value):
            raise ValueError(
                f"{what} must be a finite non-negative number, got {value}"
            )
        if value < 0:
            raise ValueError(f"{what} must be non-negative, got {value!s}")
        if value > np.finfo(np.float64).max:
            raise ValueError(f"{what} is too large for {dtype_name}, got {value!s}")
        value = float(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} must be a finite non-negative number, got {value}")
    if value < 0:
        raise ValueError(f"{what} must be non-negative, got {value}")
    if jnp.issubdtype(dtype, jnp.integer):
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(
                f"{what} is fractional ({value}), but counts are summed in {dtype}: "
                "use the default count_dtype (float32) for fractional weights"
            )
        if value > np.iinfo(dtype).max:
            raise ValueError(
                f"{what} must be at most {np.iinfo(dtype).max} for {dtype_name}, "
                f"got {value}"
            )
    elif value > float(np.finfo(dtype).max):  # exact for a Python int of any size
        digits = str(value)
        if isinstance(value, int) and len(digits) > 30:
            digits = f"{digits[0]}.{digits[1:4]}...e+{len(digits) - 1}"
        raise ValueError(f"{what} is too large for {dtype_name}, got {digits}")


def same_avals(a: Any, b: Any, *, dtypes: bool = True) -> bool:
    """Whether two pytrees have the same structure, and leaves the same avals
    (the same shapes only, with ``dtypes=False``)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(
        jnp.shape(x) == jnp.shape(y)
        and (not dtypes or jnp.result_type(x) == jnp.result_type(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def refuse_narrow_float(dtype: Any, what: str) -> None:
    """A token count (or total) in a float narrower than float32 is refused.

    Summed in it, a mask's token count is already rounded when it arrives
    (3001 ones sum to 3008 in bfloat16), and a total stops growing: the
    weights would be off silently.
    """
    if _kind(dtype) == "float" and jnp.finfo(dtype).bits < 32:
        exact = 2 ** (jnp.finfo(dtype).nmant + 1)
        example = {
            jnp.dtype(jnp.float16): "in float16, 2049 tokens sum to 2048",
            jnp.dtype(jnp.bfloat16): "in bfloat16, 3001 tokens sum to 3008",
        }.get(
            jnp.dtype(dtype),
            f"in {jnp.dtype(dtype)}, {exact + 1} tokens sum to {exact}",
        )
        raise TypeError(
            f"{what} has dtype {jnp.dtype(dtype)}, which holds whole numbers "
            f"exactly only up to {exact}: a token count summed in it is rounded "
            f"({example}). Use float32 or an integer "
            "dtype (for a mask's count, `mask.sum(dtype=jnp.float32)`, or the "
            "count mm.masked_mean returns)"
        )


def to_count(
    count: Any,
    dtype: jnp.dtype,
    what: str = "`count`",
    shape: tuple = (),
    dtype_name: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``count`` converted by value to ``dtype``, and whether it may be used.

    Concrete counts are checked eagerly (``ValueError``); traced ones, and
    global arrays spanning several processes, return a validity flag (finite,
    non-negative, representable in ``dtype``), with the count replaced by zero
    where it is invalid. ``shape`` other than ``()`` takes an array of counts
    (one per device), checked element by element; the flag then has that shape.
    ``dtype_name`` names ``dtype`` in errors (``count_dtype ...`` by default).
    """
    if count is None:
        raise TypeError(_MISSING_COUNT)
    refuse_masked_array(count, what)
    if isinstance(count, (bool, np.bool_)):
        raise TypeError(f"{what} must be a number of tokens, got a bool ({count})")
    if isinstance(count, jax.ShapeDtypeStruct):
        raise TypeError(
            f"{what} must be a number of tokens, got a jax.ShapeDtypeStruct (a "
            f"shape and dtype, no value: {count}): pass the count itself (under "
            "`jax.eval_shape` or `.lower`, as an argument, not bound in)"
        )
    if shape != ():
        if not hasattr(count, "dtype") or not hasattr(count, "shape"):
            raise TypeError(
                f"{what} must be an integer or floating array of shape {shape}, "
                f"got {short_repr(count, 120)} of type {type(count).__name__}"
            )
        if tuple(count.shape) != shape:
            raise ValueError(
                f"{what} must be an integer or floating array of shape {shape}, "
                f"got shape {tuple(count.shape)} and dtype {count.dtype}"
            )
    elif not hasattr(count, "dtype") and isinstance(count, numbers.Real):
        # A Python int of any size or a Python float: check it exactly.
        value = int(count) if isinstance(count, numbers.Integral) else float(count)
        _check_concrete(value, dtype, what, dtype_name)
        return jnp.asarray(np.asarray(value).astype(dtype)), jnp.ones([], jnp.bool_)
    if not hasattr(count, "dtype") or not hasattr(count, "shape"):
        raise TypeError(
            f"{what} must be a real scalar, got {short_repr(count, 120)} of type "
            f"{type(count).__name__}" + _pair_hint(count, "count=count")
        )
    if tuple(count.shape) != shape:
        hint = ""
        if what == "`count`" and count.shape and count.shape != (1,):
            # A mask or per-sequence counts, most likely.
            hint = (
                ": the microbatch's total, e.g. `mask.sum()` or the count "
                "mm.masked_mean returns (an array of one count per device is "
                "for reduction=mm.deferred(...))"
            )
        raise ValueError(
            f"{what} must be a scalar (a token count), got shape "
            f"{tuple(count.shape)}{hint}"
        )
    kind = _kind(count.dtype)
    if kind not in ("int", "float"):
        raise TypeError(
            f"{what} must be an integer or floating "
            f"{'scalar' if shape == () else 'array'}, got dtype {count.dtype}"
        )
    refuse_narrow_float(count.dtype, what)
    if kind == "float" and jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"{what} has dtype {count.dtype}, but this MaskedMultiSteps sums counts "
            f"in {dtype}: pass integer counts (`count.astype({dtype})` for float "
            "counts of whole tokens, such as mm.per_device_value_and_grad's), or "
            "use the default count_dtype (float32), which takes integer and "
            "fractional counts alike"
        )
    # A global array of several processes is checked like a traced one: no
    # process can read the others' entries, and one raising alone (a bad entry
    # it holds) would leave the processes' windows a microbatch out of step, so
    # that their once-per-window all-reduces pair different windows.
    traced = isinstance(count, jax.core.Tracer) or (
        isinstance(count, jax.Array) and not count.is_fully_addressable
    )
    if not traced:
        # Concrete (numpy or jax): `.tolist()` is exact for every integer dtype.
        values = np.asarray(count).tolist()
        if shape == ():
            _check_concrete(values, dtype, what, dtype_name)
        else:
            for i, value in enumerate(np.ravel(np.asarray(values, dtype=object))):
                _check_concrete(value, dtype, f"{what}[{i}]", dtype_name)
        if isinstance(count, (np.ndarray, np.generic)):
            # Convert on the host: jnp.asarray would narrow int64 to int32 first.
            return jnp.asarray(np.asarray(count).astype(dtype)), jnp.ones(
                shape, jnp.bool_
            )
    arr = count
    if jnp.issubdtype(dtype, jnp.integer):
        # Range-check in the count's own dtype before any narrowing.
        info = np.iinfo(arr.dtype)
        ok = jnp.ones(shape, jnp.bool_)
        if info.min < 0:
            ok = arr >= 0
        if info.max > np.iinfo(dtype).max:
            ok = ok & (arr <= np.iinfo(dtype).max)
        n = jnp.where(ok, arr, jnp.zeros_like(arr)).astype(dtype)
        return n, ok
    n = arr.astype(dtype)  # by value, for every integer and float dtype
    ok = jnp.isfinite(n) & (n >= 0)
    if jnp.issubdtype(arr.dtype, jnp.signedinteger):
        ok = ok & (arr >= 0)
    return jnp.where(ok, n, jnp.zeros_like(n)), ok


_WEIGHT_DTYPE = jnp.dtype(jnp.float32)


def count_weight(count: Any, what: str) -> jax.Array:
    """``count`` as a float32 weight: :func:`to_count` to float32, 0 if invalid.

    The weight of a microbatch (or shard) in a token-weighted mean: any integer
    dtype converted by value (a numpy ``int64`` of 2**32 + 5 stays 2**32 + 5),
    a concrete bad count refused, a traced negative, NaN or infinite one
    weighing 0. Derivatives with respect to a floating count pass through.
    """
    if count is None:
        raise TypeError(f"{what} must be a number of tokens, got None")
    weight, _ = to_count(
        count, _WEIGHT_DTYPE, what, dtype_name="float32, the weights' dtype"
    )
    return weight


def returned_flag(x: Any, what: str) -> jax.Array:
    """``x``, what a user's function returned, as a boolean scalar, or an
    error naming ``what`` (``TypeError`` for another dtype, ``ValueError`` for
    another shape)."""
    try:
        flag = jnp.asarray(x)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"{what} must return a boolean scalar, got {type(x).__name__} "
            f"{short_repr(x)}"
        ) from err
    got = f"got dtype {flag.dtype} and shape {flag.shape}"
    if flag.dtype != jnp.bool_:
        raise TypeError(f"{what} must return a boolean scalar, {got}")
    if flag.shape != ():
        raise ValueError(f"{what} must return a boolean scalar, {got}")
    return flag


def real_array(x: Any, what: str, *, scalar: bool = False) -> jax.Array:
    """``x`` as an integer or floating array (a scalar with ``scalar``), or an
    error naming ``what``: bool, complex and non-numeric values are refused."""
    noun = "scalar" if scalar else "number"
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{what} must be a real {noun}, got a bool ({x})")
    try:
        arr = jnp.asarray(x)
    except OverflowError as err:  # a Python int beyond int64: a value too large
        raise ValueError(
            f"{what} holds a number too large, got {short_repr(x)}"
        ) from err
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"{what} must be a real {noun}, got {short_repr(x)} of type "
            f"{type(x).__name__}"
        ) from err
    if _kind(arr.dtype) not in ("int", "float"):
        raise TypeError(f"{what} must be a real {noun}, got dtype {arr.dtype}")
    if scalar and arr.shape != ():
        raise ValueError(f"{what} must be a scalar, got shape {arr.shape}")
    return arr


# What a params leaf may be: an array, or a Python number.
PARAM_LEAF_TYPES = (jax.Array, np.ndarray, np.generic, int, float, complex)


def holds_abstract(tree: Any) -> bool:
    """Whether ``tree`` holds ``jax.ShapeDtypeStruct`` leaves: a restore target,
    not the values a restore returns."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def refuse_restore_target(tree: Any, what: str) -> None:
    """A ``TypeError`` where ``tree`` (the argument ``what``) holds
    ``jax.ShapeDtypeStruct`` leaves: a restore target passed where the state
    that a restore returns belongs."""
    if holds_abstract(tree):
        raise TypeError(
            f"{what} holds jax.ShapeDtypeStructs, a restore target: restore the "
            "checkpoint against it (`checkpointer.restore(path, target)`), then "
            "pass what the restore returns"
        )


def training_state_kind(x: Any) -> str | None:
    """``"train_state"`` for a flax ``TrainState`` (it has ``params`` and
    ``opt_state``), ``"nnx_optimizer"`` for an ``nnx.Optimizer`` (``opt_state``
    and ``wrt``), else None: what holds an optimizer state where the params,
    or the state itself, belong."""
    if hasattr(x, "opt_state") and hasattr(x, "params"):
        return "train_state"
    if hasattr(x, "opt_state") and hasattr(x, "wrt"):
        return "nnx_optimizer"
    return None


def refuse_state_as_params(params: Any, argument: str = "`params`") -> None:
    """A ``TypeError`` where ``params`` is a training or optimizer state (a
    flax ``TrainState``, an ``nnx.Optimizer``, an optimizer's state) rather
    than the model's parameters, saying what to pass instead: their leaves are
    arrays too, and the error that follows would be about something else."""
    name = type(params).__name__
    kind = training_state_kind(params)
    if kind == "train_state":
        fix = "its `.params`"
    elif kind == "nnx_optimizer":
        fix = "nnx.state(model, nnx.Param), or the model itself where a module goes"
    elif hasattr(params, "inner_opt_state") and hasattr(params, "acc_grads"):
        fix = "the model's parameters (this is the wrapper's state)"
    else:
        return
    raise TypeError(
        f"{argument} must be the model's parameters, got {name}: pass {fix}"
    )


# What an equinox module's optimizer state is built from and its steps take:
# its floating arrays (its functions, other fields and non-floating arrays
# None), the structure of the gradients `eqx.filter_grad` returns. (Equinox's
# examples filter by `eqx.is_array`, the same for a module of floating arrays
# only; with integer or boolean arrays or PRNG keys, a state would hold leaves
# no gradient has.)
EQX_RECIPE = (
    "pass its floating arrays, `eqx.filter(model, eqx.is_inexact_array)`, to "
    "`init` and as params (the structure of `eqx.filter_grad`'s gradients)"
)


def short_repr(x: Any, width: int = 60) -> str:
    """``repr(x)``, cut to ``width`` characters with an ellipsis; a repr that
    ends in a memory address without it (``<function gelu>``, ``<...custom_jvp
    object>``). A string is quoted as it is."""
    text = repr(x) if isinstance(x, str) else without_addresses(repr(x))
    return text if len(text) <= width else text[: width - 3] + "..."


def without_addresses(text: str) -> str:
    """``text`` without the memory addresses that default reprs (objects',
    functions') hold, ``" at 0x7f..."``: they say nothing to a reader, cut to
    a width they leave half a hexadecimal number, and they differ between
    processes."""
    return _ADDRESS.sub("", text)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def holds_instance(tree: Any, module: str, *names: str) -> bool:
    """Whether ``tree`` is or holds an instance of the classes ``names`` of
    the module ``module`` (looked up in ``sys.modules``, never imported: a
    tree can hold one only once it is)."""
    found = sys.modules.get(module)
    if found is None:
        return False
    return bool(instances_in(tree, tuple(getattr(found, n) for n in names)))


def holds_equinox_module(tree: Any) -> bool:
    """Whether ``tree`` is or holds an equinox module."""
    return holds_instance(tree, "equinox", "Module")


def equinox_hint(tree: Any) -> str:
    """For a tree holding an equinox module (whose functions and other
    non-array fields are leaves too): what to do instead.

    Examples:
      >>> from masked_multistep._checks import equinox_hint
      >>> equinox_hint({"w": 1.0})  # no equinox module: no hint
      ''
    """
    if not holds_equinox_module(tree):
        return ""
    return f". For an equinox module, {EQX_RECIPE}"


def _filter_hint(tree: Any, acc_grads: Any, what: str) -> str:
    """Where ``tree`` (the params or gradients, holding an equinox module)
    and the state's accumulator differ only where one holds ``None`` (an
    equinox filter's placeholder) and the other a leaf: those paths, and that
    both must come from one filter."""
    if not holds_equinox_module(tree):
        return ""
    is_none = lambda x: x is None  # noqa: E731
    if jax.tree.structure(tree, is_leaf=is_none) != jax.tree.structure(
        acc_grads, is_leaf=is_none
    ):
        return ""  # another model, not another filter of it
    apart = [
        jax.tree_util.keystr(path)
        for (path, x), a in zip(
            jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_none)[0],
            jax.tree.leaves(acc_grads, is_leaf=is_none),
            strict=True,
        )
        if (x is None) != (a is None)
    ]
    return (
        f". The {what} and the state differ where one holds None, at "
        f"{first_three(apart)}: for an equinox module both come from one filter; "
        f"{EQX_RECIPE}, or for `eqx.partition(model, spec)` (frozen layers) its "
        "first part"
    )


def check_param_leaves(
    params: Any,
    wanted: str = "arrays (or Python numbers)",
) -> None:
    """Refuses a params leaf that is not an array or a Python number, or an
    array of PRNG keys (the error says the params must hold ``wanted``, and
    for an equinox module what to do): the accumulator's dtype
    comes from ``jnp.result_type``, which reads a string leaf as a dtype name
    ("int8") or fails without saying where ("relu"); a key's dtype fails
    later, where the accumulator is made, without saying where either."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        got = None
        if not isinstance(leaf, PARAM_LEAF_TYPES):
            got = f"{type(leaf).__name__} {short_repr(leaf)}"
        elif isinstance(leaf, jax.Array) and jnp.issubdtype(
            leaf.dtype, jax.dtypes.extended
        ):
            got = f"an array of {leaf.dtype}"
        elif getattr(leaf, "dtype", None) == jax.dtypes.float0:
            # jax.grad's zeros for an integer input, passed where params go.
            got = "a float0 array (a gradient's placeholder for an integer input)"
        if got is not None:
            raise TypeError(
                f"`params` must hold {wanted}, got {got} at "
                f"params{jax.tree_util.keystr(path)}" + equinox_hint(params)
            )


def _pair_hint(x: Any, fix: str) -> str:
    """For a 2-tuple where a scalar belongs: most likely mm.masked_mean's pair."""
    if isinstance(x, tuple) and len(x) == 2:
        return f": mm.masked_mean returns the pair (mean, count); pass `{fix}`"
    return ""


def refuse_masked_array(x: Any, what: str) -> None:
    """A ``TypeError`` for a numpy masked array as a count or loss: read as its
    data, a masked entry would count as the value it hides."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{what} is a numpy masked array (shape {np.shape(x)}, "
            f"{np.ma.count_masked(x)} of {np.size(x)} entries masked), whose "
            "masked entries would be read as the data they hide: pass a plain "
            "array "
            f"(`{what.strip('`')}.filled(0)` for an empty microbatch)"
        )


def refuse_other_devices(
    state_leaves: Iterable[Any], figures: Mapping[str, Any], grads: Any
) -> None:
    """Outside ``jit``: a ``ValueError`` naming the figure (``count``,
    ``value``, ``close_window``) or gradient leaf committed to other devices
    than the state (the first committed of ``state_leaves``: its token total,
    then its accumulator's, which may be committed where the total is not),
    where jax's error would name an operation inside the step. Under ``jit``
    jax names the argument itself."""
    reference = next(filter(_committed, state_leaves), None)
    if reference is None:
        return
    want = reference.sharding.device_set
    elsewhere = lambda x: _committed(x) and x.sharding.device_set != want  # noqa: E731
    if any(map(elsewhere, jax.tree.leaves(grads))):
        figures = {
            f"grads{jax.tree_util.keystr(path)}": leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(grads)
        } | dict(figures)
    for name, x in figures.items():
        if elsewhere(x):
            raise ValueError(
                f"`{name}` is on {_device_ids(x.sharding.device_set)}, the "
                f"wrapper's state on {_device_ids(want)}: put it where the state "
                "is (`jax.device_put(x, sharding)` with the sharding of a state "
                "leaf committed there), or pass a Python or numpy number"
            )


def _as_python_real(x: Any) -> Any:
    """A real host number that jax holds no array of (a ``fractions.Fraction``,
    a scalar ``np.longdouble`` wider than float64) as a Python float; anything
    else as it is."""
    if (wide := wider_than_float64(x)) is not None:
        return float(wide)
    if isinstance(x, numbers.Real) and not isinstance(
        x, (numbers.Integral, float, np.generic, jax.Array)
    ):
        return float(x)
    return x


def _committed(x: Any) -> bool:
    """Whether ``x`` is a concrete ``jax.Array`` committed to its devices."""
    return (
        isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and getattr(x, "committed", False)
    )


def _device_ids(devices: Any) -> str:
    ids = sorted(d.id for d in devices)
    if len(ids) == 1:
        return f"device {ids[0]}"
    return f"devices {first_three([str(i) for i in ids])}"


def check_value(value: Any) -> jax.Array | None:
    """``value=`` (a microbatch's mean loss) as a real scalar array."""
    if value is None:
        return None
    refuse_masked_array(value, "`value`")
    value = _as_python_real(value)
    if isinstance(value, tuple):
        raise TypeError(
            "`value` must be a real scalar (the microbatch's mean loss), got a "
            f"tuple of {len(value)}" + _pair_hint(value, "value=mean, count=count")
        )
    # A host int as the float it stands for (2**31 would not fit int32; one
    # beyond float64's range is infinite, as such a float would be); a numpy
    # int is still refused below, by its dtype, as the likely token count.
    host = host_int_to_float(value)
    _refuse_beyond_float_range(host, value)
    try:
        arr = jnp.asarray(host)
    except (TypeError, ValueError) as err:
        raise TypeError(
            "`value` must be a real scalar (the microbatch's mean loss), got "
            f"{short_repr(value)} of type {type(value).__name__}"
        ) from err
    if arr.shape != ():
        raise ValueError(
            "`value` must be a scalar (the microbatch's mean loss), got shape "
            f"{arr.shape}"
        )
    if _kind(arr.dtype) not in ("int", "float"):
        raise TypeError(f"`value` must be a real number, got dtype {arr.dtype}")
    refuse_count_as_value(value)
    return arr


def _refuse_beyond_float_range(host: Any, value: Any) -> None:
    """Refuses a host float ``value`` (Python, numpy, 0-d numpy array; ``host``
    as :func:`host_int_to_float` makes it, an integer beyond float64 infinite
    as such a float is) that is finite but beyond float32's range, in which
    the window's loss is averaged (also under x64): it would become infinite.
    An infinite or NaN one stays what it is."""
    a = host_float_scalar(host)
    if a is None:
        return
    x = float(a)
    if math.isfinite(x) and abs(x) > float(np.finfo(np.float32).max):
        raise ValueError(
            "`value` is beyond float32's range, in which the window's loss is "
            f"averaged (it would be infinite), got {short_repr(value)}"
        )


def refuse_count_as_value(value: Any) -> None:
    """An integer array as ``value=`` is most likely the token count, the two
    swapped (``count=loss, value=n``, which weighs microbatches by their loss).
    Python integers stay allowed."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None and _kind(dtype) == "int":
        raise TypeError(
            f"`value` has the integer dtype {dtype}: it looks like the token "
            "count. Pass `count=n, value=mean_loss` (the loss as a float; "
            "`value.astype(jnp.float32)` if an integer is meant)."
        )


def leaf_paths(tree: Any) -> list[str]:
    """Each leaf's path in ``tree``, as ``jax.tree_util.keystr`` spells it, in
    flattening order. (An NNX State and the dict of its pure arrays give the
    same paths.)"""
    return [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)
    ]


def _paired_with_state(
    tree: Any, acc_grads: Any, what: str, leaf_name: str
) -> Iterator[tuple[str, Any, Any]]:
    """``(where, leaf, accumulator leaf)`` for every leaf of ``tree``, whose tree
    structure must be the state's (``what``: "gradients", "params") and whose
    leaves must be arrays (or numbers; ``leaf_name`` names one in the error),
    each checked as it comes."""
    t_def, a_def = jax.tree.structure(tree), jax.tree.structure(acc_grads)
    if t_def != a_def:
        hint = ""
        if a_def == jax.tree.structure({"params": tree}):
            # `TrainState.create(params=model.init(...))`: linen's variables.
            hint = (
                ". The state was built for {'params': ...}, a linen model's "
                "variables: build it for variables['params'] "
                "(TrainState.create(params=variables['params'], ...))"
            )
        elif t_def == jax.tree.structure({"params": acc_grads}):
            hint = (
                ". These are {'params': ...}, a linen model's variables: pass "
                f"the {what} of variables['params']"
            )
        else:
            # (The {what} beside something else: a pair from a `grad` with
            # `has_aux=True`, say.)
            want = leaf_paths(acc_grads)
            inside = [
                jax.tree_util.keystr(path)
                for path, child in jax.tree_util.tree_flatten_with_path(
                    tree, is_leaf=lambda x: x is not tree
                )[0]
                if leaf_paths(child) == want
            ]
            if inside:
                hint = f". Its {inside[0]} has the state's structure: pass that alone"
                if what == "gradients":
                    hint += (
                        " (`jax.grad(..., has_aux=True)` and `nnx.grad(..., "
                        "has_aux=True)` return `(grads, aux)`)"
                    )
        if not hint:
            # An equinox module filtered otherwise than the state's params (or
            # whole, its functions as leaves).
            hint = _filter_hint(tree, acc_grads, what)
        raise ValueError(
            f"The {what}' tree structure does not match the state's: got "
            f"{t_def}, expected {a_def} (the structure of the params passed to "
            f"init){hint}"
        )
    for (path, x), a in zip(
        jax.tree_util.tree_flatten_with_path(tree)[0],
        jax.tree.leaves(acc_grads),
        strict=True,
    ):
        where = jax.tree_util.keystr(path) or "<root>"
        if not isinstance(x, PARAM_LEAF_TYPES):
            raise TypeError(
                f"The {leaf_name} at {where} must be an array, got "
                f"{type(x).__name__} {short_repr(x)}"
            )
        yield where, x, a


def check_grads_match(grads: Any, acc_grads: Any, *, per_device: bool) -> None:
    """The gradients have the structure and shapes of the accumulator (whose
    leaves lead with the device axis where ``per_device``: a deferred
    reduction's); a shape one axis off gets the hint that applies."""
    for where, g, a in _paired_with_state(grads, acc_grads, "gradients", "gradient"):
        if jnp.shape(g) != jnp.shape(a):
            hint = ""
            if not per_device and jnp.shape(g)[1:] == jnp.shape(a):
                hint = (
                    ": one per device? mm.per_device_value_and_grad's gradients "
                    "go to a MaskedMultiSteps built with "
                    "reduction=mm.deferred(mesh, axis_name). (Per-example "
                    "gradients are not taken: pass the microbatch's mean "
                    "gradient and its token count.)"
                )
            elif per_device and jnp.shape(a)[1:] == jnp.shape(g):
                hint = (
                    ": the state keeps one running mean per device "
                    "(reduction=mm.deferred), so it takes every device's own "
                    "gradient, stacked, as mm.per_device_value_and_grad returns "
                    "them, not one gradient for all"
                )
            raise ValueError(
                f"The gradient at {where} has shape {jnp.shape(g)}, but the state "
                f"expects {jnp.shape(a)}{hint}"
            )
        g_dtype, a_dtype = jnp.result_type(g), jnp.result_type(a)
        if g_dtype == jax.dtypes.float0:
            raise TypeError(
                f"The gradient at {where} is float0 (jax.grad's gradient for an "
                "integer parameter, with allow_int=True): pass float zeros for it "
                "(jnp.zeros(shape, jnp.float32)), or keep integer state out of "
                "the params"
            )
        if not jnp.issubdtype(g_dtype, jnp.inexact):
            # The window's mean goes to the inner optimizer in the gradients'
            # dtype: an integer one would truncate it (2.5 -> 2), silently.
            raise TypeError(
                f"The gradient at {where} has dtype {g_dtype}: gradients must be "
                "floating point (the window's mean is fractional and the inner "
                "optimizer gets it in the gradients' dtype, so it would be "
                "truncated); e.g. jnp.full(3, 2.0), not jnp.full(3, 2)"
            )
        g_complex = jnp.issubdtype(g_dtype, jnp.complexfloating)
        if g_complex != jnp.issubdtype(a_dtype, jnp.complexfloating):
            # Accumulated in a real dtype, or handed to the inner optimizer in
            # the (real) dtype of the gradients that close the window, a
            # complex value loses its imaginary part.
            if g_complex:
                problem = (
                    "(built from real params): its imaginary part would be dropped"
                )
            else:
                problem = (
                    "(built from complex params): the window's mean goes to the "
                    "inner optimizer in the dtype of the gradients that close it, "
                    "and cast to a real one it would lose its imaginary part; "
                    "pass complex gradients (for a flush, "
                    "jax.tree.map(jnp.zeros_like, params))"
                )
            kind = "complex" if g_complex else "real"
            raise TypeError(
                f"The gradient at {where} is {kind} ({g_dtype}), but the state's "
                f"accumulator is {a_dtype} {problem}"
            )
        if unreduced := unreduced_axes(g):
            # Each device holds a partial sum (the gradient with respect to
            # params resharded to P(reduced=...)); the running mean's zero
            # tests and its state are of reduced values.
            raise ValueError(
                f"The gradient at {where} is unreduced over the mesh axes "
                f"{sorted(unreduced, key=str)} (each device holds a partial "
                "sum): MaskedMultiSteps takes reduced gradients. Differentiate "
                "with respect to the params themselves (jax reduces the "
                "gradient once per microbatch), or, to reduce once per window, "
                "take every device's own gradient with "
                "mm.per_device_value_and_grad and build the wrapper with "
                "reduction=mm.deferred(mesh, axis_name)"
            )


def traced(tree: Any) -> bool:
    """Whether some leaf of ``tree`` is a tracer (``jit``, ``grad``, ``vmap``
    are tracing it): its values are not known here."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def type_spec(x: Any) -> Any:
    """The ``PartitionSpec`` in ``x``'s type (empty where it holds none)."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return spec if spec is not None else jax.sharding.PartitionSpec()


def unreduced_axes(x: Any) -> frozenset:
    """The mesh axes over which ``x``'s type says it is unreduced (a partial
    sum on every device, ``PartitionSpec(unreduced=...)``); empty otherwise."""
    return frozenset(getattr(type_spec(x), "unreduced", ()) or ())


def check_params_match(params: Any, acc_grads: Any, device_axes: int) -> None:
    """The params given to ``apply_gradients`` (or, where not None, to
    ``update``) have the structure and shapes of the params the state was
    built from (the accumulator's, less ``device_axes`` leading axes)."""
    if params is None:
        raise TypeError(
            "`params` must be the parameters to update, got None (apply_gradients "
            "returns the new params; `update` returns the updates alone)"
        )
    for where, p, a in _paired_with_state(params, acc_grads, "params", "params"):
        if jnp.shape(p) != jnp.shape(a)[device_axes:]:
            raise ValueError(
                f"The params at {where} have shape {jnp.shape(p)}, but the state "
                f"was built for {jnp.shape(a)[device_axes:]}"
            )


def is_host_int(x: Any) -> bool:
    """A Python int, or a numpy integer scalar or array (not a bool)."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, (np.ndarray, np.generic)):
        return np.issubdtype(x.dtype, np.integer)
    return isinstance(x, int)


def wrapped_host_ints(x: Any) -> np.dtype | None:
    """The narrower integer dtype that jax, without x64, would wrap ``x`` (a
    numpy integer array or scalar) into, if ``x`` holds a value beyond its
    range (a numpy int64 of 3 * 2**30 becomes negative); ``None`` otherwise."""
    if not isinstance(x, (np.ndarray, np.generic)) or x.dtype.kind not in "iu":
        return None
    narrow = np.dtype(jax.dtypes.canonicalize_dtype(x.dtype))
    if narrow == x.dtype or not x.size:
        return None
    info = np.iinfo(narrow)
    if int(np.min(x)) < info.min or int(np.max(x)) > info.max:
        return narrow
    return None


def host_float_scalar(x: Any) -> np.ndarray | None:
    """``x`` as a 0-d numpy float array where it is a host floating scalar
    (a Python float, a numpy floating scalar or 0-d array), else ``None``."""
    if isinstance(x, bool) or not isinstance(x, (float, np.floating, np.ndarray)):
        return None
    a = np.asarray(x)
    return None if a.ndim or a.dtype.kind != "f" else a


def wider_than_float64(x: Any) -> np.ndarray | None:
    """``x`` as a 0-d numpy array where it is a host floating scalar wider than
    float64 (``np.longdouble`` where the platform has one), which jax takes no
    array of; else ``None``."""
    a = host_float_scalar(x)
    return a if a is not None and a.dtype.itemsize > 8 else None


def host_int_to_float(x: Any) -> Any:
    """A Python or numpy integer as float64 numpy, anything else as is.

    Without x64, ``jnp.asarray`` makes a Python int of 2³¹ or more an
    ``OverflowError`` and wraps a numpy int64 into int32 (2⁴⁰ becomes 0); a
    float holds it (rounded beyond 2⁵³; ±inf beyond float64's range), and the
    callers clip or compare by value.
    """
    if not is_host_int(x):
        return x
    try:
        return np.asarray(x, np.float64)
    except OverflowError:  # a Python int beyond 1.8e308
        return np.asarray(math.inf if int(x) > 0 else -math.inf)


def python_scalar(value: Any, what: str, kinds: tuple, noun: str) -> Any:
    """A concrete 0-d numpy or jax array of one of the dtype ``kinds`` (not
    bool) as a Python number; anything else as it is, for the caller's checks."""
    if (
        isinstance(value, (jax.Array, np.ndarray, np.generic))
        and np.ndim(value) == 0
        and value.dtype != np.bool_
        and any(jnp.issubdtype(value.dtype, kind) for kind in kinds)
    ):
        try:
            return value.item()
        except jax.errors.ConcretizationTypeError:
            raise TypeError(
                f"{what} must be a concrete {noun}, not a traced value"
            ) from None
    return value


def signature(
    fn: Callable[..., Any], *, follow_wrapped: bool = True
) -> inspect.Signature:
    """``inspect.signature(fn)`` without evaluating its annotations.

    The checks read only the parameters' names, kinds and defaults. From
    Python 3.14 annotations are evaluated lazily (PEP 649), and
    ``inspect.signature`` evaluates them by default: a function annotated with
    a name imported only under ``typing.TYPE_CHECKING`` would raise
    ``NameError`` here though it runs. Such names are read as forward
    references instead. (Before 3.14 annotations are evaluated where a
    function is defined, and ``inspect.signature`` evaluates none.)

    >>> def loss_fn(params, batch, *, rng=None): ...
    >>> list(signature(loss_fn).parameters)
    ['params', 'batch', 'rng']
    """
    if sys.version_info >= (3, 14):
        import annotationlib

        return inspect.signature(
            fn,
            follow_wrapped=follow_wrapped,
            annotation_format=annotationlib.Format.FORWARDREF,
        )
    return inspect.signature(fn, follow_wrapped=follow_wrapped)


def without_annotations(sig: inspect.Signature) -> inspect.Signature:
    """``sig`` with its parameters and return unannotated, for messages
    (optax's annotations are long; unresolved names from Python 3.14 print as
    ``ForwardRef(...)``).

    >>> def loss_fn(params: dict, batch: dict) -> float: ...
    >>> str(without_annotations(signature(loss_fn)))
    '(params, batch)'
    """
    return sig.replace(
        parameters=[
            q.replace(annotation=inspect.Parameter.empty)
            for q in sig.parameters.values()
        ],
        return_annotation=inspect.Signature.empty,
    )


def refuses_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn``'s own signature has neither a parameter ``name`` nor
    ``**kwargs`` (a decorator's, not the function it wraps: one may add the
    keyword); a signature Python cannot read refuses nothing."""
    try:
        parameters = signature(fn, follow_wrapped=False).parameters
    except (TypeError, ValueError):
        return False
    return name not in parameters and not any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def check_takes_one(fn: Callable[..., Any], what: str, argument: str) -> None:
    """A ``TypeError`` naming ``what`` if ``fn`` cannot be called with one
    positional argument (``argument``, what it will get); callables whose
    signature Python cannot read pass unchecked."""
    check_takes(fn, what, "one argument", 1, argument)


def check_takes(
    fn: Callable[..., Any],
    what: str,
    count: str,
    n: int,
    arguments: str,
    hint: str = "",
) -> None:
    """A ``TypeError`` naming ``what`` if ``fn`` cannot be called with ``n``
    positional arguments (``count`` in words, ``arguments`` what they are;
    ``hint`` follows the message); callables whose signature Python cannot
    read pass unchecked."""
    try:
        sig = signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*[None] * n)
    except TypeError:
        if "rng" in sig.parameters:
            # `loss_fn(params, microbatch, *, rng)`: called with a key.
            try:
                sig.bind(*[None] * n, rng=None)
                return
            except TypeError:
                pass
        name = getattr(fn, "__name__", type(fn).__name__)
        raise TypeError(
            f"{what} must be a callable of {count} ({arguments}), got "
            f"{name}{without_annotations(sig)}{hint}"
        ) from None


def check_flag(value: Any, what: str) -> bool:
    """A concrete boolean: Python's, numpy's ``np.bool_``, or a 0-d bool array.

    Raises:
      TypeError: for anything else (``1``, ``"yes"``, ``None``, a traced bool),
        naming ``what`` and showing the value and its type.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if (
        isinstance(value, (jax.Array, np.ndarray))
        and np.ndim(value) == 0
        and value.dtype == np.bool_
    ):
        try:
            return bool(value)
        except jax.errors.ConcretizationTypeError:
            raise TypeError(
                f"{what} must be a concrete bool, not a traced value"
            ) from None
    raise TypeError(
        f"{what} must be a bool, got {value!r} of type {type(value).__name__}"
    )


def close_flag(value: Any) -> jax.Array | None:
    """``close_window=``'s flag: ``None`` where it is statically false (absent,
    ``False``: the update's program is the one without it), else a boolean
    scalar, traced or not.

    Raises:
      TypeError: for a value that is not a bool or a boolean array (``1``,
        ``"yes"``), naming the argument and showing what came.
      ValueError: for a boolean array that is not a scalar (one flag per
        device: every device closes its window on the same microbatch).
    """
    if value is None or (isinstance(value, (bool, np.bool_)) and not value):
        return None
    if isinstance(value, (bool, np.bool_)):
        return jnp.asarray(True)
    dtype = getattr(value, "dtype", None)
    if dtype is None or dtype != np.bool_:
        raise TypeError(
            "`close_window` must be a bool or a boolean scalar array (whether "
            f"this microbatch ends its window), got {short_repr(value)} of type "
            f"{type(value).__name__}" + ("" if dtype is None else f" and dtype {dtype}")
        )
    if np.shape(value) != ():
        raise ValueError(
            "`close_window` must be a boolean scalar, the same for every "
            f"device (they close their windows together), got shape "
            f"{np.shape(value)}"
        )
    return jnp.asarray(value)


def check_real(value: Any, what: str, *, positive: bool = True) -> float | int:
    """A concrete real number, finite and > 0 (or >= 0); ints stay ints."""
    value = python_scalar(value, what, (jnp.integer, jnp.floating), "number")
    if isinstance(value, (jax.Array, np.ndarray)) and np.ndim(value) != 0:
        raise ValueError(f"{what} must be a scalar, got shape {np.shape(value)}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        got = (
            f"dtype {value.dtype}"
            if isinstance(value, (jax.Array, np.ndarray, np.generic))
            else f"{value!r} of type {type(value).__name__}"
        )
        raise TypeError(f"{what} must be a real number, got {got}")
    value = int(value) if isinstance(value, numbers.Integral) else float(value)
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond any float
        finite = False
    if not finite or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        shown = str(value)
        if len(shown) > 24:  # an int of hundreds of digits
            shown = f"an integer of {len(shown)} digits"
        raise ValueError(f"{what} must be finite and {bound}, got {shown}")
    return value


#: The largest count of microbatches (the state counts them in int32).
INT32_MAX = int(np.iinfo(np.int32).max)


def check_microbatches(value: Any, what: str) -> int:
    """A concrete number of microbatches: an integer in ``[1, 2³¹ − 1]``.

    Python, numpy and concrete 0-d jax integers are accepted (the state counts
    microbatches in int32).
    """
    value = python_scalar(value, what, (jnp.integer,), "integer")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{what} must be an integer, got {value!r} of type {type(value).__name__}"
        )
    k = int(value)
    if k < 1:
        raise ValueError(f"{what} must be >= 1, got {k}")
    if k > INT32_MAX:
        raise ValueError(f"{what} must be in [1, 2**31 - 1], got {k}")
    return k


# The wrapper's own keywords; an extra argument this close to one is taken for
# a misspelling rather than forwarded (and dropped) to the inner optimizer.
OWN_KEYWORDS = ("count", "value", "close_window")
# Names a user may guess for `value=` (the microbatch's loss: forwarded, the
# inner optimizer would drop it, or get the closing microbatch's alone) and
# for `close_window=` (other trainers' among them: Hugging Face Accelerate's
# `sync_gradients`, Keras' `end_of_epoch`): names made of the words of a
# vocabulary alone, one of them a trigger (`loss_val`, `mb_loss`; `last_batch`,
# `flush_window`, `end_of_batch`, `force_update`). A name with another word
# (`loss_scale`, `value_fn`) may be an inner optimizer's own, and is forwarded.
_GUESSES = {
    "value": (
        frozenset(["loss", "losses", "val", "vals", "value", "values"])
        | frozenset(["objective", "obj", "fval", "metric"]),
        frozenset(
            ["mean", "avg", "average", "mb", "microbatch", "batch", "train"]
            + ["training", "step", "current", "cur", "total", "scalar"]
        ),
    ),
    "close_window": (
        frozenset(["close", "closes", "closing", "flush", "last", "final", "end"])
        | frozenset(["finish", "finished", "sync", "force", "now", "done", "commit"])
        | frozenset(["finalize", "finalise", "update", "apply", "accumulate"])
        | frozenset(["accumulating"]),
        frozenset(
            ["is", "of", "the", "window", "windows", "batch", "microbatch", "data"]
            + ["epoch", "step", "gradients", "grads", "accumulation", "accum"]
            + ["do", "should", "microbatches"]
        ),
    ),
}


def guessed_keyword(key: str) -> str | None:
    """The wrapper's own keyword that ``key`` guesses at by another name
    (``loss=`` for ``value=``, ``flush=`` for ``close_window=``), or None."""
    if key in OWN_KEYWORDS:
        return None
    # Words split at underscores and at camelCase humps (`isLast`, `meanLoss`).
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key).lower().replace("-", "_")
    words = set(snake.split("_")) - {""}
    if snake.startswith(("val_", "eval")) or words & {"validation", "test"}:
        # (Keras' `val_loss`: a validation loss, which an inner transformation
        # of the user's may take; not this microbatch's.)
        return None
    for meant, (triggers, others) in _GUESSES.items():
        if words & triggers and words <= triggers | others:
            return meant
    return None


def check_extra_args(
    extra_args: dict[str, Any],
    count: Any,
    taken: Callable[[str], bool],
) -> None:
    """Refuses an extra keyword that looks like a misspelt ``count``/``value``,
    and a missing ``count`` (naming the keywords that came instead); but for
    a keyword that ``taken`` says the inner optimizer names.

    Other extra arguments go to the inner optimizer, which (like optax's
    ``chain``) drops what it does not take: a misspelt ``value=`` would vanish
    and the inner optimizer get the window's NaN loss.
    """
    for key in extra_args:
        close = difflib.get_close_matches(key, OWN_KEYWORDS, n=1, cutoff=0.8)
        meant = guessed_keyword(key)
        suspect = (close and close[0] != key) or meant is not None
        if suspect and taken(key):
            continue  # an inner transformation's own keyword
        if close and close[0] != key:
            raise TypeError(
                f"MaskedMultiSteps got the keyword argument {key!r}: did you mean "
                f"{close[0]!r}? (Other keywords go to the inner optimizer; one "
                f"this close to {close[0]!r} is taken for a misspelling.)"
            )
        if meant == "close_window":
            raise TypeError(
                f"MaskedMultiSteps got the keyword argument {key!r}: to close "
                "the window on this microbatch whatever its rule (the last "
                "microbatch of the data), pass `close_window=True`. (Other "
                "keywords go to the inner optimizer, which drops those it "
                "does not take.)"
            )
        if meant == "value":
            raise TypeError(
                f"MaskedMultiSteps got the keyword argument {key!r}: the "
                "microbatch's mean loss goes in `value=`, which the wrapper "
                "averages over the window's tokens and hands to the inner "
                "optimizer (and to the window statistics' loss)."
            )
    if count is None:
        others = [k for k in extra_args if k != "value"]
        got = (
            f"\nIt got no `count`, and the keyword argument(s) "
            f"{', '.join(map(repr, others))}."
            if others
            else ""
        )
        raise TypeError(_MISSING_COUNT + got)


def first_three(items: list[str]) -> str:
    """``a, b, c and N more``: the first three of ``items``, and how many else."""
    more = f" and {len(items) - 3} more" if len(items) > 3 else ""
    return ", ".join(items[:3]) + more


def instances_in(tree: Any, types: type | tuple[type, ...]) -> list[tuple[Any, Any]]:
    """``(path, node)`` of the nodes of ``tree`` that are instances of
    ``types`` (outermost ones: a match is not searched further), in leaf order."""
    is_match = lambda x: isinstance(x, types)  # noqa: E731
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_match)[0]
    return [(path, x) for path, x in found if is_match(x)]


def nested_hint(tree: Any, kind: type, what: str) -> str:
    """``": it holds one at [1] ..."`` where ``tree`` holds a ``kind`` (an
    ``optax.chain``'s state, say), else ``""``: for the errors of functions that
    take the ``kind`` itself."""
    found = [jax.tree_util.keystr(path) for path, _ in instances_in(tree, kind)]
    if not found:
        return ""
    return f": it holds one at {first_three(found)}; pass {what}"


def in_series(found: list[tuple[Any, Any]]) -> tuple[str, str] | None:
    """Two of the accumulators ``found`` in one optimizer state (``(path,
    state)`` pairs) that one update passes through in turn, their paths as
    ``keystr``s; ``None`` where every two sit in different branches of
    ``optax.multi_transform`` (``PartitionState.inner_states``), whose updates
    never meet, or accumulate disjoint parameter leaves (``optax.masked``
    halves: the leaves one masks out are ``optax.MaskedNode``s in its state)."""
    for i, (a, state_a) in enumerate(found):
        for b, state_b in found[i + 1 :]:
            common = 0
            while common < min(len(a), len(b)) and a[common] == b[common]:
                common += 1
            branches = common > 0 and (
                getattr(a[common - 1], "name", None) == "inner_states"
            )
            if not branches and not _disjoint_leaves(state_a, state_b):
                return jax.tree_util.keystr(a), jax.tree_util.keystr(b)
    return None


def _disjoint_leaves(state_a: Any, state_b: Any) -> bool:
    """Whether two accumulators hold complementary parts of one parameter tree:
    their ``acc_grads`` have the same paths, ``optax.MaskedNode`` placeholders
    counted (not a tree another transformation made, ``optax.flatten``'s), and
    no array at the same path."""
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    paths, arrays = [], []
    for state in (state_a, state_b):
        leaves = jax.tree_util.tree_leaves_with_path(state.acc_grads, is_leaf=masked)
        paths.append({jax.tree_util.keystr(p) for p, _ in leaves})
        arrays.append({jax.tree_util.keystr(p) for p, x in leaves if not masked(x)})
    return paths[0] == paths[1] and not arrays[0] & arrays[1]


def refuse_unknown_keywords(
    where: str,
    unknown: Mapping[str, Any],
    fn: Callable[..., Any],
    hints: Mapping[str, str],
) -> None:
    """A ``TypeError`` for the first keyword of ``unknown`` (what ``fn``'s
    ``**unknown`` caught), with its hint, or the closest name ``fn`` takes."""
    for key in unknown:
        why = hints.get(key)
        if why is None:
            known = [
                name
                for name, param in signature(fn).parameters.items()
                if name not in ("self", "cls")
                and param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL)
            ]
            close = difflib.get_close_matches(key, known, n=1)
            why = f"did you mean {close[0]!r}?" if close else None
        raise TypeError(
            f"{where} got an unexpected keyword argument {key!r}"
            + (f": {why}" if why else ".")
        )
