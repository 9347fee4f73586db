"""When a window closes: window policies as pure functions over scalars.

A policy sees only scalars that every device agrees on (the window's
microbatch count, token total, the gradient step), so all devices close their
windows on the same microbatch.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, TypeGuard, get_args

import jax
import jax.numpy as jnp
import numpy as np

from masked_multistep._checks import (
    INT32_MAX,
    check_microbatches,
    check_real,
    check_takes,
    check_takes_one,
    is_host_int,
    python_scalar,
    refuse_narrow_float,
    returned_flag,
    short_repr,
)
from masked_multistep._running_mean import compute_dtype
from masked_multistep._token_total import TokenTotal, add_tokens

__all__ = [
    "WindowPolicy",
    "WindowScalars",
    "any_of",
    "describe",
    "every_k",
    "microbatch_window",
    "norm_test",
    "token_budget",
    "window_policy",
]


def _schedule_value(x: Any, what: str) -> jax.Array:
    """A schedule's return value as an array; ``what`` names the schedule."""
    if callable(x):
        # `every_k_schedule=optax.constant_schedule`: the factory, called with
        # the step, returns a schedule.
        raise TypeError(
            f"{what} returned a function ({getattr(x, '__name__', type(x).__name__)})"
            ": was a schedule's factory passed (optax.constant_schedule) instead "
            "of the schedule it builds? Call it: optax.constant_schedule(4)"
        )
    try:
        if isinstance(x, (str, bytes)):  # jnp.asarray reads some as dtypes
            raise TypeError
        x = jnp.asarray(x)
    except (TypeError, ValueError):
        raise TypeError(
            f"{what} must return an integer or float, got {x!r} of type "
            f"{type(x).__name__}"
        ) from None
    if x.shape != ():
        raise ValueError(f"{what} must return a scalar, got shape {x.shape}")
    return x


# What jax raises where a function reads a traced value as a Python or numpy
# value: `if step < 10`, `int(step)`, `sizes[step]`, `np.where(step < 10, ...)`.
_READS_A_TRACER = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)


def _called(schedule: Callable[[Any], Any], arg: Any, what: str) -> Any:
    """``schedule(arg)``; a schedule that reads its argument, traced under
    ``jit``, as a Python or numpy value (a Python ``if``) is told so by name."""
    try:
        return schedule(arg)
    except _READS_A_TRACER as err:
        raise TypeError(
            f"{what} failed on a traced value: under jit, scan or vmap its "
            "argument is traced, and a Python `if`, int(...), list index or "
            "numpy function on it fails. Write the schedule with jax.numpy "
            "(e.g. `lambda step: jnp.where(step < 10, 2, 4)`) or as an optax "
            "schedule (jax's error follows)"
        ) from err


def _sanitize_k(k: Any, what: str = "`every_k_schedule(step)`") -> jax.Array:
    """A schedule's value as an int32 window size in [1, 2³¹ − 1], total.

    A Python or numpy number (known whenever it is returned, under ``jit``
    too) that is NaN or rounds below 1 is a ``ValueError`` that names the
    schedule, as a constant ``every_k_schedule`` below 1 is. A jax array
    (traced, or concrete in an eager step: not read back to check it) is
    made total: NaN counts as 1 (every microbatch closes its own window, so a
    broken schedule shows at once as an update per microbatch instead of a
    window that never closes). Floats are rounded to the nearest integer
    (ties to even); everything is clipped to [1, 2³¹ − 1]. ``what`` names the
    schedule in errors.
    """
    if isinstance(k, np.ndarray) and k.ndim == 0:
        k = k[()]
    if (is_host_int(k) and np.ndim(k) == 0) or isinstance(k, (float, np.floating)):
        if not (int(k) if is_host_int(k) else np.round(float(k))) >= 1:
            raise ValueError(
                f"{what} returned {k!r}: a window must hold at least 1 "
                "microbatch (floats are rounded to the nearest integer)"
            )
    if is_host_int(k) and np.ndim(k) == 0:
        # Clipped on the host, exactly: jnp.asarray would refuse a Python int
        # of 2³¹ or more and wrap a numpy int64 into int32.
        k = np.asarray(np.clip(np.asarray(k, object), 1, INT32_MAX)).astype(np.int32)
    k = _schedule_value(k, what)
    if jnp.issubdtype(k.dtype, jnp.floating):
        k = k.astype(compute_dtype(k.dtype))  # holds 2³¹
        k = jnp.where(jnp.isnan(k), 1, jnp.round(k))
        # Below 2³¹ the conversion is exact; at or above it, 2³¹ − 1.
        fits = k < 2.0**31
        small = jnp.clip(jnp.where(fits, k, 1), 1, None).astype(jnp.int32)
        return jnp.where(fits, small, INT32_MAX)
    if jnp.issubdtype(k.dtype, jnp.integer) and not jnp.issubdtype(k.dtype, jnp.bool_):
        info = np.iinfo(k.dtype)
        lo = jnp.asarray(1, k.dtype)
        hi = jnp.asarray(min(info.max, INT32_MAX), k.dtype)
        return jnp.clip(k, lo, hi).astype(jnp.int32)
    raise TypeError(f"{what} must return an integer or float, got dtype {k.dtype}")


def every_k(
    every_k_schedule: int | np.integer | Callable[[jax.Array], jax.typing.ArrayLike],
) -> Callable[[jax.Array], jax.Array]:
    """The window size ``k`` as a function of the gradient step.

    Args:
      every_k_schedule: an integer in ``[1, 2³¹ − 1]`` (checked here), or a
        callable of ``gradient_step`` returning one. A callable's result is made
        total under ``jit``: rounded to the nearest integer (ties to even),
        clipped to ``[1, 2³¹ − 1]``, a jax array's NaN counts as 1; a non-scalar
        raises at trace time, and so does a Python or numpy number that is NaN
        or rounds below 1 (a ``ValueError``).

    Returns:
      ``k(step) -> int32 scalar``.

    Examples:
      >>> import jax.numpy as jnp
      >>> print(every_k(4)(jnp.int32(0)), every_k(lambda s: 2.6)(jnp.int32(0)))
      4 3
      >>> print(every_k(lambda s: s * jnp.nan)(jnp.int32(0)))
      1
      >>> every_k(lambda s: 0)(jnp.int32(0))
      Traceback (most recent call last):
      ...
      ValueError: `every_k_schedule(step)` returned 0: a window must hold ...
    """
    if callable(every_k_schedule):
        check_takes_one(every_k_schedule, "`every_k_schedule`", "the gradient step")
        return lambda step: _sanitize_k(
            _called(every_k_schedule, step, "`every_k_schedule(step)`")
        )
    k = every_k_schedule
    if isinstance(k, (jax.Array, np.ndarray, np.generic)) and np.ndim(k) == 0:
        if not jnp.issubdtype(k.dtype, jnp.integer) or k.dtype == np.bool_:
            raise TypeError(
                "`every_k_schedule` must be an integer or a callable of the "
                f"gradient step, got {k!r} of dtype {k.dtype}"
            )
        k = python_scalar(
            k,
            "`every_k_schedule`",
            (jnp.integer,),
            "integer, or a callable of the gradient step (build the wrapper "
            "outside jit; with optax.inject_hyperparams around a function that "
            "builds it, list that argument in static_args; a k that changes "
            "during training is a callable)",
        )
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(
            "`every_k_schedule` must be an integer or a callable of the gradient "
            f"step, got {every_k_schedule!r} of type {type(every_k_schedule).__name__}"
        )
    k = int(k)
    if k < 1:
        raise ValueError(f"`every_k_schedule` must be >= 1, got {k}")
    if k > INT32_MAX:
        raise ValueError(
            f"`every_k_schedule` must be at most 2**31 - 1 (the state counts "
            f"microbatches in int32), got {k}"
        )
    return lambda step: jnp.asarray(k, jnp.int32)


# ---------------------------------------------------------------------------
# Window policies: when does the window close?
# ---------------------------------------------------------------------------

# What a callable token budget is a function of: the annotation of `by=` and the
# run-time check read this one list.
_BudgetInput = Literal["tokens_seen", "gradient_step"]
_BUDGET_INPUTS = get_args(_BudgetInput)


class WindowScalars(NamedTuple):
    """What a window policy decides on, once a microbatch has been folded in.

    Every field is a scalar that all devices agree on (counts are replicated,
    and the statistics are global reductions), so every device closes its
    window on the same microbatch.

    Attributes:
      microbatches: int32, the window's microbatches so far, this one included
        (a count-0 microbatch counts, a skipped one does not). Not
        ``WindowStats.microbatches``, which is ``K``: that is ``counted``.
      tokens: the window's token total so far, ``Σ nᵢ`` (the state's count dtype).
      gradient_step: int32, the inner updates applied before this window.
      counted: int32, the window's microbatches with ``nᵢ > 0`` (``K``), or
        ``None`` where no policy needs it.
      grad_sq_norm: ``‖ḡ‖²``, the squared norm of the window's token-mean
        gradient so far, or ``None`` without window statistics.
      grad_var_trace: ``tr Σ̂ = S / (K − 1)``, the per-token gradient variance
        (NaN while ``K < 2``), or ``None`` without window statistics.

    Examples:
      A rule that reads them: close once the window holds 10 tokens from at
      least 2 microbatches (see :class:`WindowPolicy`):

      >>> import jax.numpy as jnp
      >>> import masked_multistep as mm
      >>> def closes(state, scalars: mm.WindowScalars):
      ...     return (scalars.tokens >= 10) & (scalars.microbatches >= 2)
      >>> rule = mm.WindowPolicy(init=lambda: (), closes=closes,
      ...                        update=lambda state, scalars, closed: state)
    """

    microbatches: jax.Array
    tokens: jax.Array
    gradient_step: jax.Array
    counted: jax.Array | None = None
    grad_sq_norm: jax.Array | None = None
    grad_var_trace: jax.Array | None = None


class WindowPolicy(NamedTuple):
    """When a window closes, as pure functions over :class:`WindowScalars`.

    Written the way optax writes a ``GradientTransformation``: a state that
    ``init`` builds (fixed shape, ``()`` when the policy keeps none) and pure
    functions of it.

    Attributes:
      init: ``() -> policy_state``.
      closes: ``(policy_state, scalars) -> bool[]``: whether the window closes
        on the microbatch just folded in.
      update: ``(policy_state, scalars, closed) -> policy_state``, called after
        every microbatch with whether it closed the window. Its result is
        kept only for a microbatch that counts: a skipped one (or an invalid
        count) leaves the policy state as it was, except one that closes the
        window all the same: one whose count the window's total cannot take,
        which closes the full window, or one passed with
        ``close_window=True`` (``closed`` is True, and ``scalars`` describe
        the window without it). A window that ``close_window=True`` alone
        closes without tokens is dropped: ``closed`` is then False. It must
        return a state of the structure, shapes and dtypes that ``init``
        built (an error names the policy otherwise: a ``TypeError`` for
        another dtype, a ``ValueError`` for another structure or shape). The
        policies here change their state only when a window closes.
      needs_stats: whether ``closes`` reads ``counted``, ``grad_sq_norm`` and
        ``grad_var_trace``.
      bounded: whether the policy sets a maximum window by itself (a number of
        microbatches or of tokens); the norm test without a maximum budget
        does not, and could hold a window open forever.
      minimum: ``(microbatches, tokens)``, the smallest window on which the
        policy's own rule is consulted (the norm test's minimum budgets):
        ``MaskedMultiSteps`` refuses a fixed ``every_k_schedule`` or
        ``tokens_per_window`` that would close every window before it.
      name: how ``repr(policy)`` and ``repr(tx)`` show the policy (the call
        that built it).
      maximum: ``(microbatches, tokens)``, fixed numbers by which the policy
        always closes a window (``None`` where it sets none, or one that
        varies): ``MaskedMultiSteps`` refuses a norm test whose minimum they
        would never let it reach.

    Examples:
      Windows of 2 microbatches, then of 3, the policy's state counting the
      windows closed:

      >>> import jax.numpy as jnp, optax
      >>> import masked_multistep as mm
      >>> rule = mm.WindowPolicy(
      ...     init=lambda: jnp.int32(0),
      ...     closes=lambda closed, s: s.microbatches >= jnp.minimum(2 + closed, 3),
      ...     update=lambda closed, s, now: closed + now.astype(jnp.int32),
      ...     name="two_then_three()",
      ... )
      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=rule)
      >>> params = jnp.zeros(())
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     params, state = tx.apply_gradients(jnp.array(1.0), state, params,
      ...                                        count=jnp.array(1))
      >>> int(state.gradient_step), int(state.policy_state), float(params)
      (2, 2, -2.0)
      >>> "tokens_per_window=two_then_three()" in repr(tx)
      True
    """

    init: Callable[[], Any]
    closes: Callable[[Any, WindowScalars], jax.Array]
    update: Callable[[Any, WindowScalars, jax.Array], Any]
    needs_stats: bool = False
    bounded: bool = True
    minimum: tuple[int, float | int] = (1, 0)
    name: str = "WindowPolicy(...)"
    maximum: tuple[int | None, float | int | None] = (None, None)

    def __repr__(self) -> str:
        # `name` is checked where the policy is used, not when it is built.
        return self.name if isinstance(self.name, str) else "WindowPolicy(...)"


def describe(rule: Any) -> str:
    """A window rule as ``repr`` shows it: a policy by its ``name``, a
    callable by its name, anything else by its ``repr``."""
    if isinstance(rule, WindowPolicy):
        return rule.name
    if callable(rule):
        return getattr(rule, "__name__", "<schedule>")
    if isinstance(rule, (jax.Array, np.ndarray, np.generic)) and np.ndim(rule) == 0:
        return repr(rule.item())  # a scalar array as the number it holds
    return repr(rule)


def _policy_call(policy: WindowPolicy, field: str, *args: Any) -> Any:
    """``policy.<field>(*args)``; where it fails on what jit traces, or on a
    statistic it reads without ``needs_stats=True`` (``None``), an error
    naming the policy and the cause (jax's or Python's follows)."""
    what = f"The window policy {describe(policy)}'s `{field}`"
    try:
        return getattr(policy, field)(*args)
    except (TypeError, ValueError) as err:
        if _raised_here(err):
            raise  # this package's own error (a policy of its own, a check)
        if isinstance(err, _READS_A_TRACER):
            raise TypeError(
                f"{what} failed on a traced value: under jit, scan or vmap the "
                "policy state and WindowScalars are traced, and a Python `if`, "
                "int(...) or numpy function on them fails. Write it with "
                "jax.numpy (`jnp.where`, `&`, `|`) (jax's error follows)"
            ) from err
        # A statistic the policy was not given (`None`) that its own code
        # used: Python's error on an operator, or jax's on an array of it.
        unset = [
            name
            for name in ("counted", "grad_sq_norm", "grad_var_trace")
            if getattr(args[1], name, 0) is None
        ]
        on_none = (
            "NoneType" in str(err)
            if isinstance(err, TypeError)
            else str(err).startswith("None is not a valid value")
        )
        if not unset or not on_none:
            raise
        raise TypeError(
            f"{what} failed on a `None`: WindowScalars' `counted`, "
            "`grad_sq_norm` and `grad_var_trace` are None unless the policy "
            "is built with `needs_stats=True` (and passed as `norm_test=`) "
            "(the original error follows)"
        ) from err


def _raised_here(err: BaseException) -> bool:
    """Whether ``err`` came through this package's code below the policy's
    function (a policy of the package's own, or a check it calls), by the
    frames' module names: not only jax's, numpy's or the user's."""
    package = __name__.partition(".")[0]
    tb = err.__traceback__
    tb = tb.tb_next if tb is not None else None  # below `_policy_call` itself
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module == package or module.startswith(package + "."):
            return True
        tb = tb.tb_next
    return False


def initial_state(policy: WindowPolicy) -> Any:
    """``policy.init()``, checked: a pytree of arrays or numbers (the state is
    carried through jit, scan and checkpoints), or an error naming the policy
    and the first leaf that is neither."""
    state = _policy_call(policy, "init")
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if _is_state_leaf(leaf):
            continue
        where = jax.tree_util.keystr(path) or " (the whole state)"
        raise TypeError(
            f"The window policy {describe(policy)}'s `init` must return a pytree "
            f"of arrays (or numbers), got {short_repr(leaf)} of type "
            f"{type(leaf).__name__} at init(){where}"
        )
    return state


def _is_state_leaf(leaf: Any) -> bool:
    """Whether ``leaf`` can be a policy state's: a jax array, or a host number
    or numpy array of numbers or bools (ml_dtypes' bfloat16 and float8 ones
    included)."""
    if isinstance(leaf, jax.Array):
        return True
    if not isinstance(leaf, (np.ndarray, np.generic, numbers.Number)):
        return False
    dtype = np.asarray(leaf).dtype
    return dtype == np.bool_ or jnp.issubdtype(dtype, np.number)


def verdict(policy: WindowPolicy, policy_state: Any, scalars: WindowScalars) -> Any:
    """``policy.closes(policy_state, scalars)``, checked: a boolean scalar, or
    an error naming the policy (within :func:`any_of`, the one that returned
    something else)."""
    return returned_flag(
        _policy_call(policy, "closes", policy_state, scalars),
        f"The window policy {describe(policy)}'s `closes`",
    )


def updated(
    policy: WindowPolicy, policy_state: Any, scalars: WindowScalars, closed: Any
) -> Any:
    """``policy.update(policy_state, scalars, closed)``, checked: a state of the
    structure, shapes and dtypes that ``policy.init`` built (the state is
    carried through jit, scan and checkpoints), or an error naming the policy."""
    new = _policy_call(policy, "update", policy_state, scalars, closed)
    want = jax.tree.structure(policy_state)
    if jax.tree.structure(new) != want:
        raise ValueError(
            f"The window policy {describe(policy)}'s `update` must return a state "
            f"of the structure its `init` built, {want}; got "
            f"{jax.tree.structure(new)}"
        )
    for got, old in zip(jax.tree.leaves(new), jax.tree.leaves(policy_state)):
        shapes = (jnp.shape(got), jnp.shape(old))
        dtypes = (jnp.result_type(got), jnp.result_type(old))
        # (A weakly typed number from `init`, `lambda: 0`, takes the width
        # that `update` gives it, as jax's promotion would: int64 under x64
        # against int32; not another kind.)
        weak = isinstance(old, (int, float)) or jax.typeof(old).weak_type
        promoted = weak and dtypes[0].kind == dtypes[1].kind
        if shapes[0] != shapes[1] or (dtypes[0] != dtypes[1] and not promoted):
            # (A dtype of its own is the wrong kind of state; a shape, the
            # wrong value of the right kind.)
            error = ValueError if shapes[0] != shapes[1] else TypeError
            raise error(
                f"The window policy {describe(policy)}'s `update` must return a "
                "state of the shapes and dtypes its `init` built: got a leaf of "
                f"shape {shapes[0]} and dtype {dtypes[0]} where `init` built "
                f"shape {shapes[1]} and dtype {dtypes[1]}"
            )
    return new


def check_policy(policy: WindowPolicy, keyword: str) -> None:
    """Refuses a :class:`WindowPolicy` given as ``keyword`` whose functions
    are not callable with their arguments, or whose descriptive fields are
    not what they describe, naming the first such field."""
    arguments = {
        "init": (0, "no arguments", "nothing"),
        "closes": (2, "two arguments", "the policy state, the WindowScalars"),
        "update": (
            3,
            "three arguments",
            "the policy state, the WindowScalars, whether the window closed",
        ),
    }
    for field, (n, count, what) in arguments.items():
        function = getattr(policy, field)
        if not callable(function):
            raise TypeError(
                f"`{keyword}` got a WindowPolicy whose `{field}` is not callable: "
                f"{short_repr(function)} of type {type(function).__name__}"
            )
        check_takes(function, f"`{keyword}`'s WindowPolicy `{field}`", count, n, what)
    _check_fields(policy, keyword)


def _check_fields(policy: WindowPolicy, keyword: str) -> None:
    """The descriptive fields, which only the constructor's checks and
    ``repr`` read: an error naming the field, not Python's own on a tuple."""
    what = f"`{keyword}` got a WindowPolicy whose"
    if not isinstance(policy.name, str):
        raise TypeError(f"{what} `name` is not a str: {short_repr(policy.name)}")
    for field in ("needs_stats", "bounded"):
        flag = getattr(policy, field)
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(
                f"{what} `{field}` is not a bool: {short_repr(flag)} of type "
                f"{type(flag).__name__}"
            )
    for field, empty in (("minimum", False), ("maximum", True)):
        pair = getattr(policy, field)
        unit = ("microbatches", "tokens")
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(
                f"{what} `{field}` is not a pair (microbatches, tokens): "
                f"{short_repr(pair)}"
            )
        for name, number, kinds in zip(
            unit, pair, (numbers.Integral, numbers.Real), strict=True
        ):
            if number is None and empty:
                continue
            kind = "an int" if kinds is numbers.Integral else "a number"
            bound = "> 0 or None" if empty else ">= 0"
            value = python_scalar(
                number,
                f"{what} `{field}`'s {name}",
                (jnp.integer,) if kinds is numbers.Integral else (jnp.number,),
                "number",
            )
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise TypeError(
                    f"{what} `{field}` has {short_repr(number)} {name} of type "
                    f"{type(number).__name__}: it must be {kind} {bound}"
                )
            # (A Python int is finite however large: math.isfinite would
            # overflow converting 10**400.)
            finite = isinstance(value, numbers.Integral) or math.isfinite(value)
            if not finite or (value <= 0 if empty else value < 0):
                raise ValueError(
                    f"{what} `{field}` has {short_repr(number)} {name}: it must be "
                    f"{kind} {bound}"
                )


def _call(function: str, *args: Any, **kwargs: Any) -> str:
    """``function(args, key=value)`` as :attr:`WindowPolicy.name` shows it,
    keywords left at ``None`` out."""
    parts = [describe(a) for a in args]
    parts += [f"{k}={describe(v)}" for k, v in kwargs.items() if v is not None]
    return f"{function}({', '.join(parts)})"


def _no_state() -> tuple[()]:
    return ()


def _keep(policy_state: Any, scalars: WindowScalars, closed: jax.Array) -> Any:
    del scalars, closed
    return policy_state


def microbatch_window(
    every_k_schedule: int | np.integer | Callable[[jax.Array], jax.typing.ArrayLike],
) -> WindowPolicy:
    """Closes the window on its ``k``-th microbatch (``optax.MultiSteps``' rule).

    Args:
      every_k_schedule: ``k``, an integer or a callable of ``gradient_step``;
        see :func:`every_k` for how a callable's value is made total.

    Returns:
      A stateless :class:`WindowPolicy`.

    Examples:
      >>> import jax.numpy as jnp
      >>> policy = microbatch_window(3)
      >>> s = WindowScalars(jnp.int32(3), jnp.float32(0.0), jnp.int32(0))
      >>> print(policy.closes(policy.init(), s))
      True
    """
    k_of = every_k(every_k_schedule)

    def closes(policy_state, scalars):
        del policy_state
        return scalars.microbatches >= k_of(scalars.gradient_step)

    return WindowPolicy(
        _no_state, closes, _keep, name=f"every_k_schedule={describe(every_k_schedule)}"
    )


def _microbatch_cap(
    value: int | np.integer | Callable[[jax.Array], jax.typing.ArrayLike], what: str
) -> Callable[[jax.Array], jax.Array]:
    """``every_k(value)``, with errors that name ``what`` (a cap's own name)."""
    if callable(value):
        check_takes_one(value, what, "the gradient step")
        schedule, called = value, f"{what[:-1]}(step)`"
        return lambda step: _sanitize_k(_called(schedule, step, called), called)
    if isinstance(value, bool) or not isinstance(
        value, (numbers.Integral, jax.Array, np.ndarray, np.generic)
    ):
        raise TypeError(
            f"{what} must be an integer or a callable of the gradient step, "
            f"got {value!r}"
        )
    return every_k(check_microbatches(value, what))


def _sanitize_budget(
    budget: Any, what: str = "`tokens_per_window(...)`"
) -> jax.Array | int | float:
    """A budget schedule's value as a token budget, total under jit.

    A Python or numpy number (known whenever it is returned, under ``jit``
    too) that is NaN or negative is a ``ValueError`` that names the schedule;
    0 closes the window on its first microbatch with tokens (a warmup may
    start there). A jax array (traced, or concrete in an eager step) is made
    total: NaN counts as 0 (so a broken
    schedule shows at once as an update per microbatch instead of a window
    that never closes), and so does a negative value. ``+inf`` means no
    token limit. The value keeps its precision, so that
    :func:`_tokens_reached` compares it exactly, as it compares a constant
    budget: a Python or numpy number returns as a Python number (compared as
    a constant is), an array integer stays an integer, an array float a float
    of at least float32 precision.
    """
    if isinstance(budget, np.ndarray) and budget.ndim == 0:
        budget = budget[()]  # np.array(2.0000001): read exactly, as np.float64 is
    if isinstance(budget, np.floating):
        refuse_narrow_float(budget.dtype, what)
    if (is_host_int(budget) and np.ndim(budget) == 0) or isinstance(
        budget, (float, np.floating)
    ):
        # Not through jnp.asarray, which would round a float to float32
        # (2.0000001 to 2.0: a window of 2 tokens, below the budget).
        value = int(budget) if is_host_int(budget) else float(budget)
        if not value >= 0:
            raise ValueError(
                f"{what} returned {budget!r}: a token budget must be a number "
                ">= 0 (0 closes each window on its first microbatch with "
                "tokens, inf sets no token limit)"
            )
        return value
    b = _schedule_value(budget, what)
    if jnp.issubdtype(b.dtype, jnp.integer) and b.dtype != jnp.bool_:
        return jnp.maximum(b, jnp.zeros([], b.dtype))
    if not jnp.issubdtype(b.dtype, jnp.floating):
        raise TypeError(f"{what} must return an integer or float, got dtype {b.dtype}")
    refuse_narrow_float(b.dtype, what)
    b = b.astype(jnp.promote_types(b.dtype, jnp.float32))
    return jnp.where(jnp.isnan(b) | (b < 0), jnp.zeros([], b.dtype), b)


def _token_number(value: Any, what: str, *, positive: bool = True) -> float | int:
    """A concrete number of tokens: :func:`check_real`, and not in a float
    narrower than float32 (``jnp.bfloat16(3001)`` is already 3008)."""
    if hasattr(value, "dtype"):
        refuse_narrow_float(value.dtype, what)
    return check_real(value, what, positive=positive)


def _tokens_reached(tokens: jax.Array, budget: float | int | jax.Array) -> jax.Array:
    """``0 < tokens >= budget``, compared exactly in the tokens' own dtype.

    An integer total is compared with ``ceil(budget)``, clipped to the total's
    range (a window closes at the largest total its dtype holds, if its
    microbatches add up to it exactly: one that would pass it is skipped); a
    float total with the budget rounded up to its dtype (clipped to its largest
    finite value; ``inf`` is never reached).
    """
    tokens = jnp.asarray(tokens)
    if isinstance(budget, (int, float)):  # a checked constant
        if jnp.issubdtype(tokens.dtype, jnp.integer):
            hi = int(np.iinfo(tokens.dtype).max)
            b = jnp.asarray(
                hi if math.isinf(budget) else min(math.ceil(budget), hi), tokens.dtype
            )
        else:
            b = jnp.asarray(_float_budget(budget, tokens.dtype))
        return (tokens > 0) & (tokens >= b)
    budget = jnp.asarray(budget)
    if jnp.issubdtype(tokens.dtype, jnp.integer):
        info = np.iinfo(tokens.dtype)
        hi = jnp.asarray(info.max, tokens.dtype)
        if jnp.issubdtype(budget.dtype, jnp.integer):
            # Clipped in the budget's dtype (>= 0 already), then exact.
            if np.iinfo(budget.dtype).max > info.max:
                budget = jnp.minimum(budget, info.max)
            b = budget.astype(tokens.dtype)
        else:
            # ceil(budget) below 2**(bits-1) is an integer the total's dtype
            # holds, so the conversion is exact; beyond it, the largest total.
            c = jnp.ceil(budget)
            fits = c < 2.0 ** (info.bits - 1)
            b = jnp.where(fits, jnp.where(fits, c, 0).astype(tokens.dtype), hi)
    else:
        top = jnp.finfo(tokens.dtype).max
        if (
            jnp.issubdtype(budget.dtype, jnp.floating)
            and jnp.finfo(budget.dtype).max > top
        ):
            # A wider budget is clipped to the largest total, not cast to inf
            # (a narrower one, cast to the total's dtype, always fits).
            budget = jnp.minimum(budget, jnp.asarray(top, budget.dtype))
        b = _rounded_up(budget, tokens.dtype)
    return (tokens > 0) & (tokens >= b)


def _rounded_up(budget: jax.Array, dtype: Any) -> jax.Array:
    """``budget`` (integer, or float within ``dtype``'s range) in the float
    ``dtype``, rounded up, not to the nearest: a total just below the budget
    must not reach it (2**24 + 1 is 2**24 in float32 to the nearest).

    The conversion back, to tell whether it rounded down, is exact; a float at
    or past an integer budget's range is above any such budget (and would
    overflow converting back)."""
    b = budget.astype(dtype)
    if jnp.issubdtype(budget.dtype, jnp.integer):
        inside = b < float(np.iinfo(budget.dtype).max) + 1
        below = inside & (jnp.where(inside, b, 0).astype(budget.dtype) < budget)
    else:
        below = b.astype(budget.dtype) < budget
    # Towards the largest finite value, above any `b` that rounded down (an
    # inf here would stop an eager step under jax_debug_infs).
    up = jnp.nextafter(b, jnp.asarray(jnp.finfo(dtype).max, b.dtype))
    return jnp.where(below, up, b)


def _float_budget(budget: float | int, dtype: Any) -> np.ndarray:
    """The smallest value of the float ``dtype`` at or above ``budget``.

    Rounding to the nearest could land below the budget (2.0000001 on 2.0 in
    float32, closing a window one microbatch early). Past the dtype's largest
    finite value: that value (``inf`` stays ``inf``, never reached).
    """
    dtype = np.dtype(dtype)
    top = float(np.finfo(dtype).max)
    if budget > top:  # Python numbers: exact for an int of any size
        infinite = isinstance(budget, float) and math.isinf(budget)
        return np.asarray(np.inf if infinite else top, dtype)
    b = np.asarray(float(budget), dtype)
    if float(b) < budget:
        b = np.nextafter(b, np.asarray(np.inf, dtype))
    return b


def _tokens_seen_init() -> TokenTotal:
    return TokenTotal(jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32))


def token_budget(
    budget: float
    | np.floating
    | np.integer
    | Callable[[jax.Array], jax.typing.ArrayLike],
    *,
    by: _BudgetInput = "tokens_seen",
    max_microbatches: int
    | np.integer
    | Callable[[jax.Array], jax.typing.ArrayLike]
    | None = None,
) -> WindowPolicy:
    """Closes the window on the microbatch that brings its tokens to ``budget``.

    The window closes on the first microbatch after which ``Σ nᵢ >= budget``
    (and ``Σ nᵢ > 0``: a count-0 microbatch closes a window by tokens only
    where the window already holds its budget, as a state converted or
    restored into a smaller budget does), or, with ``max_microbatches``, on
    its ``k``-th microbatch, whichever comes first. The window may overshoot
    the budget by up to one microbatch's tokens.

    Args:
      budget: tokens per window: a number ``> 0``, or a callable returning one,
        of the tokens seen in all completed windows (``by="tokens_seen"``, a
        float32 scalar) or of the gradient step (``by="gradient_step"``). A
        callable's value, if a Python or numpy number, must be ``>= 0``
        (else ``ValueError``); a jax array is made total: NaN and negative
        values count as 0; at 0 every microbatch with tokens closes its
        window; ``inf``
        means no token limit (a window whose total cannot take a
        microbatch's count, as an int32 one near 2³¹ − 1, closes on it), a
        non-scalar raises
        ``ValueError`` at trace
        time. It is compared with the window's tokens as exactly as a
        constant budget (an integer as it is, a float at its own precision),
        so a budget closes the same windows whether it is returned or given.
      by: what a callable ``budget`` is a function of: ``"tokens_seen"`` or
        ``"gradient_step"``.
      max_microbatches: optional cap on the microbatches per window, an integer
        or a callable of the gradient step (as ``every_k_schedule``).

    Returns:
      A :class:`WindowPolicy`; its state is the tokens seen, a
      :class:`TokenTotal` (exact to 2⁴⁸ tokens, as ``WindowStats.tokens_seen``),
      when ``budget`` is a callable of them, ``()`` otherwise.

    Raises:
      TypeError: if ``budget`` is neither a real number nor callable, or
        ``max_microbatches`` neither an integer nor callable.
      ValueError: if a constant ``budget`` is not finite and ``> 0``, ``by``
        is not one of the two inputs, or a constant ``max_microbatches`` is
        outside ``[1, 2**31 - 1]``.

    Examples:
      A window of 100 tokens; microbatches of 40, 0 and 70 tokens:

      >>> import jax.numpy as jnp
      >>> import masked_multistep as mm
      >>> policy = mm.token_budget(100)
      >>> state = policy.init()
      >>> for mb, total in [(1, 40), (2, 40), (3, 110)]:
      ...     s = mm.WindowScalars(jnp.int32(mb), jnp.float32(total), jnp.int32(0))
      ...     print(bool(policy.closes(state, s)))
      False
      False
      True

      A ramp from 1,000 to 8,000 tokens over the first million tokens seen:

      >>> ramp = mm.token_budget(lambda seen: jnp.interp(seen, jnp.array([0.0, 1e6]),
      ...                                                jnp.array([1e3, 8e3])))
    """
    return _token_budget(budget, by, max_microbatches, "`budget`")._replace(
        name=_call(
            "mm.token_budget",
            budget,
            by=by if callable(budget) else None,
            max_microbatches=max_microbatches,
        )
    )


def _token_budget(
    budget: float
    | np.floating
    | np.integer
    | Callable[[jax.Array], jax.typing.ArrayLike],
    by: _BudgetInput = "tokens_seen",
    max_microbatches: int
    | np.integer
    | Callable[[jax.Array], jax.typing.ArrayLike]
    | None = None,
    what: str = "`tokens_per_window`",
) -> WindowPolicy:
    """:func:`token_budget`, with errors that call ``budget`` ``what``."""
    if by not in _BUDGET_INPUTS:
        raise ValueError(
            f"`by` must be one of {', '.join(map(repr, _BUDGET_INPUTS))}, got {by!r}"
        )
    track_seen = callable(budget) and by == "tokens_seen"
    budget_of: Callable[[Any, WindowScalars], float | int | jax.Array]
    fixed_budget = None
    if callable(budget):
        check_takes_one(
            budget, what, "the tokens seen" if track_seen else "the gradient step"
        )
        budget_fn = budget
        if track_seen:
            called = f"{what[:-1]}(tokens_seen)`"
            budget_of = lambda seen, s: _sanitize_budget(  # noqa: E731
                _called(budget_fn, seen.hi + seen.lo, called), called
            )
        else:
            called = f"{what[:-1]}(gradient_step)`"
            budget_of = lambda _, s: _sanitize_budget(  # noqa: E731
                _called(budget_fn, s.gradient_step, called), called
            )
    else:
        if isinstance(budget, (float, np.floating)) and budget == math.inf:
            raise ValueError(
                f"{what} must be finite and > 0, got inf: for windows with no "
                "token limit, give every_k_schedule alone (a budget schedule may "
                "return inf for some steps)"
            )
        fixed_budget = constant = _token_number(budget, what)
        budget_of = lambda _, s: constant  # noqa: E731

    cap = None
    if max_microbatches is not None:
        cap = _microbatch_cap(max_microbatches, "`max_microbatches`")
    fixed_cap = None
    if max_microbatches is not None and not callable(max_microbatches):
        fixed_cap = int(max_microbatches)
    maximum = (fixed_cap, fixed_budget)

    def closes(policy_state, scalars):
        done = _tokens_reached(scalars.tokens, budget_of(policy_state, scalars))
        if cap is not None:
            done = done | (scalars.microbatches >= cap(scalars.gradient_step))
        return done

    if not track_seen:
        return WindowPolicy(_no_state, closes, _keep, maximum=maximum)

    def update(policy_state, scalars, closed):
        added = add_tokens(policy_state, scalars.tokens)
        return jax.tree.map(lambda a, b: jnp.where(closed, a, b), added, policy_state)

    return WindowPolicy(_tokens_seen_init, closes, update, maximum=maximum)


def norm_test(
    theta: float | np.floating,
    *,
    min_tokens: float | np.floating | np.integer = 0,
    min_microbatches: int | np.integer = 1,
    max_tokens: float | np.floating | np.integer | None = None,
    max_microbatches: int
    | np.integer
    | Callable[[jax.Array], jax.typing.ArrayLike]
    | None = None,
) -> WindowPolicy:
    """Closes the window once its mean gradient is precise enough: the norm test.

    With ``N = Σ nᵢ`` tokens, ``K`` microbatches with tokens, the token-mean
    gradient ``ḡ`` and the per-token gradient variance ``tr Σ̂ = S / (K − 1)``
    (``S = Σ nᵢ ‖gᵢ − ḡ‖²``), the variance of ``ḡ`` is about ``tr Σ̂ / N``, and
    the window closes on the first microbatch where::

        tr Σ̂ / N  <=  θ² · ‖ḡ‖²        (K >= 2)

    and the minimum budgets are met, or on the one that reaches a maximum
    budget, whichever comes first. The test is checked as
    ``tr Σ̂ <= θ² · N · ‖ḡ‖²`` (no division); NaN figures never pass it.

    What θ means: the window's gradient is expected to be off from the true
    gradient ``G`` by about ``θ`` times its own norm (root mean square).
    Since ``E ‖ḡ‖² = |G|² + tr Σ / N``, the test passes on average once::

        N  >=  (1 − θ²) / θ² · tr Σ / |G|²

    that is, at ``(1 − θ²) / θ²`` times the *simple noise scale*
    ``B_simple = tr Σ / |G|²`` of McCandlish et al. (2018), in tokens:
    ``θ = 0.71`` closes at about ``B_simple``, ``θ = 0.5`` at three times it,
    and with ``θ >= 1`` it passes on average as soon as ``K >= 2`` (the noise
    in ``‖ḡ‖²`` alone satisfies it), so useful values lie below 1.

    The window grows while the gradient is small against its noise (near a
    minimum, or late in training) and stays short while it is large. Deciding
    on the same figures that the decision stops on favours windows that happen
    to look precise (a sequential test's optional-stopping bias); a minimum
    of a few microbatches with tokens (``min_microbatches``) keeps the variance
    estimate from deciding on one or two degrees of freedom.

    The figures are float32 running sums, whose rounding grows with
    ``N / B_simple`` (README, "Window statistics and the critical batch
    size"): a small θ, whose windows hold ``1/θ²`` times ``B_simple`` or more
    (θ = 0.001: a million times), decides on a ``tr Σ̂`` that rounding may
    move by tens of percent, so its windows close where the float64 test
    would close them only approximately.

    Args:
      theta: the tolerance θ, a finite number ``> 0``.
      min_tokens: the test is not consulted before the window has this many
        tokens.
      min_microbatches: nor before it has this many microbatches with tokens
        (``K``; the variance estimate has ``K − 1`` degrees of freedom; the
        test decides on ``K >= 2`` whatever this says, so a fixed maximum
        below 2 microbatches is refused as one below this minimum is). A
        count-0 microbatch adds nothing to the estimate, so it does not count
        here, while it does toward ``every_k_schedule`` and
        ``max_microbatches``.
      max_tokens: optional token budget at which the window closes whatever
        the test says (as :func:`token_budget`).
      max_microbatches: optional cap on the microbatches per window, an
        integer or a callable of the gradient step (as ``every_k_schedule``).

    Returns:
      A stateless :class:`WindowPolicy` that needs the window statistics.

    Raises:
      TypeError: if an argument is not a real number (an integer for the
        microbatch counts).
      ValueError: if ``theta`` is not finite and ``> 0``, ``min_tokens`` is
        negative, ``max_tokens`` not finite and ``> 0``, a microbatch count
        outside ``[1, 2**31 - 1]``, or a minimum exceeds its maximum.

    Examples:
      Four microbatches with tokens; ``tr Σ̂ = 2.0``, ``N = 64``, ``‖ḡ‖² = 0.1``:
      ``2 / 64 = 0.031 <= 0.5² · 0.1 = 0.025`` fails, so the window stays open;
      at ``N = 128`` it closes:

      >>> import jax.numpy as jnp
      >>> import masked_multistep as mm
      >>> policy = mm.norm_test(0.5)
      >>> def scalars(n):
      ...     return mm.WindowScalars(jnp.int32(4), jnp.float32(n), jnp.int32(0),
      ...                             counted=jnp.int32(4),
      ...                             grad_sq_norm=jnp.float32(0.1),
      ...                             grad_var_trace=jnp.float32(2.0))
      >>> print(policy.closes((), scalars(64)), policy.closes((), scalars(128)))
      False True

    References:
      R. H. Byrd, G. M. Chin, J. Nocedal, Y. Wu, "Sample size selection in
      optimization methods for machine learning", Mathematical Programming
      134, 2012.

      R. Bollapragada, R. Byrd, J. Nocedal, "Adaptive sampling strategies for
      stochastic optimization", SIAM Journal on Optimization 28(4), 2018.

      T. T.-K. Lau, W. Li, C. Xu, H. Liu, M. Kolar, "Adaptive batch size
      schedules for distributed training of language models with data and
      model parallelism", Conference on Parsimony and Learning, PMLR 280, 2025
      (arXiv:2412.21124).

      S. McCandlish, J. Kaplan, D. Amodei, "An empirical model of large-batch
      training", 2018.
    """
    theta = float(check_real(theta, "`norm_test` (theta)"))
    min_tokens = _token_number(min_tokens, "`min_tokens`", positive=False)
    min_microbatches = check_microbatches(min_microbatches, "`min_microbatches`")
    if max_tokens is not None:
        max_tokens = _token_number(max_tokens, "`max_tokens`")
        if max_tokens < min_tokens:
            raise ValueError(
                f"`max_tokens` ({max_tokens}) is below `min_tokens` ({min_tokens})"
            )
    # The test decides on K >= 2 microbatches with tokens whatever the minimum.
    consulted_from = max(2, min_microbatches)
    cap = None
    if max_microbatches is not None:
        cap = _microbatch_cap(max_microbatches, "`max_microbatches`")
        if not callable(max_microbatches) and int(max_microbatches) < consulted_from:
            raise ValueError(
                f"`max_microbatches` ({int(max_microbatches)}) is below "
                + _fewest_consulted(consulted_from)
                + ": every window would close before the test is consulted"
            )
    theta_sq = theta * theta

    def closes(policy_state, scalars):
        del policy_state
        if (
            scalars.counted is None
            or scalars.grad_sq_norm is None
            or scalars.grad_var_trace is None
        ):
            raise ValueError(
                "The norm test needs the window statistics: `counted`, "
                "`grad_sq_norm` and `grad_var_trace` must be given"
            )
        n = jnp.asarray(scalars.tokens).astype(jnp.float32)
        var = jnp.asarray(scalars.grad_var_trace).astype(jnp.float32)
        # ‖ḡ‖² is NaN without tokens: selected away, not multiplied (under
        # jax_debug_nans an eager step would stop at the product).
        sq = jnp.where(n > 0, jnp.asarray(scalars.grad_sq_norm), 0).astype(jnp.float32)
        passes = (scalars.counted >= 2) & (n > 0) & (var <= theta_sq * n * sq)
        # K, not all microbatches: a count-0 one adds no degree of freedom.
        started = scalars.counted >= min_microbatches
        if min_tokens > 0:
            started = started & _tokens_reached(scalars.tokens, min_tokens)
        done = passes & started
        if max_tokens is not None:
            done = done | _tokens_reached(scalars.tokens, max_tokens)
        if cap is not None:
            done = done | (scalars.microbatches >= cap(scalars.gradient_step))
        return done

    bounded = max_tokens is not None or max_microbatches is not None
    return WindowPolicy(
        _no_state,
        closes,
        _keep,
        needs_stats=True,
        bounded=bounded,
        minimum=(consulted_from, min_tokens),
        maximum=(
            None
            if max_microbatches is None or callable(max_microbatches)
            else int(max_microbatches),
            max_tokens,
        ),
        name=_call(
            "mm.norm_test",
            theta,
            min_tokens=min_tokens or None,
            min_microbatches=min_microbatches if min_microbatches != 1 else None,
            max_tokens=max_tokens,
            max_microbatches=max_microbatches,
        ),
    )


# `window_policy` has an argument of the same name.
_norm_test = norm_test


def any_of(*policies: WindowPolicy) -> WindowPolicy:
    """The window closes as soon as any of ``policies`` closes it.

    The state is the tuple of the policies' states (a single policy is
    returned as it is).

    Examples:
      >>> import jax.numpy as jnp
      >>> policy = any_of(microbatch_window(8), token_budget(100))
      >>> s = WindowScalars(jnp.int32(8), jnp.float32(10.0), jnp.int32(0))
      >>> print(policy.closes(policy.init(), s))
      True
    """
    if not policies:
        raise ValueError("`any_of` needs at least one policy")
    for p in policies:
        if not isinstance(p, WindowPolicy):
            raise TypeError(f"`any_of` takes WindowPolicy objects, got {p!r}")
    if len(policies) == 1:
        return policies[0]

    def init():
        return tuple(p.init() for p in policies)

    def closes(policy_state, scalars):
        done = [verdict(p, s, scalars) for p, s in zip(policies, policy_state)]
        return functools.reduce(jnp.logical_or, done)

    def update(policy_state, scalars, closed):
        # Each checked as it would be alone: an error names the policy that
        # failed (a user's own, beside the others).
        return tuple(
            updated(p, s, scalars, closed) for p, s in zip(policies, policy_state)
        )

    return WindowPolicy(
        init,
        closes,
        update,
        needs_stats=any(p.needs_stats for p in policies),
        bounded=any(p.bounded for p in policies),
        # The combination is consulted as soon as any of its policies is.
        minimum=tuple(min(m) for m in zip(*(p.minimum for p in policies))),
        # ... and closes by the smallest of their fixed maximums.
        maximum=(
            _smallest(p.maximum[0] for p in policies),
            _smallest(p.maximum[1] for p in policies),
        ),
        name=f"any_of({', '.join(p.name for p in policies)})",
    )


def _smallest(values: Any) -> Any:
    """The smallest of ``values`` that are not ``None``; ``None`` if none is."""
    return min((x for x in values if x is not None), default=None)


def _another_policy(test: WindowPolicy | None) -> TypeGuard[WindowPolicy]:
    """Whether ``test`` is a policy passed as ``norm_test=`` other than
    :func:`norm_test`'s (named by its own name in errors)."""
    return test is not None and not test.name.startswith("mm.norm_test(")


def _fewest_consulted(min_microbatches: int, test: WindowPolicy | None = None) -> str:
    """The norm test's fewest microbatches (or those of ``test``, another
    policy passed as ``norm_test=``), in words, for an error message."""
    if _another_policy(test):
        return f"{test.name}'s `minimum` ({min_microbatches} microbatches)"
    if min_microbatches > 2:
        return f"the norm test's `min_microbatches` ({min_microbatches})"
    return "2, the fewest microbatches with tokens the norm test decides on"


def _check_consulted(
    test: WindowPolicy, every_k_schedule: Any, budget: Any, count_dtype: Any
) -> None:
    """A fixed window below the norm test's minimum would never consult it,
    nor would a window whose total ``count_dtype`` cannot take to
    ``min_tokens``.

    Called once the other rules are built, so their constants are checked.
    """
    min_microbatches, min_tokens = test.minimum
    never = ": every window would close before the test is consulted"
    if every_k_schedule is not None and not callable(every_k_schedule):
        if int(every_k_schedule) < min_microbatches:
            raise ValueError(
                f"`every_k_schedule` ({int(every_k_schedule)}) is below "
                + _fewest_consulted(min_microbatches, test)
                + never
            )
    # Its minimum budget in tokens, in words: the norm test's, or another
    # policy's passed as `norm_test=`, by its own name.
    fewest_tokens = (
        f"{test.name}'s `minimum` ({min_tokens} tokens)"
        if _another_policy(test)
        else f"the norm test's `min_tokens` ({min_tokens})"
    )
    if count_dtype is not None and min_tokens > _largest_total(count_dtype):
        raise ValueError(
            f"{fewest_tokens[0].upper()}{fewest_tokens[1:]} is beyond the largest "
            f"window total count_dtype {np.dtype(count_dtype)} holds "
            f"({_largest_total(count_dtype)}): the test would never be consulted"
        )
    if isinstance(budget, WindowPolicy):
        max_microbatches, max_tokens = budget.maximum
        if max_microbatches is not None and max_microbatches < min_microbatches:
            raise ValueError(
                f"`tokens_per_window`'s `max_microbatches` ({max_microbatches}) "
                "is below " + _fewest_consulted(min_microbatches, test) + never
            )
        budget = max_tokens
    if budget is None or callable(budget):
        return
    if float(budget) < min_tokens:
        raise ValueError(
            f"`tokens_per_window` ({budget}) is below {fewest_tokens}" + never
        )


def _largest_total(count_dtype: Any) -> int | float:
    """The largest window total ``count_dtype`` holds, as a Python number
    (numpy would cast 1e39 to float32's inf before comparing)."""
    dtype = np.dtype(count_dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return int(np.iinfo(dtype).max)
    return float(np.finfo(dtype).max)


def check_reachable(policy: WindowPolicy, count_dtype: Any) -> None:
    """Refuses a fixed token budget beyond the largest window total that
    ``count_dtype`` holds: the window could never reach it (a microbatch that
    would take the total past that is skipped), so it would never close by it.
    """
    budget = policy.maximum[1]
    if budget is None:
        return
    dtype = np.dtype(count_dtype)
    integer = jnp.issubdtype(dtype, jnp.integer)
    top = _largest_total(dtype)
    if budget > top:
        raise ValueError(
            f"The token budget {budget} (`tokens_per_window`, or the norm test's "
            f"`max_tokens`) is beyond the largest window total count_dtype "
            f"{dtype} holds ({top}): no window could reach it. Use a smaller "
            "budget" + (" or the default count_dtype (float32)" if integer else "")
        )


def window_policy(
    every_k_schedule: int
    | np.integer
    | Callable[[jax.Array], jax.typing.ArrayLike]
    | None = None,
    tokens_per_window: (
        float
        | np.floating
        | np.integer
        | Callable[[jax.Array], jax.typing.ArrayLike]
        | WindowPolicy
        | None
    ) = None,
    norm_test: float | np.floating | WindowPolicy | None = None,
    count_dtype: Any = None,
) -> WindowPolicy:
    """The policy of ``MaskedMultiSteps``' window arguments: whichever closes first.

    Args:
      every_k_schedule: microbatches per window (see :func:`every_k`), or
        ``None``.
      tokens_per_window: a token budget: a number, a callable of the tokens
        seen (see :func:`token_budget`), a policy that :func:`token_budget`
        built (e.g. ``by="gradient_step"``), or ``None``.
      norm_test: the norm test's θ (a number), a policy that :func:`norm_test`
        built (with its minimum and maximum budgets), or ``None``.
      count_dtype: the dtype of the window's token total, if known: the norm
        test's ``min_tokens`` must be a total it holds.

    Returns:
      :func:`any_of` the given rules.

    Raises:
      TypeError: if none of the three is given, or one has the wrong type
        (a policy as ``every_k_schedule`` names the keyword it belongs to).
      ValueError: if a value is out of range, or a policy is given to the
        other keyword (``norm_test=`` takes a policy that reads the window
        statistics, ``tokens_per_window=`` one that does not), or the norm
        test is given no maximum: neither ``every_k_schedule`` nor
        ``tokens_per_window`` nor its own ``max_tokens``/``max_microbatches``,
        or a fixed ``every_k_schedule`` or ``tokens_per_window`` is below its
        minimum (it would never be consulted: the test decides on 2
        microbatches with tokens at the fewest), or its ``min_tokens`` is
        beyond ``count_dtype``'s largest total.

    Examples:
      >>> import jax.numpy as jnp
      >>> policy = window_policy(8, tokens_per_window=4096)
      >>> s = WindowScalars(jnp.int32(3), jnp.float32(5000.0), jnp.int32(0))
      >>> print(policy.closes(policy.init(), s))
      True
    """
    policies = []
    for keyword, given in [
        ("every_k_schedule", every_k_schedule),
        ("tokens_per_window", tokens_per_window),
        ("norm_test", norm_test),
    ]:
        if given is token_budget or given is _norm_test:
            # The factory itself, not a policy it builds: it would pass for a
            # schedule of one argument and fail at the first update.
            call = (
                "tokens_per_window=mm.token_budget(4096)"
                if given is token_budget
                else "norm_test=mm.norm_test(0.5)"
            )
            raise TypeError(
                f"`{keyword}` got the function mm.{given.__name__}: call it, e.g. "
                f"`{call}`"
            )
    if isinstance(every_k_schedule, WindowPolicy):
        # (`MaskedMultiSteps(opt, mm.token_budget(4096))`: the second
        # positional argument is the number of microbatches.)
        keyword = "norm_test" if every_k_schedule.needs_stats else "tokens_per_window"
        raise TypeError(
            f"`every_k_schedule` got {every_k_schedule.name}, a window policy: "
            f"pass it as `{keyword}=` (every_k_schedule takes a number of "
            "microbatches per window, or a callable of the gradient step)"
        )
    if every_k_schedule is not None:
        policies.append(microbatch_window(every_k_schedule))
    if tokens_per_window is not None:
        if isinstance(tokens_per_window, WindowPolicy):
            check_policy(tokens_per_window, "tokens_per_window")
            if tokens_per_window.needs_stats:
                raise ValueError(
                    f"`tokens_per_window` got {tokens_per_window.name}, a policy "
                    "that decides on the window statistics: pass it as "
                    "`norm_test=`"
                )
            policies.append(tokens_per_window)
        else:
            policies.append(
                _token_budget(tokens_per_window)._replace(
                    name=f"tokens_per_window={describe(tokens_per_window)}"
                )
            )
    if norm_test is not None:
        if isinstance(norm_test, WindowPolicy):
            check_policy(norm_test, "norm_test")
            if not norm_test.needs_stats:
                raise ValueError(
                    f"`norm_test` got {norm_test.name}, a policy that reads no "
                    "window statistics: pass it as `tokens_per_window=`"
                )
        test = (
            norm_test if isinstance(norm_test, WindowPolicy) else _norm_test(norm_test)
        )
        _check_consulted(test, every_k_schedule, tokens_per_window, count_dtype)
        policies.append(test)
    if not policies:
        raise TypeError(
            "MaskedMultiSteps needs a rule that closes its windows: pass "
            "`every_k_schedule` (microbatches per window), `tokens_per_window` "
            "(a token budget) or `norm_test`; got none of them"
        )
    policy = any_of(*policies)
    if not policy.bounded:
        unbounded = [p for p in policies if not p.bounded]
        if any(map(_another_policy, unbounded)):
            # A policy of the user's own that sets no maximum by itself.
            number = (
                " or a number of tokens as `tokens_per_window`"
                if tokens_per_window is None
                else ""
            )
            names = ", ".join(map(describe, unbounded))
            raise ValueError(
                f"No rule sets a maximum window ({names}: a policy "
                "of your own declared `bounded=False` sets none), so a window "
                "could stay open forever: pass `every_k_schedule` (a maximum "
                f"number of microbatches){number} beside it"
            )
        raise ValueError(
            "The norm test needs a maximum window, or a window could stay open "
            "forever: pass `every_k_schedule` (a maximum number of microbatches), "
            "`tokens_per_window` (a maximum number of tokens), or "
            "`norm_test=mm.norm_test(θ, max_tokens=..., max_microbatches=...)`"
        )
    return policy
