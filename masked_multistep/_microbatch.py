"""In-jit microbatching: the full batch's token-mean gradient, one microbatch at a time.

One call splits the batch into ``k`` microbatches and runs them in a ``lax`` loop
inside the computation, so peak memory follows the microbatch while the result
is that of the full batch. The loop is a ``lax.fori_loop`` over the strided split
of ``optax.microbatching``; how the per-microbatch results combine is an
``optax.microbatching.Accumulator`` built on :func:`running_mean_update`, the same
token-weighted running mean that :class:`MaskedMultiSteps` uses across steps.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from masked_multistep import _stats
from masked_multistep._running_mean import (
    compute_dtype,
    running_mean_update,
    scalar_count,
)

__all__ = ["microbatched_value_and_grad"]


def _check_num_microbatches(num_microbatches: Any) -> int:
    if isinstance(num_microbatches, (np.ndarray, np.generic)) and (
        np.ndim(num_microbatches) == 0
        and np.issubdtype(np.asarray(num_microbatches).dtype, np.integer)
    ):
        num_microbatches = int(num_microbatches)
    if isinstance(num_microbatches, bool) or not isinstance(
        num_microbatches, numbers.Integral
    ):
        raise TypeError(
            "`num_microbatches` must be a Python integer, got "
            f"{num_microbatches!r} of type {type(num_microbatches).__name__}"
        )
    if num_microbatches < 1:
        raise ValueError(f"`num_microbatches` must be >= 1, got {num_microbatches}")
    return int(num_microbatches)


def _batch_size(batch: Any, num_microbatches: int) -> int:
    """The common leading size of ``batch``'s leaves, checked against ``k``."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise ValueError(
            f"`batch` must contain at least one array, got {jax.tree.structure(batch)}"
        )
    sizes = {}
    for path, leaf in leaves:
        shape = jnp.shape(leaf)
        name = jax.tree_util.keystr(path) or "<root>"
        if not shape:
            raise ValueError(
                f"`batch` leaves need a leading batch axis, but the leaf at {name} "
                "is a scalar"
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
    return size


def _check_output(out: Any, has_aux: bool) -> tuple[Any, Any, Any]:
    """Splits ``loss_fn``'s output into ``(loss, count, aux)``, checking each."""
    expected = "(mean_loss, (count, aux))" if has_aux else "(mean_loss, count)"
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
            f"`loss_fn` must return {expected} (has_aux={has_aux}), got "
            f"{type(out).__name__}"
        )
    loss, rest = out
    if has_aux:
        if not (isinstance(rest, (tuple, list)) and len(rest) == 2):
            raise TypeError(
                f"With has_aux=True, `loss_fn` must return {expected}, got a second "
                f"element of type {type(rest).__name__}"
            )
        count, aux = rest
    else:
        count, aux = rest, None
    loss = jnp.asarray(loss)
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            "The loss returned by `loss_fn` must be a floating scalar (the "
            f"microbatch's mean loss), got shape {loss.shape} and dtype {loss.dtype}"
        )
    count = scalar_count(
        count, "The count returned by `loss_fn`", " (the microbatch's token count)"
    )
    for path, leaf in jax.tree_util.tree_flatten_with_path(aux)[0]:
        dtype = jnp.result_type(leaf)
        if not (
            jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
        ):
            raise TypeError(
                "`aux` leaves must be floating (token-weighted mean over "
                "microbatches) or integer (summed over microbatches), got dtype "
                f"{dtype} at aux{jax.tree_util.keystr(path)}"
            )
    return loss, count, aux


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _token_weighted_accumulator(
    has_aux: bool, with_stats: bool = False
) -> optax.microbatching.Accumulator:
    """Folds per-microbatch ``(loss, count, aux, grads)`` into full-batch values.

    The loss, the gradients and the floating ``aux`` leaves go through one
    :func:`running_mean_update` weighted by the microbatch's count; integer
    ``aux`` leaves are summed. The running means are kept in at least float32
    and cast back to the per-microbatch dtypes by ``finalize``, which returns
    ``microbatched_value_and_grad``'s output structure. With ``with_stats``,
    the carry also holds the window statistics (``_stats``), and ``finalize``
    appends the call's :class:`WindowStats` to that output.
    """
    # One accumulator serves one call: `init` records the per-microbatch output
    # avals that `finalize` casts back to.
    avals = []

    def split(value):
        loss, count, aux, grads = value
        aux_leaves = jax.tree.leaves(aux)
        means = (loss, [x for x in aux_leaves if _is_float(x)], grads)
        sums = [x for x in aux_leaves if not _is_float(x)]
        return means, sums, count

    def init(shapes):
        avals[:] = [shapes]
        means, sums, count = split(shapes)
        return (
            jax.tree.map(lambda s: jnp.zeros(s.shape, compute_dtype(s.dtype)), means),
            [jnp.zeros(s.shape, s.dtype) for s in sums],
            jnp.zeros([], count.dtype),
            _stats.init_window_stats(count.dtype) if with_stats else (),
        )

    def update(carry, value, index):
        del index
        acc_means, acc_sums, total, stats = carry
        means, sums, count = split(value)
        # A microbatch with no (or a non-finite, or a negative) count holds no
        # tokens: it must not move the means, whatever NaN its 0/0 mean produced.
        count = jnp.where(jnp.isfinite(count) & (count > 0), count, 0).astype(
            total.dtype
        )
        acc_means, total = running_mean_update(acc_means, total, means, count)
        acc_sums = [a + s for a, s in zip(acc_sums, sums, strict=True)]
        if with_stats:
            stats = _stats.accumulate_window_stats(stats, value[3], count)
        return acc_means, acc_sums, total, stats

    def finalize(carry):
        out = _finalize(carry)
        if not with_stats:
            return out
        (loss, _, grads), _, count, stats = carry
        # The call is one window: its statistics, from the float32 (or wider)
        # means, before they are cast back.
        stats = _stats.close_window_stats(
            stats,
            jnp.ones([], jnp.bool_),
            tokens=count,
            grad_sq_norm=_stats.tree_sq_norm(grads),
            loss=jnp.where(count > 0, loss, jnp.nan),
            decay=0.0,
        )
        return (*out, stats.last)

    def _finalize(carry):
        (loss, float_aux, grads), int_aux, count, _ = carry
        loss_s, _, aux_s, grads_s = avals[0]
        loss = loss.astype(loss_s.dtype)
        grads = jax.tree.map(lambda g, s: g.astype(s.dtype), grads, grads_s)
        if not has_aux:
            return (loss, count), grads
        float_it, int_it = iter(float_aux), iter(int_aux)
        aux = jax.tree.map(
            lambda s: next(float_it).astype(s.dtype) if _is_float(s) else next(int_it),
            aux_s,
        )
        return (loss, (count, aux)), grads

    def aggregate(stacked):
        # Only `optax.microbatching.micro_vmap` calls this: fold the stacked
        # per-microbatch values with the same update.
        carry = init(
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)
        )
        carry, _ = jax.lax.scan(lambda c, v: (update(c, v, None), None), carry, stacked)
        return finalize(carry)

    return optax.microbatching.Accumulator(init, update, finalize, aggregate)


def microbatched_value_and_grad(
    loss_fn: Callable[[optax.Params, Any], Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    with_stats: bool = False,
) -> Callable[[optax.Params, Any], tuple[Any, ...]]:
    """``jax.value_and_grad`` of a masked mean loss, one microbatch at a time.

    ``loss_fn(params, microbatch)`` returns the microbatch's mean loss and its
    token count ``nᵢ`` (as :func:`masked_mean` does). The returned function splits
    ``batch`` into ``k = num_microbatches`` microbatches, evaluates
    ``jax.value_and_grad`` on each in a ``lax`` loop inside the computation, and
    combines them with the token-weighted running mean (West 1979)::

        loss  = Σ nᵢ ℓᵢ / Σ nᵢ        grads = Σ nᵢ ∇ℓᵢ / Σ nᵢ        count = Σ nᵢ

    which is ``jax.value_and_grad`` of the full batch's masked mean loss (up to
    float rounding): exactly what one full-batch step would see, at the peak
    memory of one microbatch. The means are kept in at least float32 and returned
    in the dtypes ``loss_fn`` and its gradient have. Use it inside ``jit``; one
    call is one compiled loop, with no host round trips.

    Semantics:
      * Microbatch ``j`` is ``batch[j::k]`` (rows ``j, j + k, j + 2k, …`` of every
        leaf), the strided split of ``optax.microbatching``: a batch sharded over
        devices along its leading axis stays evenly sharded in every microbatch,
        so each loop step runs data-parallel on all devices with no resharding.
        The combined result does not depend on the split (only rounding does); to
        reproduce a microbatch on the host, take ``batch[j::k]``.
      * A microbatch whose count is not positive (``0``, and also negative or
        non-finite) contributes nothing, even if its mean loss and gradients are
        NaN (an all-masked microbatch gives ``0/0``). If no microbatch has tokens,
        loss, gradients and float ``aux`` are zeros and the count is ``0``.
      * ``aux`` (with ``has_aux=True``): floating leaves are token-weighted means
        over the microbatches, like the loss, so a metric computed as a masked
        mean over the same tokens (accuracy, say) is its full-batch value; integer
        leaves (counts of correct tokens, say) are summed. Other dtypes raise.
        Per-example outputs with a batch axis are not gathered: compute those in
        a separate forward pass.
      * The total ``count`` has the dtype of the per-microbatch counts.
      * ``with_stats=True`` also returns the call's :class:`WindowStats`, the
        statistics :class:`MaskedMultiSteps` keeps per window (the call is one
        window of ``k`` microbatches): tokens, microbatches with tokens, loss,
        ``‖ḡ‖²`` and the gradient noise scale ``B_simple`` with its parts. It
        costs one squared-norm reduction of each microbatch's gradient.
        ``smoothed_noise_scale`` is this call's ``noise_scale``; smooth over
        calls with :class:`MaskedMultiSteps` or your own moving average.

    Args:
      loss_fn: ``loss_fn(params, microbatch) -> (mean_loss, count)``, or
        ``(mean_loss, (count, aux))`` with ``has_aux=True``. ``mean_loss`` is a
        floating scalar; ``count`` an integer or floating scalar.
      num_microbatches: ``k``, a Python int >= 1 that divides the batch size.
      has_aux: whether ``loss_fn`` returns ``aux`` beside the count.
      with_stats: also return the call's :class:`WindowStats`.

    Returns:
      ``grad_fn(params, batch) -> ((loss, count), grads)``, or
      ``((loss, (count, aux)), grads)`` with ``has_aux=True``; with
      ``with_stats=True`` a third element, the :class:`WindowStats`. ``batch``
      is a pytree whose leaves share a leading batch axis; gradients are taken
      with respect to ``params``.

    Raises:
      TypeError: if ``loss_fn`` is not callable, ``num_microbatches`` is not an
        integer, ``has_aux`` or ``with_stats`` is not a bool, or (when called)
        ``loss_fn`` returns something other than the documented structure, a
        non-scalar or non-floating loss, or an ``aux`` leaf that is neither
        float nor integer.
      ValueError: if ``num_microbatches < 1``; when called, if ``batch`` has no
        leaves, a scalar leaf, leaves of different batch sizes, a batch size not
        divisible by ``num_microbatches``, or ``loss_fn``'s count is not a
        numeric scalar.

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
      5.0 4 2.5
      >>> (loss, count), grad = jax.value_and_grad(loss_fn, has_aux=True)(
      ...     jnp.array(2.0), batch)  # the full batch at once: the same values
      >>> print(loss, count, grad)
      5.0 4 2.5

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
    if not callable(loss_fn):
        raise TypeError(
            f"`loss_fn` must be callable, got {loss_fn!r} of type "
            f"{type(loss_fn).__name__}"
        )
    k = _check_num_microbatches(num_microbatches)
    if not isinstance(has_aux, bool):
        raise TypeError(f"`has_aux` must be a bool, got {has_aux!r}")
    if not isinstance(with_stats, bool):
        raise TypeError(f"`with_stats` must be a bool, got {with_stats!r}")

    def normalized_loss(params, microbatch):
        loss, count, aux = _check_output(loss_fn(params, microbatch), has_aux)
        return loss, (count, aux)

    value_and_grad = jax.value_and_grad(normalized_loss, has_aux=True)

    def per_microbatch(params, microbatch):
        (loss, (count, aux)), grads = value_and_grad(params, microbatch)
        return loss, count, aux, grads

    def grad_fn(params: optax.Params, batch: Any) -> tuple[Any, optax.Updates]:
        batch_size = _batch_size(batch, k)
        accumulator = _token_weighted_accumulator(has_aux, with_stats)
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

        def body(j, carry):
            return accumulator.update(carry, per_microbatch(params, microbatch(j)), j)

        with jax.named_scope("masked_multistep/microbatch"):
            carry = accumulator.init(
                jax.eval_shape(per_microbatch, params, microbatch(0))
            )
            return accumulator.finalize(jax.lax.fori_loop(0, k, body, carry))

    return grad_fn
