"""Window statistics: tokens, loss, gradient norm and gradient noise scale.

Microbatch ``i`` of a window has ``nᵢ`` tokens and mean gradient ``gᵢ``;
``N = Σ nᵢ``, ``ḡ = Σ nᵢ gᵢ / N`` (the window's mean, what the inner optimizer
sees) and ``K`` is the number of microbatches with ``nᵢ > 0``. If the ``gᵢ`` are
independent with ``E gᵢ = G`` and ``Cov gᵢ = Σ / nᵢ`` (tokens as independent
samples with per-token covariance ``Σ``), the weighted spread

    S = Σ nᵢ ‖gᵢ − ḡ‖² = Σ nᵢ ‖gᵢ‖² − N ‖ḡ‖²

has ``E S = (K − 1) tr Σ``, and ``E ‖ḡ‖² = |G|² + tr Σ / N``. Hence the unbiased
estimators of ``tr Σ`` and ``|G|²``, and their ratio

    tr Σ̂  = S / (K − 1)                (per-token gradient variance)
    |G|²̂ = ‖ḡ‖² − tr Σ̂ / N            (squared norm of the true gradient)
    B_simple = tr Σ̂ / |G|²̂            (the "simple" noise scale, in tokens)

of McCandlish et al. (2018) (a ratio of unbiased estimates is not itself
unbiased: average its numerator and denominator, not per-window values). With
equal ``nᵢ = n`` they are exactly their two-batch estimators with
``B_small = n``, ``B_big = N`` and ``|G_small|²`` the mean of the ``‖gᵢ‖²``.
``B_simple`` approximates McCandlish's ``B_noise`` (a Hessian proportional to
the identity) which tracks the critical batch size empirically, up to a
task-dependent factor: a guide to its order of magnitude.

The accumulation needs one scalar per microbatch, ``nᵢ ‖gᵢ‖²``, summed over the
window (``weighted_sq_norms``), and ``‖ḡ‖²`` once per window. ``S`` is formed as
``Σ nᵢ ‖gᵢ‖² − N ‖ḡ‖²`` rather than by West's update of ``Σ nᵢ ‖gᵢ − m‖²``
(available as ``running_mean_update(..., with_sq_deviation=True)``): XLA:CPU
fuses no reduction into the accumulation pass, so the reduction is a pass of its
own, and one over the gradient alone reads half the bytes of one over the
gradient and the mean. The price is cancellation:
the relative rounding error of ``S`` grows with ``N / B_simple``. Measured against
a float64 two-pass sum (8 microbatches, 1e5 parameters, float32 state, worst of
12 seeds): 3e-7 at ``N = 10·B_simple``, 2.5e-6 at ``100·B_simple``, 1.3e-5 at
``1000·B_simple`` (tested: one seed each, ≤ 1e-5), 1.4-1.8e-4 at
``10⁴·B_simple`` (two generators of test data), 2.5e-3 at ``10⁵·B_simple``
(median 8e-4): from about ``10³·B_simple`` on, at most about
``2.5e-8 · N / B_simple`` (below it, float32's floor of a few 1e-7 dominates;
three seeds each with ``K`` = 8 and 256 microbatches at ``10⁸·B_simple``:
0.07-0.56 and 0.01-0.13). Those figures are for large trees, whose rounding errors
partly cancel; with few parameters and few microbatches the error reaches about
``2.5e-7 · N / (B̂ · (K − 1))``, ``B̂ = S / ((K − 1) ‖ḡ‖²)`` the window's own
estimate, which scatters around the true ``B_simple`` (200 windows of ``K`` = 2
with 8 parameters at a true ``N / B_simple`` of ``2·10⁶``, two generators of
test data: median 8-10%, 95th percentile 47-56%, worst 102-111%). Very uneven
counts add to it: a microbatch of a few tokens beside ones of 2²⁸ moves the
float32 mean by less than its rounding, so ``ḡ`` leaves it out while
``Σ nᵢ ‖gᵢ‖²`` counts it (counts 3, 2²⁸+1, 2²⁸+1, 2²⁸+1 with 64 parameters at
``N / B_simple ≈ 100``: 1e-5 to 2e-4 over 10 seeds, against 8e-6 from the bound).
Compare it with the statistical noise of ``tr Σ̂`` from ``K`` microbatches:
under Gaussian noise its relative standard deviation is
``√(2 tr Σ² / (K − 1)) / tr Σ``, at most ``√(2 / (K − 1))`` (a rank-one ``Σ``)
and much less for a ``Σ`` of high effective rank (``√(2 / ((K − 1) r))``,
``r = (tr Σ)² / tr Σ²``). Rounding stays below it while roughly
``N / B_simple ≲ 10⁸ / √(K r)``: with a rank-one ``Σ`` for a window of up to
10⁶ tokens always, of up to 10⁸ unless ``B_simple`` is a few tens of tokens or
less; with a high-rank ``Σ``, rounding may reach the noise from about
``N / B_simple ≈ 10⁸ / √(K r)`` on: ``10⁶`` with 256 parameters and ``K = 7``
(measured: 0.7% median rounding error against 3.5% noise there, 7% against
3.5% at ``10⁷``), ``10⁵`` with an isotropic ``Σ`` over 1e5 parameters and
``K = 8`` (worst of 12 seeds 0.24% against 0.17% noise). (A
two-pass sum in float32, which needs the window's microbatches twice, stays near
1e-7 throughout.) Rounding can make ``S`` slightly negative when the
microbatches agree; it is clamped at 0, so a window far past that range can
report ``tr Σ̂ = 0`` and ``B_simple = 0``: read a ``B_simple`` of 0 there as
unresolved, not as a noiseless gradient.

The figures hold for a float32 mean, which the default accumulator is (at
least float32, also for bfloat16 gradients). ``‖ḡ‖²`` is read from the
accumulator, so with an explicit ``accumulator_dtype`` of bfloat16 or float16
``ḡ`` carries its rounding and the error of ``S`` is about a thousand times
float32's: measured (8 microbatches, 1e4 parameters, bfloat16) 0.8-3% at
``1000·B_simple``, and at ``10⁵·B_simple`` 20-24% in one set of
measurements, errors of order 100% in another (``S`` clamped to 0,
``B_simple`` reported as 0, once; 2.6 times too large once). The same
holds for :func:`data_parallel_value_and_grad`'s statistics with bfloat16
params (each device's mean is cast to the params' dtype before the devices
are combined).

The statistics are float32, for float64 leaves too (their squared norms are
cast to float32): a gradient whose squared norm exceeds float32's range
(elements beyond about 1e19) makes the window's ``grad_sq_norm`` infinite and
its estimates NaN, and ``nᵢ ‖gᵢ‖²`` beyond it (1e30 tokens of a gradient of
norm 1e5) its estimates NaN (``grad_sq_norm``, of the mean, stays finite);
its update is unaffected. At the other end, an element below
about 1e-19 squares to below float32's normal range, which XLA:CPU flushes to
zero: a gradient whose every element is that small reads as ``grad_sq_norm``
0 (``noise_scale`` NaN), and one where most are, as too small a variance.
Scale such a loss up (its statistics scale with its square; ``B_simple`` does
not change).

``B_simple`` from one window is very noisy; McCandlish et al. smooth the
numerator and the denominator separately with exponential moving averages. The
state keeps both (debiased like Adam's moments, over the windows whose
estimates are finite), and reports their ratio as ``smoothed_noise_scale``.

All updates here are total: a microbatch with ``n == 0`` leaves the state
bit-identical even when its gradient is NaN; undefined estimates are NaN. A
window with a non-finite gradient (which :class:`MaskedMultiSteps` does not hand
to its inner optimizer) still completes: its tokens, microbatches, loss and
``tokens_seen`` count, ``grad_sq_norm`` shows the non-finite ``‖ḡ‖²``, the
estimates are NaN and the moving averages skip it.

:class:`MaskedMultiSteps` calls this module through :func:`recorder` at three
points of its state machine: every microbatch (``n ‖g‖²``), the window's mean
before the inner optimizer reads it (``‖ḡ‖²``), and the window's close; and,
for the norm test, on every microbatch the window's figures so far. The
squared norms themselves, and the views of a gradient they read, are
``_sq_norms``'.

References:
  S. McCandlish, J. Kaplan, D. Amodei and the OpenAI Dota Team, "An Empirical
  Model of Large-Batch Training", arXiv:1812.06162, 2018 (Appendix A).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from masked_multistep._checks import (
    check_flag,
    check_real,
    host_int_to_float,
    real_array,
    traced,
)
from masked_multistep._running_mean import compute_dtype, result_type
from masked_multistep._shards import window_flag
from masked_multistep._sq_norms import (
    in_compute_precision,
    materialized_on_gpu,
    sq_norms,
    taken_sq_norm,
    tree_sq_norm,
)
from masked_multistep._stats_state import (
    PER_GROUP,
    LastWindow,
    LeafSums,
    WindowStats,
    WindowStatsState,
    each_leaf,
    init_window_stats,
    packed,
)
from masked_multistep._token_total import add_tokens

__all__ = [
    "accumulate_window_stats",
    "accumulate_window_stats_per_device",
    "device_shares",
    "close_window_stats",
    "noise_scale_estimates",
    "one_window_stats",
    "read_window_stats",
    "read_leaf_stats",
    "undefined_as_nan",
    "Recorder",
    "recorder",
    "window_so_far",
    "with_window_stats",
]

_F32 = jnp.float32


def accumulate_window_stats(
    state: WindowStatsState, grads: Any, count: jax.Array, window: Any = None
) -> WindowStatsState:
    """Folds one microbatch's ``n ‖g‖²`` into the current window.

    Args:
      state: the statistics' state.
      grads: the microbatch's mean gradient (a pytree).
      count: its weight ``n`` (already zeroed for skipped microbatches). Zero
        leaves ``state`` bit-identical, whatever ``grads`` holds.
      window: the window's other figures (its loss, the wrapper's counters):
        inside ``shard_map``, the squared norms are combined over the axes
        over which the gradient varies and neither these nor ``count`` do
        (slices of split parameters, see ``_shards``).

    Returns:
      The new state.

    Examples:
      >>> import jax.numpy as jnp
      >>> from masked_multistep._stats import accumulate_window_stats
      >>> from masked_multistep._stats_state import init_window_stats
      >>> s = init_window_stats()
      >>> s = accumulate_window_stats(s, jnp.array([1.0, 2.0]), jnp.float32(3))
      >>> s = accumulate_window_stats(s, jnp.array([jnp.nan]), jnp.float32(0))
      >>> print(s.weighted_sq_norms, s.microbatches)  # 3 * (1 + 4)
      15.0 1
    """
    with jax.named_scope("masked_multistep/window_stats"):
        take = window_flag(count > 0, (count, window))
        n = jnp.where(take, jnp.asarray(count).astype(_F32), 0)
        leaves = state.leaves
        if isinstance(leaves, LeafSums):
            # Each leaf's squared norm, and the total as their sum.
            per_leaf = jnp.where(take, taken_sq_norm(grads, take, per_leaf=True), 0)
            sq = jnp.sum(per_leaf)
            weighted = leaves.weighted_sq_norms
            weighted = jnp.where(take, weighted + n * per_leaf, weighted)
            leaves = leaves.replaced(weighted_sq_norms=weighted)
        else:
            # (Each leaf on its own: see `tree_sq_norm`.)
            sq = taken_sq_norm(grads, take, together=False).astype(_F32)
            sq = jnp.where(take, sq, 0)
        return state.plus(n * sq, 1, where=take)._replace(leaves=leaves)


def device_shares(
    grads: Any, local_counts: jax.Array, take: jax.Array, per_leaf: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Every device's ``nᵈ ‖gᵈ‖²`` and whether its share counts (shape ``(D,)``;
    with ``per_leaf`` the shares are each leaf's, shape ``(D, L)``).

    ``grads`` are every device's mean gradient, stacked along a leading axis
    of size ``D`` sharded over the devices: each device reduces its own, so
    nothing crosses devices. Where ``take`` is False the share is exactly 0,
    whatever ``gᵈ`` holds (a device without tokens may hold NaN).
    """
    n = jnp.where(take, local_counts, 0).astype(_F32)
    sq = taken_sq_norm(grads, take, True, per_leaf)
    took = take.astype(jnp.int32)
    if per_leaf:
        n, take = n[:, None], take[:, None]
    # Selected away, not multiplied: 0 * NaN is NaN.
    return jnp.where(take, n * jnp.where(take, sq, 0), 0), took


def accumulate_window_stats_per_device(
    state: WindowStatsState, grads: Any, count: jax.Array, local_counts: jax.Array
) -> WindowStatsState:
    """Folds one microbatch split over ``D`` devices into the current window.

    Each device's share is a small batch of its own: ``Σ_d nᵈ ‖gᵈ‖²`` is added
    and ``K`` grows by the devices with ``nᵈ > 0``. The estimators stay
    unbiased (each ``gᵈ`` has covariance ``Σ / nᵈ``), and ``K`` is larger.

    Args:
      state: the statistics' state.
      grads: every device's mean gradient, stacked along a leading axis of size
        ``D`` (sharded over the devices: each device reduces its own).
      count: the microbatch's global count (0 when it is skipped).
      local_counts: shape ``(D,)``, each device's count.

    Examples:
      >>> import jax.numpy as jnp
      >>> from masked_multistep._stats import accumulate_window_stats_per_device
      >>> from masked_multistep._stats_state import init_window_stats
      >>> s = init_window_stats()
      >>> g = jnp.array([[1.0, 2.0], [jnp.nan, 0.0], [3.0, 0.0]])
      >>> s = accumulate_window_stats_per_device(s, g, jnp.float32(5),
      ...                                        jnp.array([2.0, 0.0, 3.0]))
      >>> print(s.weighted_sq_norms, s.microbatches)  # 2 * 5 + 3 * 9
      37.0 2
    """
    with jax.named_scope("masked_multistep/window_stats"):
        take = (jnp.asarray(count) > 0) & (local_counts > 0)
        leaves = state.leaves
        per_leaf = isinstance(leaves, LeafSums)
        added, took = device_shares(grads, local_counts, take, per_leaf)
        if isinstance(leaves, LeafSums):
            added = jnp.sum(added, axis=0)  # each leaf's, over the devices
            leaves = leaves.replaced(weighted_sq_norms=leaves.weighted_sq_norms + added)
        return state.plus(jnp.sum(added), jnp.sum(took))._replace(leaves=leaves)


def noise_scale_estimates(
    sq_deviation: jax.typing.ArrayLike,
    microbatches: jax.typing.ArrayLike,
    tokens: jax.typing.ArrayLike,
    grad_sq_norm: jax.typing.ArrayLike,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The estimators ``(tr Σ̂, |G|²̂, B_simple)`` of one window (the first two
    unbiased; ``B_simple`` their ratio).

    ``tr Σ̂ = S / (K − 1)``, ``|G|²̂ = ‖ḡ‖² − tr Σ̂ / N``,
    ``B_simple = tr Σ̂ / |G|²̂``, in float32 or the widest of ``S``'s, ``N``'s
    and ``‖ḡ‖²``'s dtypes (float64 under x64). Each is NaN where
    undefined: ``K < 2`` or not an integer, ``N <= 0``, ``S < 0`` or
    ``‖ḡ‖² < 0``, or ``N``, ``S`` or ``‖ḡ‖²`` not finite (as the wrapper's
    own estimates are after an overflow), for all three, and ``|G|²̂ <= 0``
    for ``B_simple``.
    The arguments are real numbers (or arrays of them, one entry per window).

    Args:
      sq_deviation: ``S = Σ nᵢ ‖gᵢ − ḡ‖²``.
      microbatches: ``K``, the microbatches with ``nᵢ > 0``.
      tokens: ``N = Σ nᵢ``.
      grad_sq_norm: ``‖ḡ‖²``.

    Returns:
      ``(grad_var_trace, true_grad_sq_norm, noise_scale)``.

    Raises:
      TypeError: if an argument is not a real number or an array of them (a
        bool, complex, ``None``, a string, a ``WindowStats``).
      ValueError: if the arguments' shapes do not broadcast together.

    Examples:
      Two microbatches of 2 tokens with gradients 1 and 3 (so ``ḡ = 2``,
      ``S = 2·1 + 2·1 = 4``):

      >>> import masked_multistep as mm
      >>> var, true_sq, b = mm.noise_scale_estimates(4.0, 2, 4, 4.0)
      >>> print(var, true_sq, b)  # 4 / 1, 4 - 4 / 4, 4 / 3
      4.0 3.0 1.3333334

    References:
      S. McCandlish et al., "An Empirical Model of Large-Batch Training",
      arXiv:1812.06162, 2018, Appendix A.1.
    """
    given = {
        "sq_deviation": sq_deviation,
        "microbatches": microbatches,
        "tokens": tokens,
        "grad_sq_norm": grad_sq_norm,
    }
    for name, x in given.items():
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            # (jnp.asarray makes a NamedTuple's fields a vector.)
            hint = ""
            if isinstance(x, WindowStats):
                hint = (
                    ": its fields are the window's estimates already "
                    "(`.grad_var_trace`, `.true_grad_sq_norm`, `.noise_scale`)"
                )
            raise TypeError(
                f"`{name}` must be a real number or an array of them, got a "
                f"{type(x).__name__}{hint}"
            )
    # Host integers by value: jnp.asarray would wrap a numpy int64 into int32.
    arrays = {
        name: real_array(host_int_to_float(x), f"`{name}`") for name, x in given.items()
    }
    try:
        jnp.broadcast_shapes(*(jnp.shape(x) for x in arrays.values()))
    except ValueError:
        shapes = ", ".join(f"`{name}` {jnp.shape(x)}" for name, x in arrays.items())
        raise ValueError(
            "noise_scale_estimates' arguments must broadcast together (one entry "
            f"per window), got the shapes {shapes}"
        ) from None
    s, k, n, g2 = arrays.values()
    # In the widest of the figures' dtypes (`_estimates` works in S's): a
    # float32 S beside a float64 ‖ḡ‖² of 1e40 would make it inf, undefined.
    s = s.astype(compute_dtype(result_type(s, n, g2)))
    var, true_sq, scale, ok, resolved = _estimates(s, k, n, g2)
    return undefined_as_nan((var, true_sq, scale), (ok, ok, resolved))


def _estimates(
    s: jax.Array, k: jax.Array, n: jax.Array, g2: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`noise_scale_estimates` without NaN: ``(tr Σ̂, |G|²̂, B_simple)``,
    each 0 where undefined, and where the first two and the third are defined
    (``ok`` and ``resolved``)."""
    dtype = compute_dtype(s.dtype)
    s, k, n, g2 = (x.astype(dtype) for x in (s, k, n, g2))
    # S and ‖ḡ‖² are finite sums of squares, K a count and N a finite total:
    # other values define nothing (an infinite ‖ḡ‖² would make B_simple 0).
    ok = (k >= 2) & jnp.isfinite(k) & (k == jnp.round(k)) & (n > 0) & (s >= 0)
    ok = ok & jnp.isfinite(n) & jnp.isfinite(s) & jnp.isfinite(g2) & (g2 >= 0)
    var = jnp.where(ok, s / jnp.where(ok, k - 1, 1), 0)
    true_sq = jnp.where(ok, g2 - var / jnp.where(ok, n, 1), 0)
    resolved = ok & (true_sq > 0)
    scale = jnp.where(resolved, var / jnp.where(resolved, true_sq, 1), 0)
    return var, true_sq, scale, ok, resolved


def undefined_as_nan(values: Any, defined: Any) -> Any:
    """Each of ``values`` where ``defined`` holds, NaN elsewhere: where the
    statistics are read, so that the state never holds a NaN of its own.

    NaN made here are placeholders, not failures of arithmetic: outside a
    trace they are made with ``jax_debug_nans`` off, which would otherwise stop
    an eager read of a statistic that is undefined. (A traced program that
    returns one returns a NaN, which ``jax_debug_nans`` reports.)
    """
    with jax.debug_nans(False):
        return jax.tree.map(lambda x, ok: jnp.where(ok, x, jnp.nan), values, defined)


def _sq_norm_and_deviation(
    state: WindowStatsState, tokens: jax.Array, grad_sq_norm: Any
) -> tuple[jax.Array, jax.Array]:
    """``(‖ḡ‖², S)`` of the window so far, 0 without tokens, with
    ``S = Σ nᵢ‖gᵢ‖² − N‖ḡ‖²`` clamped at 0 (rounding may leave it just below).
    Where the sums are not finite (a non-finite gradient, or an overflow),
    neither is ``S``: not the 0 that ``max(−inf, 0)`` would give."""
    return _deviation(state.weighted_sq_norms, tokens, grad_sq_norm)


def _deviation(
    weighted_sq_norms: jax.Array, tokens: jax.Array, grad_sq_norm: Any
) -> tuple[jax.Array, jax.Array]:
    """:func:`_sq_norm_and_deviation` of the sums ``Σ nᵢ‖gᵢ‖²`` (a total, or
    each leaf's)."""
    has_tokens = tokens > 0
    g2 = jnp.where(has_tokens, jnp.asarray(grad_sq_norm).astype(_F32), 0)
    spread = weighted_sq_norms - tokens.astype(_F32) * g2
    sums_finite = jnp.isfinite(weighted_sq_norms) & jnp.isfinite(g2)
    # Where not finite, their sum is NaN or infinite as they are.
    s = jnp.where(sums_finite, jnp.maximum(spread, 0), weighted_sq_norms + g2)
    return g2, s


def window_so_far(
    state: WindowStatsState, tokens: jax.Array, mean: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(K, ‖ḡ‖², tr Σ̂)`` of the open window, its last microbatch folded in.

    What a window policy that sizes windows by their statistics (the norm
    test) reads after every microbatch: the same running figures and
    estimator as the window's :class:`WindowStats`, with ``‖ḡ‖²`` read from
    the running mean now (one squared-norm reduction of it per microbatch)
    instead of once at the window's end.

    Args:
      state: the statistics' state, with the microbatch folded in.
      tokens: the window's ``N`` so far (count dtype).
      mean: the window's running mean ``ḡ`` (any values where ``N == 0``).

    Returns:
      ``K`` (int32), ``‖ḡ‖²`` (NaN where ``N == 0``) and ``tr Σ̂ = S / (K − 1)``
      (NaN where ``K < 2``).

    Examples:
      >>> import jax.numpy as jnp
      >>> from masked_multistep._stats import accumulate_window_stats, window_so_far
      >>> from masked_multistep._stats_state import init_window_stats
      >>> s = init_window_stats()
      >>> for g in (1.0, 3.0):
      ...     s = accumulate_window_stats(s, jnp.array(g), jnp.float32(2))
      >>> print(*window_so_far(s, jnp.float32(4), jnp.array(2.0)))  # S = 2 + 2
      2 4.0 4.0
    """
    with jax.named_scope("masked_multistep/window_stats"):
        tokens = jnp.asarray(tokens)
        g2, s = _sq_norm_and_deviation(state, tokens, tree_sq_norm(mean, tokens))
        k = state.microbatches
        var, _, _, ok, _ = _estimates(s, k, tokens, g2)
        g2, var = undefined_as_nan((g2, var), (tokens > 0, ok))
        return k, g2, var


def close_window_stats(
    state: WindowStatsState,
    *,
    tokens: jax.Array,
    grad_sq_norm: jax.Array,
    loss: jax.Array,
    loss_tokens: jax.Array,
    decay: float,
    leaf_sq_norms: jax.Array | None = None,
) -> WindowStatsState:
    """Records the finished window and starts a new one.

    Args:
      state: the statistics' state, with the window's last microbatch folded in.
      tokens: the window's ``N`` (count dtype).
      grad_sq_norm: ``‖ḡ‖²`` of the window's mean (any value where ``N == 0``).
      leaf_sq_norms: with each leaf's share (``state.leaves``), each leaf's
        ``‖ḡₗ‖²`` (a vector whose sum is ``grad_sq_norm``).
      loss: the window's token-weighted mean ``value`` (any value where
        ``loss_tokens`` is 0).
      loss_tokens: the tokens of the microbatches that passed a ``value``.
      decay: the moving averages' decay per window, in ``[0, 1)``.

    Returns:
      The new state.

    Examples:
      >>> import jax.numpy as jnp
      >>> from masked_multistep._stats import (
      ...     accumulate_window_stats, close_window_stats, read_window_stats)
      >>> from masked_multistep._stats_state import init_window_stats
      >>> s = init_window_stats()
      >>> for g in (1.0, 3.0):
      ...     s = accumulate_window_stats(s, jnp.array(g), jnp.float32(2))
      >>> s = close_window_stats(s, tokens=jnp.float32(4),
      ...                        grad_sq_norm=jnp.float32(4.0),
      ...                        loss=jnp.float32(0.5),
      ...                        loss_tokens=jnp.float32(4), decay=0.9)
      >>> stats = read_window_stats(s)
      >>> print(stats.noise_scale, stats.smoothed_noise_scale, s.microbatches)
      1.3333334 1.3333334 0
    """
    with jax.named_scope("masked_multistep/window_stats"):
        n = jnp.asarray(tokens)
        g2, s = _sq_norm_and_deviation(state, n, grad_sq_norm)
        k = state.microbatches
        var, true_sq, _, finite, _ = _estimates(s, k, n, g2)

        beta = jnp.asarray(decay, _F32)
        ema_var = _moved(state.ema_grad_var_trace, var, finite, beta)
        ema_true = _moved(state.ema_true_grad_sq_norm, true_sq, finite, beta)
        ema_weight = jnp.where(
            finite, beta * state.ema_weight + (1 - beta), state.ema_weight
        )

        old = state.last
        loss_tokens = jnp.asarray(loss_tokens)
        last = LastWindow(
            tokens=n.astype(old.tokens.dtype),
            microbatches=k,
            loss=jnp.where(loss_tokens > 0, jnp.asarray(loss).astype(_F32), 0),
            loss_tokens=loss_tokens.astype(old.loss_tokens.dtype),
            grad_sq_norm=g2,
            sq_deviation=s,
            tokens_seen=add_tokens(old.tokens_seen, n),
            windows=cast(jax.Array, optax.safe_increment(old.windows)),
        )
        leaves = state.leaves
        if isinstance(leaves, LeafSums):
            leaves = _close_leaves(leaves, n, k, leaf_sq_norms, finite, beta)
        # The next window starts empty (zeros placed as the sums they
        # replace: an eager step would put fresh ones on the default device).
        return packed(
            weighted_sq_norms=jnp.zeros_like(state.weighted_sq_norms),
            microbatches=jnp.zeros_like(state.microbatches),
            ema_grad_var_trace=ema_var,
            ema_true_grad_sq_norm=ema_true,
            ema_weight=ema_weight,
            last=last,
            leaves=leaves,
        )


def _close_leaves(
    leaves: LeafSums,
    tokens: jax.Array,
    microbatches: jax.Array,
    leaf_sq_norms: Any,
    finite: jax.Array,
    beta: jax.Array,
) -> LeafSums:
    """Each leaf's share of the closed window: its ``‖ḡₗ‖²`` and ``Sₗ``, and
    its moving averages, moved where the window's (total) estimates are
    finite, as the window's are (the leaves' then are too, their sums being
    finite), so that a group's averages are the sums of its leaves'."""
    if leaf_sq_norms is None:
        raise ValueError("each leaf's squared norm of the window's mean is needed")
    g2, s = _deviation(leaves.weighted_sq_norms, tokens, leaf_sq_norms)
    var, true_sq, *_ = _estimates(s, microbatches, tokens, g2)
    return LeafSums.packed(
        weighted_sq_norms=jnp.zeros_like(leaves.weighted_sq_norms),
        grad_sq_norm=g2,
        sq_deviation=s,
        ema_grad_var_trace=_moved(leaves.ema_grad_var_trace, var, finite, beta),
        ema_true_grad_sq_norm=_moved(
            leaves.ema_true_grad_sq_norm, true_sq, finite, beta
        ),
    )


def _moved(
    average: jax.Array, value: jax.Array, finite: jax.Array, beta: jax.Array
) -> jax.Array:
    """A moving average (decay ``beta``) moved by ``value`` where ``finite``."""
    return jnp.where(finite, beta * average + (1 - beta) * value, average)


def read_window_stats(state: WindowStatsState) -> WindowStats[jax.Array]:
    """The :class:`WindowStats` of the last completed window, its estimators
    derived from the state's sums (NaN where undefined, made here).

    Examples:
      >>> import jax.numpy as jnp
      >>> from masked_multistep._stats import (
      ...     accumulate_window_stats, close_window_stats, read_window_stats)
      >>> from masked_multistep._stats_state import init_window_stats
      >>> s = accumulate_window_stats(init_window_stats(), jnp.array(1.0),
      ...                             jnp.float32(2))
      >>> s = close_window_stats(s, tokens=jnp.float32(2),
      ...                        grad_sq_norm=jnp.float32(1.0),
      ...                        loss=jnp.float32(0.0),
      ...                        loss_tokens=jnp.float32(0), decay=0.9)
      >>> stats = read_window_stats(s)  # one microbatch, and no `value`
      >>> print(stats.grad_sq_norm, stats.noise_scale, stats.loss)
      1.0 nan nan
    """
    return _read_with(_read, _read_compiled, state)


def _read_with(
    read: Callable[..., WindowStats[jax.Array]],
    compiled: Callable[..., WindowStats[jax.Array]],
    state: WindowStatsState,
    *static: Any,
) -> WindowStats[jax.Array]:
    """``read(state, *static)``; outside a trace its ``compiled`` form: one
    compiled program reads the statistics, wherever the state lies (a state
    replicated over a mesh would otherwise run each operation of the read as
    its own program on every device). Its NaN are placeholders (see
    :func:`undefined_as_nan`)."""
    if traced(state):
        return read(state, *static)
    with jax.debug_nans(False):
        return compiled(state, *static)


def _read(state: WindowStatsState) -> WindowStats[jax.Array]:
    return _read_figures(
        state.last,
        ema_weight=state.ema_weight,
        ema_grad_var_trace=state.ema_grad_var_trace,
        ema_true_grad_sq_norm=state.ema_true_grad_sq_norm,
    )


def _read_figures(
    last: LastWindow,
    *,
    ema_weight: jax.Array,
    ema_grad_var_trace: jax.Array,
    ema_true_grad_sq_norm: jax.Array,
) -> WindowStats[jax.Array]:
    """:func:`_read` of these figures (each group's, where the window's
    squared norms and moving averages are vectors of the groups')."""
    with jax.named_scope("masked_multistep/window_stats"):
        has_tokens = last.tokens > 0
        var, true_sq, scale, ok, resolved = _estimates(
            last.sq_deviation, last.microbatches, last.tokens, last.grad_sq_norm
        )
        # The moving averages' debiasing divisor cancels in their ratio; it
        # only says whether any window has been averaged yet.
        smooth_ok = (ema_weight > 0) & (ema_true_grad_sq_norm > 0)
        smoothed = ema_grad_var_trace / jnp.where(smooth_ok, ema_true_grad_sq_norm, 1)
        loss, g2, var, true_sq, scale, smoothed = undefined_as_nan(
            (last.loss, last.grad_sq_norm, var, true_sq, scale, smoothed),
            (last.loss_tokens > 0, has_tokens, ok, ok, resolved, smooth_ok),
        )
        return WindowStats(
            tokens=last.tokens,
            microbatches=last.microbatches,
            loss=loss,
            grad_sq_norm=g2,
            grad_var_trace=var,
            true_grad_sq_norm=true_sq,
            noise_scale=scale,
            smoothed_noise_scale=smoothed.astype(_F32),
            tokens_seen=last.tokens_seen,
            windows=last.windows,
        )


_read_compiled = jax.jit(_read)


def read_leaf_stats(
    state: WindowStatsState, groups: tuple[int, ...]
) -> WindowStats[jax.Array]:
    """The last completed window's :class:`WindowStats` for groups of leaves.

    ``groups[l]`` is the group (``0 .. G − 1``) of parameter leaf ``l``. Each
    group's ``S``, ``‖ḡ‖²`` and moving averages are the sums of its leaves'
    (:class:`LeafSums`), and its estimators follow from them as the window's
    do from its totals; ``grad_sq_norm``, ``grad_var_trace``,
    ``true_grad_sq_norm``, ``noise_scale`` and ``smoothed_noise_scale`` are
    then vectors of one entry per group (for a batch of states, arrays of
    shape ``(G, *batch)``), the other fields the window's.

    Examples:
      >>> import jax.numpy as jnp
      >>> from masked_multistep._stats import (
      ...     accumulate_window_stats, close_window_stats, read_leaf_stats)
      >>> from masked_multistep._stats_state import init_window_stats
      >>> s = init_window_stats(num_leaves=2)
      >>> for g in ((1.0, 0.0), (3.0, 2.0)):
      ...     s = accumulate_window_stats(s, [jnp.array(g[0]), jnp.array(g[1])],
      ...                                 jnp.float32(2))
      >>> s = close_window_stats(s, tokens=jnp.float32(4),
      ...                        grad_sq_norm=jnp.float32(5.0),
      ...                        leaf_sq_norms=jnp.array([4.0, 1.0]),
      ...                        loss=jnp.float32(0.0),
      ...                        loss_tokens=jnp.float32(0), decay=0.9)
      >>> print(read_leaf_stats(s, (0, 1)).grad_var_trace)  # S: 2·1 + 2·1 each
      [4. 4.]
      >>> print(read_leaf_stats(s, (0, 0)).grad_var_trace)  # one group of both
      [8.]
    """
    if not isinstance(state.leaves, LeafSums):
        raise ValueError("the statistics keep no leaf's share")
    if len(groups) != state.leaves.weighted_sq_norms.shape[-1]:
        raise ValueError(
            f"{len(groups)} group labels for "
            f"{state.leaves.weighted_sq_norms.shape[-1]} leaves"
        )
    return _read_with(_read_leaves, _read_leaves_compiled, state, groups)


def _read_leaves(
    state: WindowStatsState, groups: tuple[int, ...]
) -> WindowStats[jax.Array]:
    # A batch of states (an ensemble stacked by `vmap`, read outside it) has
    # its axes before the leaves': each member is read as one state, and the
    # groups' axis goes first, for one entry per group along it.
    batch = jnp.ndim(state.last.tokens)
    if not batch:
        return _read_leaves_of_one(state, groups)
    read = functools.partial(_read_leaves_of_one, groups=groups)
    for _ in range(batch):
        read = jax.vmap(read)
    stats = read(state)
    return stats._replace(
        **{name: jnp.moveaxis(getattr(stats, name), -1, 0) for name in PER_GROUP}
    )


def _read_leaves_of_one(
    state: WindowStatsState, groups: tuple[int, ...]
) -> WindowStats[jax.Array]:
    leaves = cast(LeafSums, state.leaves)
    num_groups = max(groups, default=-1) + 1
    ids = np.asarray(groups, np.int32)

    def summed(x: jax.Array) -> jax.Array:
        return jax.ops.segment_sum(x, ids, num_segments=num_groups)

    g2, s, ema_var, ema_true = map(
        summed,
        (
            leaves.grad_sq_norm,
            leaves.sq_deviation,
            leaves.ema_grad_var_trace,
            leaves.ema_true_grad_sq_norm,
        ),
    )
    return _read_figures(
        state.last._replace(grad_sq_norm=g2, sq_deviation=s),
        ema_weight=state.ema_weight,
        ema_grad_var_trace=ema_var,
        ema_true_grad_sq_norm=ema_true,
    )


_read_leaves_compiled = jax.jit(_read_leaves, static_argnums=1)


class Recorder(NamedTuple):
    """What :class:`MaskedMultiSteps` calls at three points of its state
    machine: on each microbatch (:meth:`accumulate`), on the window's mean
    before the inner optimizer reads it (:meth:`read_mean`), and once the
    window's fate is known (:meth:`close`, in the branch that closes the
    window); with the norm test, also on each microbatch (:meth:`so_far`).
    Disabled, those three return ``()`` (an empty state field) and add nothing
    to the compiled step; :meth:`so_far` needs them on (the norm test turns
    them on).
    """

    enabled: bool
    decay: float
    # Each parameter leaf's share too (`LeafSums`).
    per_leaf: bool = False

    def init(
        self, count_dtype: Any, num_leaves: int = 0
    ) -> WindowStatsState | tuple[()]:
        if not self.enabled:
            return ()
        return init_window_stats(count_dtype, num_leaves if self.per_leaf else None)

    def accumulate(
        self,
        state: Any,
        grads: Any,
        count: jax.Array,
        local_counts: jax.Array | None = None,
        window: Any = None,
    ) -> Any:
        """``local_counts`` (shape ``(D,)``): ``grads`` are every device's own,
        stacked (``reduction=mm.deferred(...)``); each is a small batch.
        ``window``: as :func:`accumulate_window_stats` takes it."""
        if not self.enabled:
            return ()
        if local_counts is None:
            return accumulate_window_stats(state, grads, count, window)
        return accumulate_window_stats_per_device(state, grads, count, local_counts)

    def read_mean(self, mean: Any, take: jax.Array) -> Any:
        """``‖mean‖²`` (float32), or ``()`` when disabled; its derivative is
        0 where ``take`` is False (a window without tokens has no mean). With
        ``per_leaf``, ``(‖mean‖², each leaf's ‖meanₗ‖²)``, the total the sum of
        the leaves' (:meth:`total` reads it).

        The caller's finiteness test of ``mean`` reuses it (a finite sum of
        squares means finite elements), so the inner optimizer, which waits
        for that test, runs after the norm has read the mean and can write its
        update into the mean's buffer. Without this dependency XLA keeps the
        mean alive beside the update, and the step needs scratch memory like
        the parameters.
        """
        if not self.enabled:
            return ()
        with jax.named_scope("masked_multistep/window_stats"):
            if self.per_leaf:
                per_leaf = taken_sq_norm(mean, take, per_leaf=True)
                return jnp.sum(per_leaf), per_leaf
            return taken_sq_norm(mean, take).astype(_F32)

    @staticmethod
    def total(mean_sq_norm: Any) -> Any:
        """The window's ``‖mean‖²`` of what :meth:`read_mean` returned."""
        if isinstance(mean_sq_norm, tuple) and mean_sq_norm:
            return mean_sq_norm[0]
        return mean_sq_norm  # a scalar, or `()` without statistics

    def so_far(
        self, state: Any, tokens: jax.Array, mean: Any
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """:func:`window_so_far`, for a window policy; needs ``enabled``."""
        if not self.enabled:
            raise ValueError("the window statistics are off")
        return window_so_far(state, tokens, mean)

    def close(
        self,
        state: Any,
        *,
        tokens: jax.Array,
        mean_sq_norm: Any,
        loss: jax.Array,
        loss_tokens: jax.Array,
        sums: Any = (),
    ) -> Any:
        """``loss``: the window's mean ``value`` over the ``loss_tokens``
        tokens that passed one (any value where there are none). ``sums``:
        the window's ``(Σ nᵢ‖gᵢ‖², K)`` where a reduction kept their
        per-device shares until the window closed (``()``: they are in
        ``state`` already)."""
        if not self.enabled:
            return ()
        if sums:
            state = state.replaced(weighted_sq_norms=sums[0], microbatches=sums[1])
            if isinstance(state.leaves, LeafSums):
                leaves = state.leaves.replaced(weighted_sq_norms=sums[2])
                state = state._replace(leaves=leaves)
        leaf_sq_norms = None
        if isinstance(mean_sq_norm, tuple):
            mean_sq_norm, leaf_sq_norms = mean_sq_norm
        return close_window_stats(
            state,
            tokens=tokens,
            grad_sq_norm=mean_sq_norm,
            loss=loss,
            loss_tokens=loss_tokens,
            decay=self.decay,
            leaf_sq_norms=leaf_sq_norms,
        )


# The largest float below 1 that float32 holds below 1 (1 − 2⁻²⁴).
_MAX_DECAY = float(np.nextafter(np.float32(1), np.float32(0)))


def recorder(
    window_stats: Any, stats_decay: Any, per_leaf_stats: Any = False
) -> Recorder:
    """The statistics' hooks for :class:`MaskedMultiSteps`, arguments checked
    (``per_leaf_stats`` turns them on).

    Raises:
      TypeError: if ``window_stats`` or ``per_leaf_stats`` is not a bool.
      TypeError: if ``stats_decay`` is not a concrete real number.
      ValueError: if ``stats_decay`` is not a scalar in ``[0, 1)`` that stays
        below 1 in float32.
    """
    window_stats = check_flag(window_stats, "`window_stats`")
    per_leaf = check_flag(per_leaf_stats, "`per_leaf_stats`")
    # A real number: Python's, or a concrete 0-d numpy or jax array.
    if getattr(stats_decay, "dtype", None) is not None and np.ndim(stats_decay) != 0:
        raise ValueError(
            f"`stats_decay` must be a scalar, got shape {np.shape(stats_decay)}"
        )
    decay = float(check_real(stats_decay, "`stats_decay`", positive=False))
    if not 0 <= decay < 1:
        raise ValueError(f"`stats_decay` must be in [0, 1), got {stats_decay!r}")
    if np.float32(decay) == 1:
        # The moving averages run in float32: a decay that rounds to 1 would
        # never move them (the smoothed estimate would stay NaN).
        raise ValueError(
            f"`stats_decay` must be below 1 in float32, the moving averages' "
            f"precision; {stats_decay!r} rounds to 1.0 (at most {_MAX_DECAY!r})"
        )
    return Recorder(window_stats or per_leaf, decay, per_leaf)


def sum_over_devices(
    weighted_sq_norms: jax.Array, microbatches: jax.Array
) -> tuple[jax.Array, ...]:
    """Every device's share ``(Σ nᵢ‖gᵢ‖², K)`` (shape ``(D,)`` each) summed
    over the devices, in one reduction; with each leaf's shares
    (``weighted_sq_norms`` of shape ``(D, L)``), ``(total, K, each leaf's)``.

    ``K`` is summed in float32, stacked with the squared norms (exact below
    2²⁴ (device, microbatch) pairs): a cross-device sum of the two is then one
    all-reduce, which the compiler joins with the gradients' (an int32 ``K``
    would be an all-reduce of its own).
    """
    weighted_sq_norms = jnp.asarray(weighted_sq_norms, _F32)
    if weighted_sq_norms.ndim == 2:
        rows = jnp.concatenate(
            [weighted_sq_norms, microbatches.astype(_F32)[:, None]], axis=1
        )
        sums = jnp.sum(rows, axis=0)
        per_leaf, k = sums[:-1], sums[-1]
        return jnp.sum(per_leaf), k.astype(jnp.int32), per_leaf
    sq_norms, k = jnp.sum(
        jnp.stack([weighted_sq_norms, microbatches.astype(_F32)]),
        axis=1,
    )
    return sq_norms, k.astype(jnp.int32)


def one_window_stats(
    sums: tuple[jax.Array, ...],
    *,
    tokens: jax.Array,
    mean: Any,
    loss: jax.Array,
) -> WindowStats[Any]:
    """The :class:`WindowStats` of a window that is one call (in-jit
    microbatching): from its running sums ``(Σ nᵢ‖gᵢ‖², K)``, token total
    ``N``, mean gradient ``ḡ`` and mean loss (``smoothed_noise_scale`` is the
    window's own ``noise_scale``). With each leaf's sums as well, ``(Σ nᵢ‖gᵢ‖²,
    K, each leaf's Σ nᵢ‖gᵢ,ₗ‖²)``, each leaf's statistics: the
    :data:`PER_GROUP` fields are then pytrees shaped like ``mean``, as
    ``mm.window_stats(state, per_leaf=True)`` reads them."""
    weighted_sq_norms, microbatches, *per_leaf = sums
    leaf_sums = per_leaf[0] if per_leaf else None
    state = init_window_stats(
        jnp.result_type(tokens),
        None if leaf_sums is None else jnp.shape(leaf_sums)[-1],
    ).replaced(
        weighted_sq_norms=jnp.asarray(weighted_sq_norms, _F32),
        microbatches=jnp.asarray(microbatches, jnp.int32),
    )
    leaf_sq_norms = None
    if leaf_sums is None:
        grad_sq_norm = tree_sq_norm(mean, (tokens, loss))
    else:
        # As the wrapper closes a window with leaf statistics: the total is
        # the leaves' sum.
        leaf_sq_norms = sq_norms(mean, False, (), per_leaf=True, window=(tokens, loss))
        grad_sq_norm = jnp.sum(leaf_sq_norms)
        state = state._replace(
            leaves=cast(LeafSums, state.leaves).replaced(
                weighted_sq_norms=jnp.asarray(leaf_sums, _F32)
            )
        )
    state = close_window_stats(
        state,
        tokens=tokens,
        grad_sq_norm=grad_sq_norm,
        loss=loss,
        loss_tokens=tokens,
        decay=0.0,
        leaf_sq_norms=leaf_sq_norms,
    )
    if leaf_sums is None:
        return read_window_stats(state)
    return each_leaf(mean, lambda groups: _read_leaves(state, groups))


def with_window_stats(
    accumulator: optax.microbatching.Accumulator,
    grads_and_weight: Callable[[Any], tuple[Any, jax.Array]],
    window_of: Callable[[Any], tuple[jax.Array, jax.Array, Any]],
    *,
    sums_only: bool = False,
    per_leaf: bool = False,
    window: Callable[[Any], Any] | None = None,
) -> optax.microbatching.Accumulator:
    """``accumulator`` with the window statistics of its microbatches beside it.

    For :func:`microbatched_value_and_grad`: one call is one window. The carry
    becomes ``(carry, WindowStatsState)``; ``update`` also folds ``n ‖g‖²`` of
    each microbatch in; ``finalize`` returns the wrapped ``finalize``'s output
    with the call's :class:`WindowStats` appended (:func:`one_window_stats`),
    or with ``sums_only`` its running sums ``(Σ nᵢ‖gᵢ‖², K)``, for a caller
    that combines several such loops into one window.

    Args:
      accumulator: the accumulator to extend.
      grads_and_weight: a microbatch's value -> ``(gradient, weight)``; a weight
        that is not positive adds nothing.
      window_of: the wrapped carry -> ``(mean loss, weight total, mean
        gradient)``, in the precision they were accumulated in.
      sums_only: return the running sums instead of the :class:`WindowStats`.
      per_leaf: keep each leaf's share too: the :class:`WindowStats` is then
        each leaf's (:func:`one_window_stats`), and the running sums
        ``(each leaf's Σ nᵢ‖gᵢ,ₗ‖², K)``.
      window: a microbatch's value -> its other figures (its loss), as
        :func:`accumulate_window_stats` takes them.
    """

    def init(value):
        grads, weight = grads_and_weight(value)
        leaves = len(jax.tree.leaves(grads)) if per_leaf else None
        return accumulator.init(value), init_window_stats(weight.dtype, leaves)

    def update(carry, value, index):
        inner, stats = carry
        value = in_compute_precision(materialized_on_gpu(value))
        grads, weight = grads_and_weight(value)
        figures = None if window is None else window(value)
        stats = accumulate_window_stats(stats, grads, weight, figures)
        return accumulator.update(inner, value, index), stats

    def finalize(carry):
        inner, stats = carry
        out = cast("tuple[Any, ...]", accumulator.finalize(inner))
        if per_leaf:
            leaf_sums = cast(LeafSums, stats.leaves).weighted_sq_norms
            if sums_only:  # `sum_over_devices` adds up the total from these
                return (*out, (leaf_sums, stats.microbatches))
            sums = (stats.weighted_sq_norms, stats.microbatches, leaf_sums)
        else:
            sums = (stats.weighted_sq_norms, stats.microbatches)
        if sums_only:
            return (*out, sums)
        loss, total, mean = window_of(inner)
        return (*out, one_window_stats(sums, tokens=total, mean=mean, loss=loss))

    return optax.microbatching.Accumulator(
        init, update, finalize, accumulator.aggregate
    )
