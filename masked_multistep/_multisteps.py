"""`MaskedMultiSteps`: token-weighted gradient accumulation for optax.

The module is the state machine only: argument checks and the count contract
live in ``_checks``, the window-closing rule in ``_windows``, the arithmetic in
``_running_mean``, how the devices agree on a window's mean in ``_reduction``
(locally) and ``_deferred`` (deferred to the window's end), the window
statistics in ``_stats``, how the inner optimizer is called at a window's
end in ``_inner``, what a window's close does in ``_close``, and the
state's layout and the checks of a state handed to a step in ``_state``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Never, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from masked_multistep import (
    _checks,
    _close,
    _inner,
    _processes,
    _sq_norms,
    _stats,
    _windows,
)
from masked_multistep._branch import EagerMemo, in_place_cond
from masked_multistep._collectives import reduced_leaf
from masked_multistep._deferred import Deferred
from masked_multistep._reduction import (
    Local,
    WindowTotals,
    check_on_mesh,
)
from masked_multistep._running_mean import (
    accumulator_dtype,
    fits,
)
from masked_multistep._shards import (
    check_reduced,
    check_window,
    one_copy,
    over_slices,
)
from masked_multistep._state import (
    MaskedMultiStepsState,
    check_state,
    layout,
    scalars_as_arrays,
    states_in,
)

__all__ = ["MaskedMultiSteps", "MaskedMultiStepsState"]


class _Gate(NamedTuple):
    """What the checks decided about one microbatch."""

    # The (global) count to accumulate (0 unless `counted`; with a deferred
    # reduction agreeing only at the window's end, 0: the devices' own are in
    # `local_counts`).
    n: jax.Array
    local_counts: Any  # every device's count with a deferred reduction, else None
    counted: jax.Array  # the microbatch belongs to the window (mini_step advances)
    valid_count: jax.Array  # the count was usable
    full: jax.Array  # a usable count the window's total cannot take: it closes
    skip_state: Any


class _Window(NamedTuple):
    """The window with this microbatch folded in, before it may close."""

    acc_grads: Any
    acc_count: jax.Array
    acc_value: jax.Array
    value_count: jax.Array
    reduction_state: Any
    stats: Any


def _no_skip(updates, gradient_step, params):
    del updates, gradient_step, params
    return jnp.zeros([], jnp.bool_), ()


_DEFAULT_STATS_DECAY = 0.9
# `count_dtype`'s default, which `help` shows as dtype('float32') (not jnp.float32's
# `<class 'jax.numpy.float32'>`).
_FLOAT32 = np.dtype("float32")
# The params' type, which `apply_gradients` returns them in.
_ParamsT = TypeVar("_ParamsT")

# `optax.MultiSteps` keywords with no meaning here, and why; and what other
# libraries call the window size.
_WINDOW_SIZE_HINT = "the microbatches per window are `every_k_schedule=`"
_KEYWORD_HINTS = {
    "use_grad_mean": (
        "MaskedMultiSteps always keeps a running (token-weighted) mean, which "
        "cannot overflow in low precision; drop `use_grad_mean`. (A run that "
        "summed, `use_grad_mean=False`, stepped on k times the mean: for an "
        "optimizer that is not scale-invariant, sgd or momentum, multiply its "
        "learning rate by k.)"
    ),
    **dict.fromkeys(
        (
            "k",
            "every_k",
            "num_microbatches",
            "accumulation_steps",
            "gradient_accumulation_steps",
            "grad_accum_steps",
        ),
        _WINDOW_SIZE_HINT,
    ),
}


def _placed_leaves(state: Any) -> Iterator[Any]:
    """The state's token total, then its accumulator's leaves (lazily: the
    first committed one places the state), or nothing for another kind of
    state (named by the state's check)."""
    if isinstance(state, MaskedMultiStepsState):
        yield state.acc_count
        yield from jax.tree.leaves(state.acc_grads)


# optax.MultiSteps' arguments after `every_k_schedule`, in its order.
_OPTAX_POSITIONAL = ("use_grad_mean", "should_skip_update_fn", "accumulator_dtype")


_INIT_DOC = """The wrapper's initial state for ``params``.

When the state is made of global arrays on devices of every process (a
multi-process mesh, outside ``jit``), the processes compare their wrappers'
``repr`` and state layouts (one small all-gather) and all raise ``ValueError``
if they differ: every process must build the same wrapper, and call ``init``
(``jax.jit(tx.init)(params)`` builds the state without the comparison)."""


class MaskedMultiSteps(optax.GradientTransformationExtraArgs):
    """Accumulates microbatch gradients weighted by token count, then updates.

    Each call of :meth:`update` takes one microbatch's *mean* gradient ``gᵢ`` and
    its number of real (unmasked) tokens ``nᵢ``. After ``k`` microbatches, or
    once the microbatches hold a token budget (a *window*), the inner optimizer
    is called once, with the gradient of the full batch's token-mean loss::

        mean = Σ nᵢ gᵢ / Σ nᵢ

    kept as a running mean (``N ← N + n;  m ← m + (g − m)·n/N``, West 1979), so no
    sum is formed and nothing overflows in low precision. ``optax.MultiSteps``
    instead averages the ``gᵢ`` with equal weight, which over-weights short
    microbatches. With all counts equal the two agree.

    The wrapper is itself an ``optax.GradientTransformationExtraArgs``: it goes
    wherever optax and flax expect a gradient transformation, and inside
    ``optax.chain`` the chain forwards ``count=`` to it. Its semantics, case by
    case, follow the examples.

    Where clipping goes: ``MaskedMultiSteps(optax.chain(clip, adam), k)`` clips
    the window's full-batch gradient, which is what the full batch would see;
    ``optax.chain(clip, MaskedMultiSteps(adam, k))`` clips every microbatch's
    gradient before accumulating, which is no longer the full-batch gradient.

    Pass ``count`` as a ``jax.Array`` (e.g. from :func:`masked_mean`) to a jitted
    step: a Python int is a different type to ``jit``, so mixing the two kinds
    compiles the step once more (once per kind, not per value).

    Calls: ``tx.init(params)``; per microbatch ``tx.update(grads, state, params,
    count=n, value=loss)`` (see its ``help``) or :meth:`apply_gradients`, which
    returns the new params. Around it: :func:`has_updated`, :func:`window_stats`
    and :func:`find_state` read the state wherever it is nested;
    :class:`TrainState` and ``nnx.Optimizer`` take the wrapper as their ``tx``;
    :func:`microbatched_value_and_grad` accumulates inside one jitted call
    instead; :func:`from_optax_multisteps` converts an ``optax.MultiSteps``
    state; checkpoints mid-window restore with orbax against ``tx.init``'s
    state (README, "Checkpointing").

    Args:
      opt: the inner optimizer (``optax.GradientTransformation``).
      every_k_schedule: microbatches per window: an int in ``[1, 2³¹ − 1]``, or a
        callable of ``gradient_step`` returning one (rounded, clipped to
        ``[1, 2³¹ − 1]``; a Python or numpy value that is NaN or rounds below
        1 is a ``ValueError``, a jax array's NaN counts as 1). With
        ``tokens_per_window`` or ``norm_test``, the most microbatches a window
        may hold. At least one of ``every_k_schedule``, ``tokens_per_window``
        and ``norm_test`` is required.
      tokens_per_window: tokens per window: a number ``> 0``; a callable of the
        tokens seen in all completed windows (a float32 scalar) returning the
        budget, for a budget warmup; :func:`token_budget` (a budget of the
        gradient step, ``by="gradient_step"``); or a :class:`WindowPolicy` of
        your own. A callable's value, if a
        Python or numpy number, must not be NaN or negative; a jax array
        (traced, or concrete in an eager step) is made total (NaN counts as
        0, ``inf`` means no token limit).
      norm_test: close a window once its mean gradient is precise enough by the
        norm test (Byrd et al. 2012): θ, or :func:`norm_test` with its minimum
        and maximum budgets. ``every_k_schedule`` and ``tokens_per_window`` are
        then its maximum window; one of the three must set one.
      should_skip_update_fn: optional optax ``ShouldSkipUpdateFunction``, e.g.
        ``optax.skip_not_finite``.
      accumulator_dtype: dtype of the running mean ``acc_grads``. ``None``
        (default) follows each parameter leaf, at least float32 (float64
        gradients under x64 accumulate in float64; complex stays complex, and
        a complex gradient for a real parameter is a ``TypeError``). A bfloat16
        or float16 accumulator rounds the mean on every microbatch; with
        gradients that drift within a long window the mean stops moving once
        ``(g − m)·n/N`` is below half a rounding unit of ``m`` (README,
        "Windows and the state"). 8-bit floats are refused.
      count_dtype: dtype of the window's token total: float32 (default; integer
        and fractional counts, integers exact to 2²⁴ per window), int32 (exact
        to 2³¹ − 1, integer counts only), or float64/int64 under x64.
      reduction: ``None`` (default): the gradients handed over are already the
        microbatch's global mean (under ``jit`` with sharded arrays the compiler
        reduces them, once per microbatch). ``mm.deferred(mesh, axis_name)``:
        they are every device's own, stacked along a leading device axis, with
        one count per device (from :func:`per_device_value_and_grad`); each
        device accumulates its own running mean and the devices are combined,
        token-weighted, once per window (with a window of ``k`` microbatches
        and no skip function, the only cross-device traffic of the window;
        see :func:`deferred`).
      window_stats: keep each window's statistics (tokens, loss, gradient norm,
        gradient noise scale) in ``state.stats``; read them with
        :func:`masked_multistep.window_stats`. They never change the updates
        and need no parameter-sized memory: one squared-norm reduction of each
        microbatch's gradient and one of each window's mean. With
        ``reduction=mm.deferred(...)`` each device's share of a microbatch is
        a small batch of its own (more of them, for free).
      stats_decay: per-window decay of the moving averages behind
        ``WindowStats.smoothed_noise_scale``, in ``[0, 1)``; only with the
        statistics on (``window_stats=True``, ``per_leaf_stats=True`` or a
        norm test).
      per_leaf_stats: keep each parameter leaf's share of the window
        statistics as well (turns them on): one float32 vector of a few
        entries per leaf, from the squared norms the statistics already take
        leaf by leaf. ``mm.window_stats(state, per_leaf=True)`` reads each
        leaf's gradient norm, variance and noise scale, and
        ``mm.window_stats(state, groups=labels)`` each group's (layers,
        parameter kinds). With ``reduction=mm.deferred(...)`` each device's
        share counts per leaf.

    Raises:
      TypeError: if ``opt`` is not a gradient transformation, or no window rule
        is given, or ``every_k_schedule`` is neither an integer nor callable, or
        ``tokens_per_window`` is not a number, callable or policy, or
        ``norm_test`` not a number or policy, or ``reduction`` is neither
        ``None`` nor ``mm.deferred(...)``, or ``window_stats`` or
        ``per_leaf_stats`` is not a bool, or ``count_dtype`` or
        ``accumulator_dtype`` is not a dtype, or ``stats_decay`` not a real
        number, or an ``optax.MultiSteps``-only keyword is passed, or it is built by
        ``optax.inject_hyperparams`` (inject the inner optimizer's
        hyperparameters instead; raised where that builds it, in its ``init``).
      ValueError: if ``every_k_schedule`` is out of range, or a budget is not
        finite and ``> 0``, or a fixed one beyond the largest window total
        ``count_dtype`` holds, or the norm test has no maximum window, or a window
        policy is given to the other keyword (:func:`norm_test` to
        ``tokens_per_window``, :func:`token_budget` to ``norm_test``), or a
        dtype cannot serve, or ``stats_decay`` is not a scalar, or outside
        ``[0, 1)``, or, other than the default, given with the statistics off.
        ``init`` raises
        ``TypeError`` if ``opt`` holds an accumulator of its own (another
        ``MaskedMultiSteps``, an ``optax.MultiSteps`` or ``optax.apply_every``),
        and ``ValueError`` if traced (``jax.jit(tx.init)``,
        ``jax.eval_shape``) outside ``jax.set_mesh`` with
        ``reduction=mm.deferred(...)`` over an explicit data axis of a mesh
        that has auto axes too (it could not lay the accumulator out).

    Examples:
      Three microbatches with 1, 1 and 2 tokens; the window's update is the
      full-batch token-mean gradient ``(1·1 + 1·1 + 2·4) / 4 = 2.5``:

      >>> import jax.numpy as jnp
      >>> import optax
      >>> import masked_multistep as mm
      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=3)
      >>> params = {"w": jnp.zeros(())}
      >>> state = tx.init(params)
      >>> for g, n in [(1.0, 1), (1.0, 1), (4.0, 2)]:
      ...     updates, state = tx.update({"w": jnp.array(g)}, state, params,
      ...                                count=jnp.array(n))
      >>> print(updates["w"], tx.has_updated(state))
      -2.5 True

      ``optax.MultiSteps`` would have applied ``-(1 + 1 + 4) / 3 = -2.0``.
      Float counts (flax's float loss weights) work the same way:

      >>> state = tx.init(params)
      >>> for g, n in [(1.0, 0.5), (1.0, 0.5), (4.0, 1.0)]:
      ...     updates, state = tx.update({"w": jnp.array(g)}, state, params,
      ...                                count=jnp.float32(n))
      >>> print(updates["w"])
      -2.5

      A window of at least 4 tokens: microbatches of 1, 0 and 3 tokens close it
      on the third, and the next on its own (5 tokens):

      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=4)
      >>> state = tx.init(params)
      >>> for g, n in [(1.0, 1), (jnp.nan, 0), (5.0, 3), (2.0, 5)]:
      ...     updates, state = tx.update({"w": jnp.array(g)}, state, params,
      ...                                count=jnp.array(n))
      ...     print(updates["w"], int(state.gradient_step))
      0.0 0
      0.0 0
      -4.0 1
      -2.0 2

      The data ends two microbatches into a window of 3: ``close_window=True``
      on the last one applies what the window holds, ``(1·3 + 5·1) / 4 = 2``:

      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=3)
      >>> state = tx.init(params)
      >>> for g, n, last in [(1.0, 3, False), (5.0, 1, True)]:
      ...     updates, state = tx.update({"w": jnp.array(g)}, state, params,
      ...                                count=jnp.array(n), close_window=last)
      ...     print(updates["w"], int(state.gradient_step), int(state.mini_step))
      0.0 0 1
      -2.0 1 0

    Semantics:
      * A window closes on the microbatch that completes it by any of the rules
        given, whichever comes first: its ``k``-th microbatch
        (``every_k_schedule``); the microbatch whose count brings the window's
        tokens ``Σ nᵢ`` (as ``acc_count`` holds them, in ``count_dtype``) to
        ``tokens_per_window`` or past it (a count-0 microbatch only where the
        window already holds its budget, as a state converted or restored
        into a smaller budget does; the window may overshoot the budget by up
        to one microbatch's tokens); the microbatch on which the norm test passes
        (``norm_test``, decided on the window statistics so far, which it
        keeps on). A window whose total cannot take a microbatch's count (an
        int32 ``count_dtype`` near 2³¹ − 1) is full and closes on that
        microbatch, which is skipped (``num_invalid_counts``). The rules read
        only scalars every device agrees on (the window's microbatches and
        global token total, the gradient step, the tokens seen), so with
        ``reduction=mm.deferred(...)`` all devices close on the same
        microbatch; the rules' state (the tokens seen, for a budget
        that depends on them) is ``policy_state``.
      * ``close_window=True`` (``update``, :meth:`apply_gradients`,
        :class:`TrainState`'s and ``nnx.Optimizer``'s ``update``) closes the
        window on this microbatch whatever its rules say: for the last
        microbatch of the data (of an epoch, or of the run), whose window
        would otherwise wait for microbatches that never come (in
        ``optax.MultiSteps`` too). The window closes as its rules would close
        it, also where this microbatch is skipped or its count invalid: the
        inner optimizer runs on the token mean of what the window holds, its
        statistics are recorded, a budget's tokens seen advance, and the next
        window starts empty. A window that ``close_window`` alone closes
        without tokens (``tx.update(zeros, state, params, count=0,
        close_window=True)`` right after a window closed, when the data ended
        on a window's boundary) is dropped: no update, no window completed
        (the last one's statistics stay readable, the rules' state is as
        without the flag): the call changes only what the microbatch itself
        changes without the flag (a skip function's state, the invalid
        counts, also those the window held), ``mini_step`` (0) and
        ``updated`` (False). A bool or a
        boolean scalar array, traced under ``jit`` too (``False`` or ``None``
        compile the program without it); with ``reduction=mm.deferred(...)``
        one flag for all devices. On several processes it must be the same
        on each, as every input a step's program takes replicated: derive it
        from a count all processes share (the step, the dataset's global
        size), not from one process's own loader running out, or processes
        that disagree stop closing windows together (with a deferred
        reduction, one waits in the window's all-reduce for the others).
      * Between windows the returned updates are zeros (structure and dtype of the
        inner optimizer's updates); the inner optimizer runs only at the end of a
        window, so its state, step count, schedules and weight decay advance once
        per window.
      * ``count == 0`` adds nothing, even if the gradient is NaN (an all-masked
        microbatch gives 0/0), and always counts toward its window (``mini_step``
        advances), whatever ``should_skip_update_fn`` says about its meaningless
        gradient (the skip function's state is then left as it was).
      * A window whose counts are all zero applies no update: zeros are returned,
        the inner state and ``gradient_step`` are unchanged.
      * A microbatch with tokens that ``should_skip_update_fn`` rejects is as if
        it never happened (as in optax): it neither counts toward ``k`` nor
        toward the token budget, and never closes a window (unless its count
        does not fit the window's total, which closes the full window).
      * The count contract (accepted types, precision, what happens under
        ``jit``; the README's "The count contract"): any real scalar, converted
        by value, exact to 2²⁴ tokens per window in the default float32; a bad
        concrete count raises ``ValueError``; under ``jit`` it is skipped and
        counted in ``state.num_invalid_counts``.
      * A window whose mean gradient is not finite (a NaN or inf gradient with a
        positive count) is not handed to the inner optimizer: zeros are returned,
        the inner state (adam's moments too) is untouched, the window is counted
        in ``state.num_nonfinite_windows``, and the next window starts clean.
        The mean goes to the inner optimizer in the dtype of the gradients
        passed with the call that closes the window (as optax's updates take
        their gradients'): a narrower one rounds it (and flushes its smallest
        entries to zero), and a mean that overflows it (a flush of float16
        zeros after float32 gradients) is not finite either.
      * ``value=`` (the microbatch's mean loss, a scalar), if passed, is averaged
        with the same weights over the microbatches that pass one, and handed to
        the inner optimizer as ``value=`` at the end of the window. An inner
        optimizer that needs ``value=`` (``optax.contrib.reduce_on_plateau``)
        receives the window's mean also when the closing microbatch passes none;
        a window in which no microbatch passed one (a forgotten ``value=``), or
        whose mean is not finite, is held for such an optimizer like a
        non-finite mean (counted in ``state.num_nonfinite_windows``). One
        whose update's signature refuses the keyword (``optax.contrib.sam``)
        runs without it; the wrapper keeps the mean for ``mm.window_stats``.
        ``grad=`` (a line search's gradient at the params), if passed, is
        replaced by the window's mean of the gradients this wrapper receives,
        what the inner optimizer gets as its updates (the window's gradient
        when nothing transforms it before the wrapper: put clipping and the
        like inside it). Other extra arguments go to the inner optimizer as the
        window's closing call passes them (a line search's ``value_fn`` must
        give the window's loss).
      * With ``window_stats=True`` each completed window's statistics (tokens,
        microbatches, loss, ‖ḡ‖², the gradient noise scale; see
        :class:`WindowStats`) are kept in ``state.stats`` until the next window
        completes. They never change the updates. A window that ends without
        tokens, or with a non-finite mean, still completes: its tokens, loss
        and ``tokens_seen`` are counted, its noise-scale estimates are NaN and
        the smoothed noise scale skips it.

    References:
      R. H. Byrd, G. M. Chin, J. Nocedal, Y. Wu, "Sample size selection in
      optimization methods for machine learning", Mathematical Programming
      134, 2012.

      D. H. D. West, "Updating mean and variance estimates: an improved method",
      Communications of the ACM 22(9), 1979.
    """

    # A NamedTuple subclass: `init` and `update` are the tuple's fields (what
    # optax and flax call); everything else lives in the instance's __dict__.

    if TYPE_CHECKING:
        # What a type checker sees of the fields: the signatures of optax's
        # `TransformInitFn` and `TransformUpdateExtraArgsFn`, returning a
        # `MaskedMultiStepsState` (a read-only field narrows covariantly), so
        # `tx.init(params).gradient_step` type-checks while the wrapper stays
        # assignable to `optax.GradientTransformation`. Declared as static
        # methods because pyright refuses to redeclare a named tuple's field;
        # at run time they are the tuple's fields, closures set in `__new__`.
        @staticmethod
        def init(params: optax.Params) -> MaskedMultiStepsState: ...

        @staticmethod
        def update(
            updates: optax.Updates,
            state: optax.OptState,
            params: optax.Params | None = None,
            *,
            count: jax.typing.ArrayLike = ...,
            **extra_args: Any,
        ) -> tuple[optax.Updates, MaskedMultiStepsState]: ...

        # The instance's attributes, set in `__new__`.
        _opt: optax.GradientTransformationExtraArgs
        _policy: _windows.WindowPolicy
        _should_skip_update_fn: optax.ShouldSkipUpdateFunction
        _accumulator_dtype: jnp.dtype | None
        _count_dtype: jnp.dtype
        _reduction: Local | Deferred
        _recorder: _stats.Recorder
        _eager_shapes: EagerMemo
        _inner_structures: EagerMemo
        _config: tuple[tuple[Any, ...], dict[str, Any]]

    def __new__(
        cls,
        opt: optax.GradientTransformation,
        every_k_schedule: int
        | np.integer
        | Callable[[jax.Array], jax.typing.ArrayLike]
        | None = None,
        # optax.MultiSteps' later arguments, which it takes by position too:
        # refused below, naming them (here they are keyword-only).
        *positional: Never,
        tokens_per_window: (
            float
            | np.floating
            | np.integer
            | Callable[[jax.Array], jax.typing.ArrayLike]
            | _windows.WindowPolicy
        )
        | None = None,
        norm_test: float | np.floating | _windows.WindowPolicy | None = None,
        should_skip_update_fn: optax.ShouldSkipUpdateFunction | None = None,
        accumulator_dtype: jax.typing.DTypeLike | None = None,
        count_dtype: jax.typing.DTypeLike = _FLOAT32,
        reduction: Deferred | None = None,
        window_stats: bool | np.bool_ = False,
        stats_decay: float | np.floating = _DEFAULT_STATS_DECAY,
        per_leaf_stats: bool | np.bool_ = False,
        # Typed Never so that a type checker flags a misspelt keyword; at run
        # time it gets the error below, with a suggestion. (Kept in the
        # signature `inspect` shows: optax.inject_hyperparams binds it as
        # `unknown={}`, which is how a wrapper built by it is recognised.)
        **unknown: Never,
    ) -> MaskedMultiSteps:
        if unknown.get("unknown", None) == {}:
            # What optax.inject_hyperparams(mm.MaskedMultiSteps) passes.
            raise TypeError(
                "MaskedMultiSteps cannot be built by optax.inject_hyperparams "
                "(it would be rebuilt on every call); inject the inner "
                "optimizer's hyperparameters instead: mm.MaskedMultiSteps("
                "optax.inject_hyperparams(optax.adam)(learning_rate=...), k)"
            )
        if positional:
            named = ", ".join(
                f"{name}={_checks.short_repr(value)}"
                for name, value in zip(_OPTAX_POSITIONAL, positional, strict=False)
            )
            if len(positional) > len(_OPTAX_POSITIONAL):
                named += f", and {len(positional) - len(_OPTAX_POSITIONAL)} more"
            raise TypeError(
                "MaskedMultiSteps takes `opt` and `every_k_schedule` by position "
                f"and the rest by keyword, got {len(positional)} more positional "
                f"argument{'s' if len(positional) > 1 else ''} (as optax.MultiSteps "
                f"would read them: {named}): pass `should_skip_update_fn=` and "
                "`accumulator_dtype=` by keyword; " + _KEYWORD_HINTS["use_grad_mean"]
            )
        _checks.refuse_unknown_keywords(
            "MaskedMultiSteps", unknown, cls.__new__, _KEYWORD_HINTS
        )
        if not hasattr(opt, "update") and hasattr(every_k_schedule, "update"):
            raise TypeError(
                f"`opt` must be an optax GradientTransformation, got "
                f"{type(opt).__name__} ({opt!r}), and `every_k_schedule` got one: "
                "the optimizer goes first, "
                "MaskedMultiSteps(opt, every_k_schedule=k)"
            )
        _inner.check_opt(opt)
        acc_dtype = _checks.check_accumulator_dtype(accumulator_dtype)
        cnt_dtype = _checks.check_count_dtype(count_dtype)
        policy = _windows.window_policy(
            every_k_schedule, tokens_per_window, norm_test, cnt_dtype
        )
        _windows.check_reachable(policy, cnt_dtype)
        if should_skip_update_fn is not None and not callable(should_skip_update_fn):
            raise TypeError(
                "`should_skip_update_fn` must be None or a function like "
                f"optax.skip_not_finite, got {should_skip_update_fn!r}"
            )
        if should_skip_update_fn is not None:
            _checks.check_takes(
                should_skip_update_fn,
                "`should_skip_update_fn`",
                "three arguments",
                3,
                "updates, gradient_step, params",
                ": bind the others, e.g. functools.partial("
                "optax.skip_large_updates, max_squared_norm=...)",
            )
        if reduction is not None and not isinstance(reduction, Deferred):
            raise TypeError(
                "`reduction` must be None or mm.deferred(mesh, axis_name), got "
                f"{reduction!r} of type {type(reduction).__name__}"
            )
        recorder = _recorder_for(
            policy, reduction, window_stats, stats_decay, per_leaf_stats
        )

        def init(params: optax.Params) -> MaskedMultiStepsState:
            return self._init(params)

        def update(
            updates,
            state,
            params=None,
            *args,
            count=None,
            close_window=None,
            **extra_args,
        ):
            _refuse_positional_count("update", args)
            return self._update(
                updates,
                state,
                params,
                count=count,
                close_window=close_window,
                **extra_args,
            )

        # What `help(tx.init)` and `help(tx.update)` show.
        init.__qualname__ = "MaskedMultiSteps.init"
        init.__doc__ = _INIT_DOC
        update.__qualname__ = "MaskedMultiSteps.update"
        update.__doc__ = cls._update.__doc__

        self = super().__new__(cls, init, update)
        self._opt = optax.with_extra_args_support(opt)
        self._policy = policy
        self._should_skip_update_fn = should_skip_update_fn or _no_skip
        self._accumulator_dtype = acc_dtype
        self._count_dtype = cnt_dtype
        if reduction is not None:
            # The variant is this wrapper's choice, from its rules: a variant
            # built elsewhere (its state kept for other rules) starts over.
            reduction = Deferred(reduction.mesh, reduction._spec_axes)
            if _counts_needed_only_at_close(
                every_k_schedule, tokens_per_window, norm_test, should_skip_update_fn
            ):
                # Nothing needs a microbatch's global count before its window
                # closes: the devices need not agree on it sooner (the
                # statistics' per-device shares wait for the window's end too).
                reduction = reduction._per_window(
                    stats=recorder.enabled, per_leaf=recorder.per_leaf
                )
        self._reduction = Local() if reduction is None else reduction
        self._recorder = recorder
        # `_inner.window_shapes` of eager steps, by their arguments' avals.
        self._eager_shapes = EagerMemo(size=16)
        # The inner states' structures `init` built, by `_inner.avals_key` of
        # their params: `_inner.window_shapes` then need not trace `opt.init`.
        self._inner_structures = EagerMemo(size=16)
        self._config = (
            (opt, every_k_schedule),
            {
                "tokens_per_window": tokens_per_window,
                "norm_test": norm_test,
                "should_skip_update_fn": should_skip_update_fn,
                "accumulator_dtype": accumulator_dtype,
                "count_dtype": count_dtype,
                "reduction": reduction,
                "window_stats": window_stats,
                "stats_decay": stats_decay,
                "per_leaf_stats": per_leaf_stats,
            },
        )
        return self

    def __reduce__(self):
        # Rebuild from the constructor's arguments (the tuple's fields are
        # closures over this instance, not constructor arguments).
        args, kwargs = self._config
        return (functools.partial(MaskedMultiSteps, **kwargs), args)

    # Immutable: a copy is the wrapper itself. A rebuilt one (`__reduce__`)
    # would compare unequal (its closures are new), so a step taking a deep
    # copy of it (e.g. in a copied NNX optimizer) as a static argument, or
    # closing over it, would compile again.
    def __copy__(self) -> MaskedMultiSteps:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> MaskedMultiSteps:
        del memo
        return self

    def __repr__(self) -> str:
        (opt, k), kwargs = self._config
        inner = _inner.describe(opt)
        show = _windows.describe
        rules = [f"every_k_schedule={show(k)}"] if k is not None else []
        rules += [
            f"{name}={show(kwargs[name])}"
            for name in ("tokens_per_window", "norm_test")
            if kwargs[name] is not None
        ]
        acc = self._accumulator_dtype or "follows the params, at least float32"
        reduction = kwargs["reduction"]
        options = f", reduction={reduction!r}" if reduction is not None else ""
        if (skip := kwargs["should_skip_update_fn"]) is not None:
            # A function by its name (a partial by its function's).
            name = getattr(skip, "__name__", None) or getattr(
                getattr(skip, "func", None), "__name__", type(skip).__name__
            )
            options += f", should_skip_update_fn={name}"
        rec = self._recorder
        if rec.enabled:
            options += f", window_stats=True, stats_decay={rec.decay}"
        if rec.per_leaf:
            options += ", per_leaf_stats=True"
        return (
            f"MaskedMultiSteps(inner={inner}, {', '.join(rules)}, "
            f"accumulator_dtype={acc}, count_dtype={self._count_dtype}{options})"
        )

    @property
    def inner_opt(self) -> optax.GradientTransformationExtraArgs:
        """The wrapped optimizer."""
        return self._opt

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        """This wrapper as a plain ``optax.GradientTransformationExtraArgs``.

        The wrapper already is one; this returns the bare ``(init, update)``
        pair, for code that wants exactly that type.

        Inside ``optax.chain`` the wrapper goes as it is.

        Examples:
          >>> import jax.numpy as jnp, optax
          >>> import masked_multistep as mm
          >>> tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2)
          >>> type(tx.gradient_transformation()).__name__
          'GradientTransformationExtraArgs'
          >>> chain = optax.chain(tx, optax.scale(0.5))  # the wrapper as it is
          >>> state = chain.init(jnp.zeros(2))
          >>> updates, state = chain.update(jnp.ones(2), state, count=jnp.array(3))
        """
        return optax.GradientTransformationExtraArgs(self.init, self.update)

    def _init(self, params: optax.Params) -> MaskedMultiStepsState:
        _checks.refuse_state_as_params(params)
        _checks.check_param_leaves(params)
        gradient_step = jnp.zeros([], jnp.int32)
        if self._should_skip_update_fn is _no_skip:
            # No skip function: no state, and no param-sized zeros to build.
            skip_state = ()
        else:
            # Its state starts from gradients shaped as `update` hands them
            # over (with a deferred reduction, a leading device axis).
            _, skip_state = self._skip_verdict(
                self._reduction.init_accumulator(params, jnp.result_type),
                gradient_step,
                params,
            )
        acc_grads = self._reduction.init_accumulator(
            params,
            lambda p: accumulator_dtype(jnp.result_type(p), self._accumulator_dtype),
        )
        inner_opt_state = self._opt.init(params)
        _refuse_nested_accumulation(inner_opt_state)
        self._inner_structures.put(
            _inner.avals_key(params), jax.tree.structure(inner_opt_state)
        )
        num_leaves = len(jax.tree.leaves(params))
        state = MaskedMultiStepsState(
            mini_step=jnp.zeros([], jnp.int32),
            gradient_step=gradient_step,
            inner_opt_state=inner_opt_state,
            acc_grads=acc_grads,
            acc_count=jnp.zeros([], self._count_dtype),
            acc_value=jnp.zeros([], jnp.float32),
            updated=jnp.zeros([], jnp.bool_),
            num_invalid_counts=jnp.zeros([], jnp.int32),
            value_count=jnp.zeros([], self._count_dtype),
            num_nonfinite_windows=jnp.zeros([], jnp.int32),
            skip_state=skip_state,
            stats=self._recorder.init(self._count_dtype, num_leaves),
            policy_state=_windows.initial_state(self._policy),
            reduction_state=self._reduction.init(self._count_dtype, num_leaves),
        )
        state = self._reduction.place(state, params)
        if _processes.spans_every_process(state):
            _processes.check_same_across_processes(
                _processes.describe(self, state), "MaskedMultiSteps.init"
            )
        return state

    def has_updated(self, state: MaskedMultiStepsState) -> jax.Array:
        """True exactly when the last :meth:`update` applied an inner update.

        ``state`` is this wrapper's own state; :func:`masked_multistep.has_updated`
        finds it inside a chain's state, a ``TrainState`` or an NNX optimizer.

        Raises:
          TypeError: if ``state`` is not a wrapper's state (a nested one, or
            another optimizer's: the message names :func:`has_updated`), or
            is an abstract one (``jax.ShapeDtypeStruct`` leaves).

        Examples:
          >>> import jax.numpy as jnp, optax
          >>> import masked_multistep as mm
          >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
          >>> params = jnp.zeros(())
          >>> state = tx.init(params)
          >>> for n in (3, 1):
          ...     _, state = tx.update(jnp.array(1.0), state, params, count=n)
          ...     print(bool(tx.has_updated(state)))
          False
          True
        """
        if not hasattr(state, "updated"):
            raise TypeError(
                "`has_updated` takes the wrapper's own state (a "
                f"MaskedMultiStepsState), got {type(state).__name__}: for a nested "
                "state (optax.chain, mm.TrainState.opt_state, an NNX optimizer's "
                "opt_state) use mm.has_updated(opt_state)"
            )
        _checks.refuse_restore_target(state.updated, "`state`")
        return jnp.asarray(state.updated)

    def _update(
        self,
        updates: optax.Updates,
        state: MaskedMultiStepsState,
        params: optax.Params | None = None,
        *,
        count: jax.typing.ArrayLike | None = None,
        close_window: jax.typing.ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, MaskedMultiStepsState]:
        """Folds in one microbatch; at the window's end, runs the inner optimizer.

        This is the ``update`` of the gradient transformation:
        ``tx.update(grads, state, params, count=n, **extra_args)``.

        Args:
          updates: the microbatch's *mean* gradient (a pytree like the params).
          state: the current state.
          params: the current params, passed to the inner optimizer.
          count: the number of real tokens behind ``updates`` (or any non-negative
            weight), a real scalar. Required.
          close_window: ``True`` to end the window with this microbatch,
            whatever the window's rules say (the last microbatch of the data;
            the class's semantics say what closes); a bool or a boolean scalar
            array, traced under ``jit`` as well.
          **extra_args: ``value=`` (the microbatch's mean loss) is token-averaged
            over the window; ``grad=`` (a line search's) is replaced by the
            window's mean gradient; everything else goes to the inner optimizer
            at the end of the window.

        Returns:
          ``(updates, new_state)``: the inner optimizer's updates at the end of a
          window that saw tokens, zeros of the same structure and dtype otherwise.

        Raises:
          TypeError: if ``count`` is missing or of the wrong kind (bool,
            complex, bfloat16 or float16: see the count contract); if the
            gradients are not floating point, or complex for real params; if
            ``value`` is not a number, or is an integer array (most likely the
            token count, swapped with the loss; a Python int is taken as a
            float, but an int passed through ``jax.jit`` arrives as an int32
            array and is refused: pass losses as floats); if a
            keyword names the loss (``loss=``: it goes in ``value=``); if
            ``should_skip_update_fn`` or a window policy's ``closes`` returns
            a flag that is not boolean; if a callable ``every_k_schedule``
            returns something that is not a number (a string, ``None``, a
            bool).
          ValueError: if ``count`` is not a scalar (with
            ``reduction=mm.deferred(...)``: not one count per device, shape
            ``(D,)``), or is concretely negative, non-finite or too large; if
            ``value`` is not a scalar (or ``(D,)``); if the gradients do not
            match the state's tree (with a deferred reduction: lack the
            leading device axis); if ``state`` is a batch of states (from
            ``jax.vmap(tx.init)``, stepped without ``vmap``); if that flag is
            not a scalar; if ``close_window`` is a boolean array that is not a
            scalar (a ``TypeError`` if it is not a bool at all); if a callable
            ``every_k_schedule`` returns more than one number (an array or a
            list), or a Python or numpy number that is NaN or rounds below 1
            (a jax array's is clipped, and so is ``inf``: see the
            constructor).
        """
        with self._reduction.eager_mesh(
            updates, state, params, count, close_window, extra_args
        ):
            return self._step(
                updates,
                state,
                params,
                count,
                close_window,
                extra_args,
                apply_params=False,
            )

    def _apply_gradients(
        self,
        grads: optax.Updates,
        state: MaskedMultiStepsState,
        params: _ParamsT,
        *args: Any,
        count: jax.typing.ArrayLike | None = None,
        close_window: jax.typing.ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[_ParamsT, MaskedMultiStepsState]:
        """:meth:`update` followed by ``optax.apply_updates``, fused.

        Returns the new params directly. Between windows the params pass through
        untouched instead of receiving a tree of zeros, which saves a pass over
        them on every microbatch that does not end a window.

        Raises:
          TypeError: as :meth:`update`, and if ``params`` is ``None`` or not
            the model's parameters (the wrapper's state, say).
          ValueError: as :meth:`update`, and if ``params`` do not match the
            state's tree.

        Examples:
          >>> import jax.numpy as jnp, optax
          >>> import masked_multistep as mm
          >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
          >>> params = jnp.zeros(())
          >>> state = tx.init(params)
          >>> params, state = tx.apply_gradients(jnp.array(1.0), state, params,
          ...                                    count=jnp.array(3))
          >>> params, state = tx.apply_gradients(jnp.array(5.0), state, params,
          ...                                    count=jnp.array(1))
          >>> print(params)  # -(3 * 1 + 1 * 5) / 4
          -2.0
        """
        _refuse_positional_count("apply_gradients", args)
        with self._reduction.eager_mesh(
            grads, state, params, count, close_window, extra_args
        ):
            return self._step(
                grads, state, params, count, close_window, extra_args, apply_params=True
            )

    if TYPE_CHECKING:
        # What a type checker sees: `count` is required. At run time it
        # defaults to None, so that a missing or misspelt one gets the
        # wrapper's own error, which names the keywords it got instead. (The
        # run-time method is defined under another name, and aliased below:
        # mypy would keep a first definition of the same name.)
        def apply_gradients(
            self,
            grads: optax.Updates,
            state: MaskedMultiStepsState,
            params: _ParamsT,
            *,
            count: jax.typing.ArrayLike,
            close_window: jax.typing.ArrayLike | None = None,
            **extra_args: Any,
        ) -> tuple[_ParamsT, MaskedMultiStepsState]: ...

    else:
        apply_gradients = _apply_gradients
        _apply_gradients.__name__ = "apply_gradients"
        _apply_gradients.__qualname__ = "MaskedMultiSteps.apply_gradients"
        # The tuple's two fields, read through properties that carry the
        # docstrings: `help(mm.MaskedMultiSteps.update)` on the class shows
        # them, not "Alias for field number 1".
        init = property(operator.itemgetter(0), doc=_INIT_DOC)
        update = property(operator.itemgetter(1), doc=_update.__doc__)

    @functools.cached_property
    def _settings_shapes(self) -> Any:
        """The abstract state's fields that the settings shape: the window
        statistics', the window rule's and the reduction's states.

        Traced on the reduction's mesh, where it has one: it is first needed
        inside a step, which may be traced without ``jax.set_mesh``, and on a
        mesh of explicit and automatic axes a deferred reduction's ``init``
        refuses to trace without the mesh set (jax would replicate its state
        over the explicit data axis)."""
        with self._reduction.traced_mesh():
            return jax.eval_shape(
                lambda: (
                    self._recorder.init(self._count_dtype),
                    _windows.initial_state(self._policy),
                    self._reduction.init(self._count_dtype),
                )
            )

    @functools.cached_property
    def _settings_layout(self) -> Any:
        """:func:`~masked_multistep._state.layout` of :attr:`_settings_shapes`."""
        return layout(self._settings_shapes)

    @functools.cached_property
    def _stats_dtypes(self) -> list[Any]:
        """The dtypes of the window statistics' leaves, as ``init`` builds
        them (their number of leaves aside)."""
        return [x.dtype for x in jax.tree.leaves(self._settings_shapes[0])]

    # The state machine: gate, accumulate, decide, emit.

    def _skip_verdict(self, grads, gradient_step, params) -> tuple[jax.Array, Any]:
        """``should_skip_update_fn``'s ``(should_skip, state)``, checked."""
        out = self._should_skip_update_fn(grads, gradient_step, params)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(
                "`should_skip_update_fn` must return a pair `(should_skip, "
                "state)`, as optax's ShouldSkipUpdateFunction does (e.g. "
                f"optax.skip_not_finite), got {_checks.short_repr(out)}"
            )
        return _checks.returned_flag(out[0], "`should_skip_update_fn`"), out[1]

    def _gate(self, grads, state, params, count, value) -> _Gate:
        """Whether this microbatch counts, and with how many tokens."""
        n, count_ok, local_counts = self._reduction.to_count(count, self._count_dtype)
        if reduced := reduced_leaf(grads, count):
            # Inside shard_map: gradients averaged over the shards (pmean) with
            # each shard's own count; every shard would weigh its window's
            # microbatches differently, and the replicas drift apart.
            path, axes = reduced
            raise ValueError(
                f"`count` differs between the shards of {axes} while "
                f"grads{path} is the same on every shard (already reduced): "
                "each shard would weigh the window's microbatches by its own "
                "tokens. Pass the gradients' token-weighted mean and the total "
                f"count over the shards, `grads, count = mm.weighted_mean_across("
                f"grads, count, {axes[0]!r})` of each shard's own gradient "
                "and count"
            )
        check_window(state.acc_count, count, value)
        # The window's figures: inside shard_map, what tells split params'
        # slices (the same window on every shard) from shards of their own.
        figures = (state.acc_count, n, value)
        # Inside shard_map with the params split over a mesh axis, the skip
        # function sees this shard's slices (and the leaves the same on every
        # shard on the first one alone): the microbatch is skipped where any
        # shard's says so, and the state's numbers are the shards' sums.
        should_skip, skip_state = self._skip_verdict(
            one_copy(self._reduction.skip_view(grads, local_counts, n), figures),
            state.gradient_step,
            params,
        )
        should_skip = over_slices(should_skip, figures)
        skip_state = jax.tree.map(lambda x: over_slices(x, figures), skip_state)
        room = fits(state.acc_count, n)
        valid_count = count_ok & room
        # A window whose total cannot take this count is full: it closes on
        # this microbatch (which is dropped and counted as an invalid count),
        # or a token budget it cannot reach would hold it open for ever.
        full = count_ok & ~room
        # A microbatch without tokens always counts toward its window: the skip
        # function's verdict on its meaningless (often 0/0) gradient is ignored,
        # and its state kept.
        empty = valid_count & (n == 0)
        counted = valid_count & (empty | ~should_skip)
        if _checks.same_avals(skip_state, state.skip_state, dtypes=False):
            # `init` built the skip state from the params, whose dtypes the
            # gradients need not share (optax.skip_large_updates' norm): it
            # keeps the dtypes it was built with (a no-op where they agree).
            skip_state = _inner.cast_like(skip_state, state.skip_state)
        if not _checks.same_avals(skip_state, state.skip_state):
            raise ValueError(
                "`state.skip_state` is not what `should_skip_update_fn` returns: "
                "`state` was built by a MaskedMultiSteps with another skip "
                f"function than this one, {self!r}; use the state that this "
                "wrapper's `init` returned"
            )
        skip_state = jax.tree.map(
            lambda new, old: jnp.where(empty, old, new), skip_state, state.skip_state
        )
        n = jnp.where(counted, n, jnp.zeros_like(n))
        return _Gate(n, local_counts, counted, valid_count, full, skip_state)

    def _accumulate(self, state, grads, gate: _Gate, value) -> _Window:
        """Folds the microbatch (``gate.n`` tokens) into the window's running
        means of the gradients and of ``value``, and into its statistics."""
        acc_value, value_count, reduction_state = self._reduction.accumulate_value(
            state.acc_value,
            state.value_count,
            state.reduction_state,
            value,
            gate.n,
            gate.local_counts,
        )
        for_norms = grads
        if self._recorder.enabled:
            # The running mean reads the gradients in its precision (at least
            # float32); the squared norms the same values, converted apart
            # (no float32 copy written between the two), whose derivatives
            # meet the running mean's in float32 before they are rounded.
            narrow = _sq_norms.materialized_on_gpu(grads)
            grads = _sq_norms.in_compute_precision(narrow)
            for_norms = _sq_norms.for_squared_norms(grads, narrow)
        acc_grads, acc_count, reduction_state = self._reduction.accumulate(
            state.acc_grads,
            state.acc_count,
            reduction_state,
            grads,
            gate.n,
            gate.local_counts,
        )
        stats = state.stats
        if not self._reduction.keeps_stats:
            stats = self._recorder.accumulate(
                stats, for_norms, gate.n, gate.local_counts, (state.acc_count, value)
            )
        return _Window(
            acc_grads, acc_count, acc_value, value_count, reduction_state, stats
        )

    def _close_now(
        self, state, gate, microbatches, acc_grads, acc_count, stats, forced
    ) -> tuple[jax.Array, Any, jax.Array | None]:
        """Asks the window policy whether the window closes on this microbatch.

        Only a counted microbatch can close a window, or one whose count the
        window's total cannot take (the window is full), or ``forced``
        (``close_window=``; ``None`` where it is statically false); the policy
        sees the window as it is with this microbatch folded in
        (``microbatches``; for the norm test, the window statistics so far).
        Returns ``(closes, policy_state, forced_only)``, ``forced_only``
        (``None`` without ``forced``) where ``close_window=`` alone closes it.
        """
        scalars = _windows.WindowScalars(
            microbatches=microbatches,
            tokens=acc_count,
            gradient_step=state.gradient_step,
        )
        if self._policy.needs_stats:
            counted, sq_norm, var_trace = self._recorder.so_far(
                stats, acc_count, acc_grads
            )
            scalars = scalars._replace(
                counted=counted, grad_sq_norm=sq_norm, grad_var_trace=var_trace
            )
        verdict = _windows.verdict(self._policy, state.policy_state, scalars)
        closes = (gate.counted & verdict) | gate.full
        # A microbatch that does not count leaves the policy state as it was,
        # unless it closes a full window or `close_window=` closes it.
        keep = gate.counted | gate.full
        forced_only = None
        closed = closes  # as the policy is told
        if forced is not None:
            forced_only = forced & ~closes
            # The policy is told of the flag's close where the window holds
            # tokens: one that the flag alone closes without them is dropped.
            # (`acc_count` is the window's global total; where a deferred
            # reduction forms it only at the window's end, the rule is k
            # microbatches, which keeps no state.)
            told = forced & (acc_count > 0)
            closed = closes | told
            keep = keep | told
            closes = closes | forced
        policy_state = jax.tree.map(
            lambda new, old: jnp.where(keep, new, old),
            _windows.updated(self._policy, state.policy_state, scalars, closed),
            state.policy_state,
        )
        return closes, policy_state, forced_only

    def _step(self, grads, state, params, count, close, extra_args, *, apply_params):
        """Shared body of :meth:`update` and :meth:`apply_gradients`.

        Accumulates outside the window's conditional (one fused pass over the
        gradients); what changes only when a window closes sits inside it: the
        inner optimizer (and, with ``apply_params``, the params' update), the
        window's statistics, and the counters a close resets or advances.
        Returns ``(updates, state)``, or with ``apply_params``
        ``(new_params, state)``.
        """
        _checks.check_extra_args(
            extra_args, count, lambda key: _inner.takes_keyword(self._opt, key)
        )
        forced = _checks.close_flag(close)  # `close_window=`
        _checks.refuse_other_devices(
            # (Another kind of state is named below.)
            _placed_leaves(state),
            {"count": count, "value": extra_args.get("value"), "close_window": close},
            grads,
        )
        state = scalars_as_arrays(state, self._count_dtype)
        check_state(
            state,
            params,
            grads,
            owner=self,
            settings_layout=self._settings_layout,
            stats_dtypes=self._stats_dtypes,
            count_dtype=self._count_dtype,
            accumulator_dtype=self._accumulator_dtype,
        )
        if params is not None:
            _checks.refuse_state_as_params(params)
        self._reduction.check_grads(grads, state.acc_grads)
        check_on_mesh(grads, state.acc_grads)
        grads = self._reduction.place_inputs(grads, state.acc_grads)
        if apply_params or params is not None:
            # (`update` takes None for an inner optimizer that reads no params.)
            _checks.check_params_match(
                params, state.acc_grads, self._reduction.device_axes
            )
        check_reduced(grads, state.acc_grads, params)
        with_grad, raw_value, static_args, dynamic_args = _inner.split_extra_args(
            extra_args
        )

        with jax.named_scope("masked_multistep/accumulate"):
            gate = self._gate(grads, state, params, count, raw_value)
            value = self._reduction.value(raw_value, gate.local_counts, gate.n)
            window = self._accumulate(state, grads, gate, value)
            # The window's microbatches, this one included if it counts (one
            # that closes a full window is not one of its own).
            mini_step = jnp.where(
                gate.counted, optax.safe_increment(state.mini_step), state.mini_step
            ).astype(jnp.int32)
            window_done, policy_state, forced_only = self._close_now(
                state,
                gate,
                mini_step,
                window.acc_grads,
                window.acc_count,
                window.stats,
                forced,
            )

        # The window's loss in the dtype of the microbatches' (floating: the
        # reduction's `value` refuses integer arrays and reads host ints as
        # floats).
        value_dtype = jnp.float32 if value is None else value.dtype
        so_far = WindowTotals(
            window.acc_count,
            window.acc_value,
            window.value_count,
            num_invalid=jnp.zeros([], jnp.int32),
        )
        # The value as far as the inner optimizer's shapes go (the window's
        # end passes the window's own, `_close.window_value`).
        dynamic_args["value"] = so_far.value.astype(value_dtype)
        read_only_params = () if apply_params else params

        def mean_of(w: _Window) -> Any:
            return _close.window_mean(
                self._reduction, w.acc_grads, w.acc_count, w.reduction_state, params
            )

        # (It refuses an inner state of another optimizer's structure first.)
        plan = _inner.window_shapes(
            self._opt,
            self._eager_shapes,
            self._inner_structures,
            mean_of,
            window,
            grads,
            static_args,
            state.inner_opt_state,
            params,
            dynamic_args,
            has_value=value is not None,
            with_grad=with_grad,
        )
        if plan.needs_value and value is None:
            _inner.warn_without_value()
        # Once the inner optimizer has read the window's mean, the mean is dead
        # (`acc_count` resets; the next counted microbatch overwrites it). So in
        # `update` the updates take the accumulator's buffer when they fit it,
        # and between windows it passes through; `update` then returns
        # `where(updated, acc, 0)`, which XLA fuses into the caller's
        # `optax.apply_updates`, instead of a separate param-sized output filled
        # with zeros on every microbatch (a temporary as large as the params,
        # page-faulted afresh on every call on CPU). `apply_gradients` needs no
        # such output: it adds the updates to the params inside the conditional,
        # and between windows the params pass through untouched.
        reuse_acc = not apply_params and _checks.same_avals(
            plan.updates_avals, window.acc_grads
        )
        window_close = _close.WindowClose(
            reduction=self._reduction,
            recorder=self._recorder,
            plan=plan,
            reuse_acc=reuse_acc,
            apply_params=apply_params,
            value_dtype=value_dtype,
            forced_only=forced_only,
            grads=grads,
        )

        with jax.named_scope("masked_multistep/inner_update"):
            # The window's state, updated where it closes: in place, its
            # scalars too (which a GPU would otherwise copy in and out of the
            # window's loop, or select between, on every microbatch).
            counters = _close.Counters(
                mini_step=mini_step,
                gradient_step=state.gradient_step,
                num_invalid_counts=_close.add_counts(
                    state.num_invalid_counts, jnp.where(gate.valid_count, 0, 1)
                ),
                num_nonfinite_windows=state.num_nonfinite_windows,
                # Where the window stays open, False (no update runs); where
                # it closes, `WindowClose.close` sets whether the inner update ran.
                updated=window_done,
            )
            carry, out = in_place_cond(
                window_done,
                window_close.close,
                window_close.keep,
                _close.Carry(
                    # What the taken branch updates in place, and the other
                    # passes through.
                    in_place=(
                        window.acc_grads,
                        state.inner_opt_state,
                        params if apply_params else (),
                    ),
                    stats=window.stats,
                    so_far=so_far,
                    counters=counters,
                    reduction_state=window.reduction_state,
                ),
                read_only_params,
                dynamic_args,
            )
            acc_grads, inner_opt_state, new_params = carry.in_place
            out: Any = new_params if apply_params else out
            if reuse_acc:
                out = jax.tree.map(
                    lambda u: jnp.where(carry.counters.updated, u, jnp.zeros_like(u)),
                    acc_grads,
                )

        return out, state._replace(
            **carry.counters._asdict(),
            inner_opt_state=inner_opt_state,
            acc_grads=acc_grads,
            acc_count=carry.so_far.tokens,
            acc_value=carry.so_far.value,
            value_count=carry.so_far.value_count,
            skip_state=gate.skip_state,
            stats=carry.stats,
            policy_state=policy_state,
            reduction_state=carry.reduction_state,
        )


def _refuse_positional_count(method: str, args: tuple[Any, ...]) -> None:
    """A ``TypeError`` for arguments after ``params``: the count goes by
    keyword (by position it would be taken for an inner optimizer's
    argument, or lost)."""
    if args:
        raise TypeError(
            f"MaskedMultiSteps.{method} takes the token count as a keyword: "
            f"tx.{method}(grads, state, params, count=n); got {len(args)} "
            "more positional argument(s)"
        )


# A NamedTuple is a pytree that jax rebuilds as ``type(tx)(init, update)``,
# which is not this constructor's signature: `jax.tree.map` over a wrapper (or
# over a config or an equinox module that holds one) would fail. Flattened, the
# wrapper is its two functions, as an optax transformation is; rebuilt from the
# same two it is itself again, and from others (mapped, or replaced by a filter)
# the plain (init, update) pair they make.
def _flatten(tx: MaskedMultiSteps) -> tuple[tuple[Any, Any], MaskedMultiSteps]:
    return (tx.init, tx.update), tx


def _unflatten(tx: MaskedMultiSteps, children: Any) -> Any:
    init, update = children
    if init is tx.init and update is tx.update:
        return tx
    return optax.GradientTransformationExtraArgs(init, update)


jax.tree_util.register_pytree_node(MaskedMultiSteps, _flatten, _unflatten)


def _refuse_nested_accumulation(inner_opt_state: Any) -> None:
    """Refuses an accumulator anywhere in the inner optimizer (bare or in a
    chain): the outer wrapper would hand it each window's mean as one
    microbatch, and it would weigh the windows equally."""
    found = states_in(
        inner_opt_state,
        (MaskedMultiStepsState, optax.MultiStepsState, optax.ApplyEvery),
    )
    if found:
        raise TypeError(
            "`opt` must be the optimizer to run once per window, but it holds "
            f"an accumulator ({type(found[0]).__name__}): accumulating inside "
            "an accumulator weighs its windows equally. Use one MaskedMultiSteps "
            "with the whole window (every_k_schedule=k_outer * k_inner); to "
            "replace an optax.MultiSteps `old`, wrap the optimizer inside it, "
            "`mm.MaskedMultiSteps(old.inner_opt, k)`"
        )


def _recorder_for(
    policy: _windows.WindowPolicy,
    reduction: Deferred | None,
    window_stats: Any,
    stats_decay: Any,
    per_leaf_stats: Any = False,
) -> _stats.Recorder:
    """The window statistics' recorder for these settings: on with
    ``window_stats`` or ``per_leaf_stats``, and for a policy that reads them
    (the norm test, which the deferred reduction cannot serve)."""
    recorder = _stats.recorder(window_stats, stats_decay, per_leaf_stats)
    if policy.needs_stats:
        if reduction is not None:
            raise ValueError(
                "The norm test reads the window's mean gradient after every "
                "microbatch; with reduction=mm.deferred(...) that mean exists "
                "only at the window's end (forming it on every microbatch is "
                "the gradient-sized reduction the deferred mode saves). Use "
                "reduction=None with `norm_test`."
            )
        # The norm test decides on the window statistics' running figures.
        recorder = recorder._replace(enabled=True)
    # Compared in float32, the moving averages' precision: np.float32(0.9) is
    # the default too.
    if not recorder.enabled and np.float32(recorder.decay) != np.float32(
        _DEFAULT_STATS_DECAY
    ):
        raise ValueError(
            f"`stats_decay` ({stats_decay!r}) smooths the window statistics, "
            "which are off: pass window_stats=True as well (or drop "
            "`stats_decay`)"
        )
    return recorder


def _counts_needed_only_at_close(
    every_k_schedule: Any,
    tokens_per_window: Any,
    norm_test: Any,
    should_skip_update_fn: Any,
) -> bool:
    """Whether no rule needs a microbatch's global count before its window
    closes: a window of ``k`` microbatches and no skip function. (The window
    statistics do not: their per-device shares wait for the window's end.)"""
    return (
        every_k_schedule is not None
        and tokens_per_window is None
        and norm_test is None
        and should_skip_update_fn is None
    )
