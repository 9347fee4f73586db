"""`MaskedMultiSteps`: token-weighted gradient accumulation for optax."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree as otu

from masked_multistep._running_mean import running_mean_update, scalar_count
from masked_multistep._stats import (
    accumulate_window_stats,
    close_window_stats,
    init_window_stats,
    tree_sq_norm,
)

__all__ = ["MaskedMultiSteps", "MaskedMultiStepsState"]

_INT32_MAX = np.iinfo(np.int32).max


class MaskedMultiStepsState(NamedTuple):
    """State of :class:`MaskedMultiSteps`.

    Field names follow ``optax.MultiStepsState``; the token-weighting adds
    ``acc_count`` and ``acc_value``, and ``updated`` and ``num_invalid_counts``
    make what happened observable.

    Attributes:
      mini_step: microbatches seen in the current window (skipped ones excluded).
      gradient_step: inner optimizer updates applied so far.
      inner_opt_state: the state of the wrapped optimizer.
      acc_grads: running token-weighted mean of the window's gradients, in
        ``accumulator_dtype``. Meaningful where ``acc_count > 0``; the next counted
        microbatch after a window ends overwrites it. After :meth:`update`
        applied an inner update it holds that update's values, when they have the
        accumulator's dtypes (the update reuses its buffer).
      acc_count: sum of the window's counts (``count_dtype``).
      acc_value: running token-weighted mean of the window's ``value`` arguments
        (float32; 0 when no ``value`` is passed).
      updated: whether the last ``update`` applied an inner update.
      num_invalid_counts: microbatches rejected under ``jit`` because their count
        was negative, non-finite or overflowed the window's total.
      skip_state: what ``should_skip_update_fn`` returned last (``()`` without one).
      stats: with ``window_stats=True``, a ``WindowStatsState``: the current
        window's running statistics and the last completed window's
        :class:`WindowStats` (read them with :func:`window_stats`); ``()``
        otherwise.
    """

    mini_step: jax.Array
    gradient_step: jax.Array
    inner_opt_state: Any
    acc_grads: Any
    acc_count: jax.Array
    acc_value: jax.Array
    updated: jax.Array
    num_invalid_counts: jax.Array
    skip_state: Any = ()
    stats: Any = ()


def _no_skip(updates, gradient_step, params):
    del updates, gradient_step, params
    return jnp.zeros([], jnp.bool_), ()


def _canonical_schedule(every_k_schedule) -> Callable[[jax.Array], jax.Array]:
    if callable(every_k_schedule):
        # Total arithmetic under jit: a schedule returning k < 1 means k = 1.
        return lambda step: jnp.maximum(jnp.asarray(every_k_schedule(step)), 1)
    k = every_k_schedule
    if isinstance(k, (jax.Array, np.ndarray, np.generic)) and np.ndim(k) == 0:
        if not jnp.issubdtype(k.dtype, jnp.integer):
            raise TypeError(
                f"`every_k_schedule` must be an integer or a callable, got {k!r}"
            )
        k = int(k)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(
            "`every_k_schedule` must be an integer or a callable of the gradient "
            f"step, got {every_k_schedule!r} of type {type(every_k_schedule).__name__}"
        )
    if k < 1:
        raise ValueError(f"`every_k_schedule` must be >= 1, got {k}")
    k = int(k)
    return lambda step: jnp.asarray(k, jnp.int32)


def _same_avals(a: Any, b: Any) -> bool:
    """Whether two pytrees have the same structure, and leaves the same avals."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(
        (jnp.shape(x), jnp.result_type(x)) == (jnp.shape(y), jnp.result_type(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _check_trees(grads: Any, acc_grads: Any) -> None:
    g_def, a_def = jax.tree.structure(grads), jax.tree.structure(acc_grads)
    if g_def != a_def:
        raise ValueError(
            "The gradients' tree structure does not match the state's: got "
            f"{g_def}, expected {a_def} (the structure of the params passed to init)"
        )
    for path, g, a in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0],
        jax.tree.leaves(grads),
        jax.tree.leaves(acc_grads),
        strict=True,
    ):
        if jnp.shape(g) != jnp.shape(a):
            raise ValueError(
                f"The gradient at {jax.tree_util.keystr(path[0])} has shape "
                f"{jnp.shape(g)}, but the state expects {jnp.shape(a)}"
            )


class MaskedMultiSteps:
    """Accumulates microbatch gradients weighted by token count, then updates.

    Each call of :meth:`update` takes one microbatch's *mean* gradient ``gᵢ`` and
    its number of real (unmasked) tokens ``nᵢ``. After ``k`` microbatches (a
    *window*) the inner optimizer is called once, with the gradient of the full
    batch's token-mean loss::

        mean = Σ nᵢ gᵢ / Σ nᵢ

    kept as a running mean (``N ← N + n;  m ← m + (g − m)·n/N``, West 1979), so no
    sum is formed and nothing overflows in low precision. ``optax.MultiSteps``
    instead averages the ``gᵢ`` with equal weight, which over-weights short
    microbatches. With all counts equal the two agree.

    Semantics:
      * Between windows the returned updates are zeros (structure and dtype of the
        inner optimizer's updates); the inner optimizer runs only at the end of a
        window, so its state, step count, schedules and weight decay advance once
        per window.
      * ``count == 0`` adds nothing, even if the gradient is NaN (an all-masked
        microbatch gives 0/0); ``mini_step`` advances.
      * A window whose counts are all zero applies no update: zeros are returned,
        the inner state and ``gradient_step`` are unchanged.
      * A microbatch that ``should_skip_update_fn`` rejects is as if it never
        happened (as in optax).
      * Under ``jit``, a negative, non-finite or overflowing count is treated as a
        skipped microbatch and counted in ``state.num_invalid_counts``. Concrete
        bad counts raise ``ValueError``.
      * A non-finite gradient with a positive count spoils its window's update,
        as it would for the plain optimizer; the next window starts clean.
      * ``value=`` (the microbatch's mean loss), if passed, is averaged with the
        same weights and handed to the inner optimizer as ``value=`` at the end of
        the window; other extra arguments go to the inner optimizer unchanged.

    Pass ``count`` as a ``jax.Array`` (e.g. from :func:`masked_mean`) to a jitted
    step: a Python int is a different type to ``jit`` and costs a retrace.

    Args:
      opt: the inner optimizer (``optax.GradientTransformation``).
      every_k_schedule: microbatches per window: an int, or a callable of
        ``gradient_step`` returning one (values below 1 count as 1).
      should_skip_update_fn: optional optax ``ShouldSkipUpdateFunction``, e.g.
        ``optax.skip_not_finite``.
      accumulator_dtype: dtype of the running mean ``acc_grads`` (float32).
      count_dtype: dtype of the window's token total. ``int32`` (default) sums
        integer counts exactly up to 2³¹−1 per window; use a float dtype to pass
        fractional weights.
      window_stats: keep each window's statistics (tokens, loss, gradient norm,
        gradient noise scale) in ``state.stats``; read them with
        :func:`window_stats`. They never change the updates, and cost one
        squared-norm reduction of each microbatch's gradient plus one of each
        window's mean: 1.05-1.17x the time of an optimizer-dominated step with
        :meth:`apply_gradients` on CPU, no extra scratch memory. With
        :meth:`update`, reading the mean keeps XLA from reusing the
        accumulator's buffer for the inner update: that step then needs scratch
        memory like the parameters and about twice the time.
      stats_decay: per-window decay of the moving averages behind
        ``WindowStats.smoothed_noise_scale``, in ``[0, 1)``.

    Raises:
      TypeError: if ``every_k_schedule`` is neither an integer nor callable.
      ValueError: if ``every_k_schedule < 1``, a dtype is not of the right kind,
        or ``stats_decay`` is outside ``[0, 1)``.

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

    References:
      D. H. D. West, "Updating mean and variance estimates: an improved method",
      Communications of the ACM 22(9), 1979.
    """

    def __init__(
        self,
        opt: optax.GradientTransformation,
        every_k_schedule: int | Callable[[jax.Array], jax.typing.ArrayLike],
        *,
        should_skip_update_fn: optax.ShouldSkipUpdateFunction | None = None,
        accumulator_dtype: jax.typing.DTypeLike = jnp.float32,
        count_dtype: jax.typing.DTypeLike = jnp.int32,
        window_stats: bool = False,
        stats_decay: float = 0.9,
    ):
        if not (hasattr(opt, "init") and hasattr(opt, "update")):
            raise TypeError(
                "`opt` must be an optax GradientTransformation, got "
                f"{type(opt).__name__}"
            )
        self._opt = optax.with_extra_args_support(opt)
        self._every_k_schedule = _canonical_schedule(every_k_schedule)
        self._should_skip_update_fn = should_skip_update_fn or _no_skip
        self._accumulator_dtype = jnp.dtype(accumulator_dtype)
        if not jnp.issubdtype(self._accumulator_dtype, jnp.floating):
            raise ValueError(
                "`accumulator_dtype` must be a floating dtype, got "
                f"{self._accumulator_dtype}"
            )
        self._count_dtype = jnp.dtype(count_dtype)
        if not (
            self._count_dtype == jnp.int32
            or jnp.issubdtype(self._count_dtype, jnp.floating)
        ):
            raise ValueError(
                f"`count_dtype` must be int32 or a floating dtype, got {count_dtype}"
            )
        if not isinstance(window_stats, bool):
            raise TypeError(
                f"`window_stats` must be a bool, got {type(window_stats).__name__}"
            )
        self._window_stats = window_stats
        if not (
            isinstance(stats_decay, numbers.Real)
            and not isinstance(stats_decay, bool)
            and 0 <= stats_decay < 1
        ):
            raise ValueError(f"`stats_decay` must be in [0, 1), got {stats_decay!r}")
        self._stats_decay = float(stats_decay)

    @property
    def inner_opt(self) -> optax.GradientTransformationExtraArgs:
        """The wrapped optimizer."""
        return self._opt

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        """This wrapper as an ``optax.GradientTransformationExtraArgs``.

        Use it inside ``optax.chain``: ``count=`` then travels as an extra argument.

        Examples:
          >>> import jax.numpy as jnp, optax
          >>> import masked_multistep as mm
          >>> tx = optax.chain(
          ...     mm.MaskedMultiSteps(optax.sgd(0.1), 2).gradient_transformation())
          >>> state = tx.init(jnp.zeros(2))
          >>> updates, state = tx.update(jnp.ones(2), state, count=jnp.array(3))
        """
        return optax.GradientTransformationExtraArgs(self.init, self.update)

    def init(self, params: optax.Params) -> MaskedMultiStepsState:
        """The initial state for ``params``."""
        gradient_step = jnp.zeros([], jnp.int32)
        _, skip_state = self._should_skip_update_fn(
            otu.zeros_like(params), gradient_step, params
        )
        return MaskedMultiStepsState(
            mini_step=jnp.zeros([], jnp.int32),
            gradient_step=gradient_step,
            inner_opt_state=self._opt.init(params),
            acc_grads=otu.zeros_like(params, dtype=self._accumulator_dtype),
            acc_count=jnp.zeros([], self._count_dtype),
            acc_value=jnp.zeros([], jnp.float32),
            updated=jnp.zeros([], jnp.bool_),
            num_invalid_counts=jnp.zeros([], jnp.int32),
            skip_state=skip_state,
            stats=init_window_stats(self._count_dtype) if self._window_stats else (),
        )

    def has_updated(self, state: MaskedMultiStepsState) -> jax.Array:
        """True exactly when the last :meth:`update` applied an inner update."""
        return jnp.asarray(state.updated)

    def update(
        self,
        updates: optax.Updates,
        state: MaskedMultiStepsState,
        params: optax.Params | None = None,
        *,
        count: jax.typing.ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, MaskedMultiStepsState]:
        """Folds in one microbatch; at the window's end, runs the inner optimizer.

        Args:
          updates: the microbatch's *mean* gradient (a pytree like the params).
          state: the current state.
          params: the current params, passed to the inner optimizer.
          count: the number of real tokens behind ``updates`` (or any non-negative
            weight), a scalar. Required.
          **extra_args: ``value=`` (the microbatch's mean loss) is token-averaged
            over the window; everything else goes to the inner optimizer at the end
            of the window.

        Returns:
          ``(updates, new_state)``: the inner optimizer's updates at the end of a
          window that saw tokens, zeros of the same structure and dtype otherwise.

        Raises:
          TypeError: if ``count`` is missing.
          ValueError: if ``count`` is not a numeric scalar, or is concretely
            negative or NaN; if the gradients do not match the state's tree.
        """
        return self._step(updates, state, params, count, extra_args, apply_params=False)

    def apply_gradients(
        self,
        grads: optax.Updates,
        state: MaskedMultiStepsState,
        params: optax.Params,
        *,
        count: jax.typing.ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Params, MaskedMultiStepsState]:
        """:meth:`update` followed by ``optax.apply_updates``, fused.

        Returns the new params directly. Between windows the params pass through
        untouched instead of receiving a tree of zeros, which saves a pass over
        them on every microbatch that does not end a window.

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
        return self._step(grads, state, params, count, extra_args, apply_params=True)

    def _check_count(self, count: Any) -> tuple[jax.Array, jax.Array]:
        """The count in ``count_dtype`` and whether it may be accumulated."""
        if count is None:
            raise TypeError(
                "MaskedMultiSteps.update needs the microbatch's token count: call "
                "`tx.update(grads, state, params, count=n)` (inside optax.chain, "
                "pass `count=n` to the chain's update)."
            )
        if not hasattr(count, "dtype"):
            if not isinstance(count, numbers.Real) or isinstance(count, bool):
                raise ValueError(
                    "`count` must be a numeric scalar, got "
                    f"{count!r} of type {type(count).__name__}"
                )
            if isinstance(count, numbers.Integral):
                # Range-check before narrowing; other values are checked below.
                self._check_concrete_count(count, True)
                count = np.int32(count)
        arr = scalar_count(count)
        is_int = jnp.issubdtype(arr.dtype, jnp.integer)
        if not is_int and not jnp.issubdtype(self._count_dtype, jnp.floating):
            raise ValueError(
                f"`count` has dtype {arr.dtype}, but this MaskedMultiSteps sums counts "
                f"in {self._count_dtype}: pass integer token counts, or construct it "
                "with count_dtype=jnp.float32 for fractional weights."
            )
        if not isinstance(arr, jax.core.Tracer):
            self._check_concrete_count(arr.item(), is_int)
        if is_int and arr.dtype.itemsize > 4:
            # Without x64 this never happens; with it, clip before narrowing.
            arr = jnp.clip(arr, -1, _INT32_MAX)
        n = arr.astype(self._count_dtype)
        ok = jnp.isfinite(n) & (n >= 0) if not is_int else (n >= 0)
        return n, ok

    @staticmethod
    def _check_concrete_count(value: float, is_int: bool) -> None:
        if not np.isfinite(value) or value < 0:
            raise ValueError(
                f"`count` must be a finite non-negative number, got {value}"
            )
        if is_int and value > _INT32_MAX:
            raise ValueError(f"`count` must be < 2**31, got {value}")

    def _step(self, grads, state, params, count, extra_args, *, apply_params):
        """Shared body of :meth:`update` and :meth:`apply_gradients`.

        Accumulates outside the conditional (one fused pass over the gradients);
        only the inner optimizer (and, with ``apply_params``, the params' update)
        sits inside it. Returns ``(updates, state)``, or with ``apply_params``
        ``(new_params, state)``.
        """
        n, count_ok = self._check_count(count)
        _check_trees(grads, state.acc_grads)
        value = extra_args.pop("value", None)

        with jax.named_scope("masked_multistep/accumulate"):
            should_skip, skip_state = self._should_skip_update_fn(
                grads, state.gradient_step, params
            )
            should_skip = jnp.asarray(should_skip)
            if (should_skip.dtype, should_skip.shape) != (jnp.bool_, ()):
                raise ValueError(
                    "`should_skip_update_fn` must return a boolean scalar, got dtype "
                    f"{should_skip.dtype} and shape {should_skip.shape}"
                )
            if jnp.issubdtype(self._count_dtype, jnp.integer):
                fits = n <= _INT32_MAX - state.acc_count
            else:
                fits = jnp.isfinite(state.acc_count + n)
            valid_count = count_ok & fits
            accepted = valid_count & ~should_skip
            n = jnp.where(accepted, n, jnp.zeros_like(n))

            stats = state.stats
            if self._window_stats:
                stats = accumulate_window_stats(stats, grads, n)
            acc_grads, acc_count = running_mean_update(
                state.acc_grads, state.acc_count, grads, n
            )
            acc_value = state.acc_value
            if value is not None:
                acc_value, _ = running_mean_update(
                    state.acc_value, state.acc_count, jnp.asarray(value), n
                )

            k = self._every_k_schedule(state.gradient_step)
            window_done = accepted & (state.mini_step + 1 >= k)
            apply = window_done & (acc_count > 0)

        static_args = {
            key: v for key, v in extra_args.items() if not isinstance(v, jax.Array)
        }
        dynamic_args = {
            key: v for key, v in extra_args.items() if isinstance(v, jax.Array)
        }
        if value is not None:
            dynamic_args["value"] = acc_value.astype(jnp.asarray(value).dtype)

        def inner_update(acc_grads, inner_state, params, dynamic_args):
            mean_grads = otu.cast_like(acc_grads, grads)
            updates, new_inner = self._opt.update(
                mean_grads, inner_state, params, **static_args, **dynamic_args
            )
            # The inner state keeps its dtypes (as in optax.MultiSteps).
            return updates, otu.cast_like(new_inner, inner_state)

        operands = (acc_grads, state.inner_opt_state, params, dynamic_args)
        updates_avals, _ = jax.eval_shape(inner_update, *operands)
        # Once the inner optimizer has read the window's mean, the mean is dead
        # (`acc_count` resets; the next counted microbatch overwrites it). So in
        # `update` the updates take the accumulator's buffer when they fit it,
        # and between windows it passes through; `update` then returns
        # `where(apply, acc, 0)`, which XLA fuses into the caller's
        # `optax.apply_updates`, instead of a separate param-sized output filled
        # with zeros on every microbatch (a temporary as large as the params,
        # page-faulted afresh on every call on CPU). `apply_gradients` needs no
        # such output: it adds the updates to the params inside the conditional,
        # and between windows the params pass through untouched.
        reuse_acc = not apply_params and _same_avals(updates_avals, acc_grads)

        def apply_branch(acc_grads, inner_state, params, dynamic_args):
            g2 = ()
            if self._window_stats:
                # ‖ḡ‖² for the statistics, read from the mean before the inner
                # optimizer does; once per window. The barrier orders the two
                # reads: without it XLA keeps copies of the accumulator.
                g2 = tree_sq_norm(acc_grads).astype(jnp.float32)
                g2, acc_grads = jax.lax.optimization_barrier((g2, acc_grads))
            updates, new_inner = inner_update(
                acc_grads, inner_state, params, dynamic_args
            )
            if reuse_acc:
                return (), updates, new_inner, g2
            out = optax.apply_updates(params, updates) if apply_params else updates
            return out, acc_grads, new_inner, g2

        def skip_branch(acc_grads, inner_state, params, dynamic_args):
            del dynamic_args
            g2 = jnp.full([], jnp.nan, jnp.float32) if self._window_stats else ()
            if reuse_acc:
                return (), acc_grads, inner_state, g2
            out = params if apply_params else otu.zeros_like(updates_avals)
            return out, acc_grads, inner_state, g2

        with jax.named_scope("masked_multistep/inner_update"):
            out, acc_grads, inner_opt_state, grad_sq_norm = jax.lax.cond(
                apply, apply_branch, skip_branch, *operands
            )
            if reuse_acc:
                out = jax.tree.map(
                    lambda u: jnp.where(apply, u, jnp.zeros_like(u)), acc_grads
                )

        if self._window_stats:
            stats = close_window_stats(
                stats,
                window_done,
                tokens=acc_count,
                grad_sq_norm=grad_sq_norm,
                loss=acc_value if value is not None else jnp.float32(jnp.nan),
                decay=self._stats_decay,
            )

        zero = jnp.zeros([], jnp.int32)
        new_state = MaskedMultiStepsState(
            mini_step=jnp.where(
                window_done,
                zero,
                jnp.where(accepted, state.mini_step + 1, state.mini_step),
            ).astype(jnp.int32),
            gradient_step=jnp.where(
                apply, optax.safe_increment(state.gradient_step), state.gradient_step
            ),
            inner_opt_state=inner_opt_state,
            acc_grads=acc_grads,
            acc_count=jnp.where(window_done, jnp.zeros_like(acc_count), acc_count),
            acc_value=jnp.where(window_done, jnp.zeros_like(acc_value), acc_value),
            updated=apply,
            num_invalid_counts=jnp.where(
                valid_count,
                state.num_invalid_counts,
                optax.safe_increment(state.num_invalid_counts),
            ),
            skip_state=skip_state,
            stats=stats,
        )
        return out, new_state
