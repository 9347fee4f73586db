"""A zero-safe masked mean that also returns the count behind it."""

from __future__ import annotations

from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from masked_multistep._running_mean import compute_dtype, safe_fraction

__all__ = ["masked_mean"]


def _as_array(x: jax.typing.ArrayLike, what: str) -> tuple[jax.Array, np.dtype]:
    """``x`` as a jax array, and the dtype it came in.

    Without x64, ``jnp.asarray`` wraps 64-bit integers to 32 bits: a mask entry
    of 2**32 would be unset, values above 2**31 negative. Those are converted
    on the host instead, a mask to booleans (non-zero is set) and values to
    float32 (the dtype their mean is computed in).
    """
    try:
        host = None
        if isinstance(x, (np.ndarray, np.generic, int)):
            host = np.asarray(x)
        elif isinstance(x, (list, tuple)):
            try:  # Python numbers; a list of traced values goes to jnp below
                host = np.asarray(x)
            except (TypeError, ValueError):
                host = None
        if host is not None:
            if host.dtype.kind in "iu" and jax.dtypes.canonicalize_dtype(
                host.dtype
            ) != np.dtype(host.dtype):
                if what == "mask":
                    return jnp.asarray(host != 0), host.dtype
                return jnp.asarray(host.astype(np.float32)), host.dtype
        # (A float64 weight beyond float32 becomes inf here, without numpy's
        # warning: `masked_mean` names it from its host copy.)
        with np.errstate(over="ignore"):
            arr = jnp.asarray(x)
    except (TypeError, ValueError, OverflowError) as err:
        raise TypeError(
            f"`{what}` must be an array, got {x!r} of type {type(x).__name__}"
        ) from err
    return arr, arr.dtype


def _host_copy(x: Any) -> np.ndarray | None:
    """``x`` as a numpy array where it is concrete (a jax array outside a
    trace, numpy, Python numbers); ``None`` where it is traced. A numpy mask
    that a jitted function closes over is concrete, though ``jnp.asarray``
    makes it a tracer inside the trace: its weights are checked all the same."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except (TypeError, ValueError):
        return None  # a list holding traced values, or not an array at all


def masked_mean(
    values: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
) -> tuple[jax.Array, jax.Array]:
    """Mean of ``values`` over the entries where ``mask`` is set, and their count.

    ``mean = Σ mask·values / Σ mask`` (a boolean or integer mask counts each
    non-zero entry as one token), with ``mean = 0`` when nothing is set
    (never ``0/0``), and masked-out entries ignored even when they hold NaN or
    inf. The pair is exactly what ``MaskedMultiSteps.update`` takes: the
    microbatch's mean loss, and its token count as ``count``::

        def loss_fn(params, batch):  # per-token losses (B, T), mask (B, T)
            return mm.masked_mean(per_token_loss(params, batch), batch["mask"])

        (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, batch)
        updates, state = tx.update(grads, state, params, count=count)

    Args:
      values: per-token values (for example per-token losses), any float dtype.
      mask: ``values``' shape, or broadcastable to it with the same number of
        dimensions (or a scalar); a mask of lower rank is refused, since
        numpy's broadcasting would align it with ``values``' last axes. Every
        entry of the broadcast mask counts: a ``(B, T, 1)`` mask on
        ``(B, T, V)`` values counts ``V`` per position (pass per-token values
        of shape ``(B, T)`` to count tokens). Boolean or integer masks count
        tokens: every non-zero entry is one token (the count is ``int32``); a floating
        mask holds per-token weights (the count is their float sum). Weights
        must be finite and non-negative, as token counts are: a concrete mask
        (a jax array outside a trace, a numpy array or Python numbers, also
        where a jitted function closes over it) with a negative, NaN or
        infinite weight is a ``ValueError``, as is one with positive weights
        below float32's smallest normal number (1.2e-38, which XLA flushes to
        0: the microbatch would count as empty; a float64 count of a float64
        mask takes float64's); under
        ``jit`` weights that sum to 0 give the empty microbatch's ``(0, 0)``,
        and a negative weight (even where the sum is positive) or a
        non-finite one makes the count NaN or infinite, an invalid count for
        :class:`MaskedMultiSteps` (counted in ``num_invalid_counts`` and left
        out). The weighted sum ``Σ mask·values`` is formed in the mean's
        dtype: weights and values whose products sum beyond its range (500
        weights of 1e34 beside values of 300, in float32) make the mean
        infinite; scale such weights down (the mean does not depend on their
        scale, the count does). Weights computed from parameters (a learned
        soft mask) are differentiated as in ``Σ w·v / Σ w``, also at a weight
        of 0 (where the entry is finite).

    Returns:
      ``(mean, count)``: ``mean`` in ``values``' dtype promoted to at least
      float32; ``count`` a scalar, ``int32`` for boolean/integer masks, the
      real float dtype of the mean for floating masks. 64-bit integer numpy
      arrays and Python ints are read by value without x64 (a mask entry of
      ``2**32`` is one token, not zero).

    Raises:
      TypeError: if ``values`` is boolean or integer and ``mask`` floating (the
        two swapped, most likely; cast ``values`` to float for a weighted mean
        of booleans), ``values`` is not numeric (a PRNG key), or ``mask`` is
        complex.
      ValueError: if ``mask`` does not broadcast to ``values``' shape, has
        fewer dimensions than ``values`` (and is not a scalar), or is a
        concrete floating mask with a negative, NaN or infinite weight, a
        positive one below the count dtype's smallest normal number (or,
        for a float32 or bfloat16 mask of a float64 count, float32's), or
        weights that sum beyond the count dtype's range.

    Examples:
      >>> import jax.numpy as jnp
      >>> import masked_multistep as mm
      >>> loss, n = mm.masked_mean(jnp.array([1.0, 2.0, jnp.nan]),
      ...                          jnp.array([True, True, False]))
      >>> print(loss, n)
      1.5 2
      >>> print(*mm.masked_mean(jnp.ones(3), jnp.zeros(3, bool)))
      0.0 0
    """
    given = mask
    (values, values_dtype), (mask, _) = (
        _as_array(values, "values"),
        _as_array(mask, "mask"),
    )
    if 0 < mask.ndim < values.ndim:
        # numpy's broadcasting aligns the trailing axes: a per-sequence mask of
        # shape (B,) on values (B, T) would mask positions when B == T.
        raise ValueError(
            f"`mask` of shape {mask.shape} has fewer dimensions than `values` "
            f"of shape {values.shape}: it would broadcast along `values`' last "
            "axes (numpy's rule), so give it `values`' rank, adding the missing "
            "axes where they belong: for (sequences, positions) values, "
            "mask[:, None] for one entry per sequence, mask[None] for one per "
            "position. For (sequences, positions, classes) values, reduce over "
            "the classes first (a per-token loss of shape (sequences, "
            "positions) counts tokens); mask[..., None] would count every "
            "class as a token"
        )
    if not (
        jnp.issubdtype(values.dtype, jnp.bool_)
        or jnp.issubdtype(values.dtype, jnp.number)
    ):
        # A PRNG key or another extended dtype: no mean of it.
        raise TypeError(
            "`values` must be numeric (per-token values, such as losses), got "
            f"dtype {values.dtype}"
        )
    if not (
        jnp.issubdtype(mask.dtype, jnp.bool_)
        or jnp.issubdtype(mask.dtype, jnp.integer)
        or jnp.issubdtype(mask.dtype, jnp.floating)
    ):
        # A complex mask was read as booleans (0.5+0j counted one token).
        raise TypeError(
            "`mask` must be boolean, integer or real floating (per-token "
            f"weights), got dtype {mask.dtype}"
        )
    try:
        mask = jnp.broadcast_to(mask, values.shape)
    except ValueError as err:
        raise ValueError(
            f"`mask` of shape {mask.shape} does not broadcast to `values` of shape "
            f"{values.shape}"
        ) from err
    if jnp.issubdtype(mask.dtype, jnp.floating) and not jnp.issubdtype(
        values_dtype, jnp.inexact
    ):
        # What `masked_mean(mask, per_token_loss)` looks like: silently a mean
        # of the mask weighted by the losses, and their sum as the count.
        raise TypeError(
            f"`values` has dtype {values_dtype} and `mask` is floating "
            f"({mask.dtype}): were they swapped? The call is "
            "masked_mean(per_token_values, mask). For a weighted mean of "
            "booleans or integers (an accuracy), pass values.astype(jnp.float32)"
        )
    dtype = compute_dtype(values.dtype)
    if jnp.issubdtype(mask.dtype, jnp.floating) and (
        (given := _host_copy(given)) is not None
    ):
        # Weights are token counts: [-1, 1] would sum to an empty microbatch,
        # and a NaN or infinite weight make the mean and the count NaN. Checked
        # on the mask as given, not on its broadcast copy, on the host, in
        # float64 (a float64 weight of 1e39 is finite, and too large).
        given = given.astype(np.float64)
        non_finite = int(np.sum(~np.isfinite(given)))
        if non_finite:
            raise ValueError(
                f"`mask` holds {non_finite} non-finite weight(s) (NaN or "
                "infinite): a floating mask holds per-token weights, which count "
                "tokens and must be finite"
            )
        if bool(np.any(given < 0)):
            raise ValueError(
                "`mask` holds negative weights (its smallest is "
                f"{float(np.min(given))}): a floating mask holds per-token "
                "weights, which count tokens and must be non-negative"
            )
        # The count sums the broadcast weights, in the mean's real dtype.
        weight_sum = float(np.sum(given)) * (values.size / max(given.size, 1))
        count_dtype = jnp.finfo(dtype).dtype
        if weight_sum > float(jnp.finfo(count_dtype).max):
            raise ValueError(
                f"`mask`'s weights sum to {weight_sum:.4g}, beyond {count_dtype}'s "
                "range (the count's dtype): the count would be infinite"
            )
        # XLA flushes subnormal floats to zero, a float32 or bfloat16 mask's
        # too when it widens them for a float64 count (float16's subnormals
        # widen into float32's normal range): the microbatch would count as
        # empty, its mean 0, without a word.
        flushed = jnp.finfo(count_dtype)
        f32 = jnp.finfo(jnp.float32)
        if jnp.finfo(mask.dtype).smallest_normal <= f32.smallest_normal:
            flushed = max(flushed, jnp.finfo(mask.dtype), key=lambda f: f.tiny)
        tiny = float(flushed.smallest_normal)
        if bool(np.any((given > 0) & (given < tiny))):
            raise ValueError(
                "`mask` holds positive weights below the smallest normal "
                f"{flushed.dtype} ({tiny:.4g}; its smallest is "
                f"{float(np.min(given[given > 0])):.4g}), which XLA flushes to "
                "0: the microbatch would count as empty. Scale the weights up "
                "(the mean does not depend on their scale, the count does)"
            )
    values = values.astype(dtype)
    if jnp.issubdtype(mask.dtype, jnp.floating):
        # Real weights, and so a real count, for complex values too.
        weights = mask.astype(jnp.finfo(dtype).dtype)
        count = jnp.sum(weights)
        if isinstance(mask, jax.core.Tracer):
            # Unchecked above: a negative weight makes the count NaN (an
            # invalid count), even where the weights' sum is positive.
            count = jnp.where(jnp.any(weights < 0), jnp.nan, count)
        # A weight of 0 keeps its entry where the entry is finite: the mean's
        # derivative with respect to that weight is (value − mean) / Σ w (a
        # learned soft mask), which zeroing the entry would make −mean / Σ w.
        kept = (weights != 0) | jnp.isfinite(values)
    else:
        # A bool mask as it is (`mask != 0` would promote it).
        real = mask.astype(jnp.bool_)
        weights = real.astype(dtype)
        count = jnp.sum(real, dtype=jnp.int32)
        kept = real
    # `where` first: a NaN in a masked-out entry must not survive `NaN * 0`.
    total = jnp.sum(jnp.where(kept, values, 0) * weights)
    return safe_fraction(total, count).astype(dtype), count
