"""A window's close: the inner optimizer on the window's mean, the statistics
recorded, the counters advanced and the next window started empty.

:class:`WindowClose` holds what one step of :class:`MaskedMultiSteps` decided
before its window's conditional (the inner optimizer's plan, whether the
updates reuse the accumulator's buffer); its :meth:`~WindowClose.close` and
:meth:`~WindowClose.keep` are that conditional's two branches, over a
:class:`Carry` that the taken branch updates in place.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import optax

from masked_multistep import _inner, _stats
from masked_multistep._branch import in_place_cond
from masked_multistep._placement import resharded_as, tree_resharded_as, zeros_placed_as
from masked_multistep._reduction import WindowTotals
from masked_multistep._running_mean import all_finite
from masked_multistep._shards import check_inner_update, window_flag

__all__ = ["Carry", "Counters", "WindowClose", "add_counts", "window_mean"]


class Counters(NamedTuple):
    """The state's scalars that a window's close resets or advances, carried
    through the window's conditional (so that between window ends no select
    runs on them)."""

    mini_step: jax.Array  # the window's microbatches so far (0 once it closes)
    gradient_step: jax.Array
    num_invalid_counts: jax.Array
    num_nonfinite_windows: jax.Array
    updated: jax.Array  # whether this microbatch applied an inner update


class Carry(NamedTuple):
    """What the window's conditional updates in place where the window closes
    and passes through where it stays open."""

    # The accumulator, the inner state and, with `apply_params`, the params.
    in_place: tuple[Any, Any, Any]
    stats: Any  # the window statistics' state (`()` without them)
    so_far: WindowTotals  # the window's running totals
    counters: Counters
    reduction_state: Any


def add_counts(counter: jax.Array, n: jax.Array) -> jax.Array:
    """``counter + n`` for int32 counters, saturating at the int32 maximum."""
    room = jnp.iinfo(jnp.int32).max - counter
    return (counter + jnp.minimum(n.astype(jnp.int32), room)).astype(jnp.int32)


def window_value(totals: WindowTotals) -> jax.Array:
    """The window's token-weighted loss over the microbatches that passed one
    (NaN if none did), as the inner optimizer reads it."""
    return _stats.undefined_as_nan(totals.value, totals.value_count > 0)


def window_mean(
    reduction: Any, acc_grads: Any, tokens: jax.Array, reduction_state: Any, params: Any
) -> Any:
    """What the inner optimizer sees: the window's mean (with a deferred
    reduction, the devices' running means combined), laid out as ``params``
    on explicit mesh axes where a deferred reduction forms it replicated."""
    mean = reduction.mean(acc_grads, tokens, reduction_state)
    # A deferred reduction's mean, the devices' combined, is replicated; on
    # explicit mesh axes the inner optimizer gets it laid out as the params
    # (split over the data axis, FSDP), as a window's mean without one is,
    # beside its state laid out so.
    if not reduction.device_axes or params is None:
        return mean
    mean = tree_resharded_as(mean, params)
    if jax.tree.structure(mean) != jax.tree.structure(params):
        return mean
    # Outside `jit` on automatic axes, where the types hold no sharding: the
    # mean placed as its param, or the inner optimizer would build its state
    # in the mean's layout (a dimension split over the data and another axis
    # together came back split over the other alone, and adam's moments,
    # then the params, replicated over the data axis).
    return jax.tree.map(_placed_as_param, mean, params)


def _placed_as_param(mean: Any, param: Any) -> Any:
    """``mean`` (a concrete array) on ``param``'s devices and layout where
    the two differ on one mesh, both on this process's devices alone."""
    if isinstance(mean, jax.core.Tracer) or not isinstance(mean, jax.Array):
        return mean
    want, have = getattr(param, "sharding", None), mean.sharding
    if not (
        isinstance(want, jax.sharding.NamedSharding)
        and isinstance(have, jax.sharding.NamedSharding)
        and want.mesh == have.mesh
        and mean.is_fully_addressable
        and param.is_fully_addressable
    ) or want.is_equivalent_to(have, mean.ndim):
        return mean
    return jax.device_put(mean, want)


class WindowClose(NamedTuple):
    """One step's window conditional: :meth:`close` where the window closes,
    :meth:`keep` where it stays open."""

    reduction: Any  # `_reduction.Local` or `_deferred.Deferred`
    recorder: _stats.Recorder
    plan: _inner.WindowPlan  # what the inner update needs and returns
    # Whether the updates take the accumulator's buffer (`update`, where they
    # fit it), and whether the params are updated in place (`apply_gradients`).
    reuse_acc: bool
    apply_params: bool
    value_dtype: Any  # the dtype of the window's loss
    # Where `close_window=` alone closes the window (`None` without it).
    forced_only: jax.Array | None
    grads: Any  # the microbatch's gradients (placements, the mean's narrowing)

    def hold(self, in_place, mean, read_only_params, dynamic_args):
        """The output besides the state passed through: ``update``'s zeros,
        placed as the gradients are (or, where those carry a device axis, as
        the params are)."""
        del in_place, mean, dynamic_args
        if self.reuse_acc or self.apply_params:
            return ()
        return _zeros_placed_like(self.plan.updates_avals, self.grads, read_only_params)

    def run(self, in_place, mean, read_only_params, dynamic_args):
        """The inner optimizer's update on ``mean`` (``None``: the accumulator
        is the mean), and with ``apply_params`` the params'."""
        acc_grads, inner_state, own_params = in_place
        params = own_params if self.apply_params else read_only_params
        if mean is None:  # the accumulator is the mean
            mean = acc_grads
        updates, new_inner = self.plan.update(mean, inner_state, params, dynamic_args)
        check_inner_update(updates, mean, params, dynamic_args)
        # On explicit mesh axes, what this branch returns has the types the
        # other passes through: an inner state that keeps what it is given
        # (the window's mean, which a deferred reduction forms replicated)
        # where its `init` laid it out as the params, say.
        new_inner = tree_resharded_as(new_inner, inner_state)
        if self.reuse_acc:
            return (tree_resharded_as(updates, acc_grads), new_inner, ()), ()
        if self.apply_params:
            new_params = optax.apply_updates(params, updates)
            return (acc_grads, new_inner, tree_resharded_as(new_params, params)), ()
        return (acc_grads, new_inner, ()), _placed_like(
            updates, self.grads, read_only_params
        )

    def close(self, carry: Carry, read_only_params, dynamic_args):
        """The window's end: its global figures (with a deferred reduction that
        agrees only at the window's end, a scalar all-reduce) and its mean
        (with a deferred reduction, the one gradient-sized cross-device
        reduction of the window), the inner update where the mean holds
        tokens and is finite, the statistics, and the next window's start."""
        acc_grads = carry.in_place[0]
        totals = self.reduction.close_totals(carry.so_far, carry.reduction_state)
        has_tokens = totals.tokens > 0
        window_loss = window_value(totals).astype(self.value_dtype)
        dynamic_args = {**dynamic_args, "value": window_loss}
        mean = window_mean(
            self.reduction,
            acc_grads,
            totals.tokens,
            carry.reduction_state,
            carry.in_place[2] if self.apply_params else read_only_params,
        )
        # ‖ḡ‖² for the statistics (`()` without them), read before the
        # inner optimizer overwrites the mean. (A window without tokens
        # has no mean: its norm is not used, nor differentiated.)
        # (Inside shard_map, the window's figures tell split parameters'
        # slices from shards of their own: see `_shards`.)
        figures = (has_tokens, window_loss)
        mean_sq_norm = self.recorder.read_mean(mean, window_flag(has_tokens, figures))
        # A non-finite mean never reaches the inner optimizer: a stateful
        # one (adam's moments) would carry the NaN into every later update.
        finite = all_finite(mean, self.recorder.total(mean_sq_norm), figures)
        if narrowed := _inner.narrowed(mean, self.grads):
            # Cast to the gradients' narrower dtype (a flush with float16
            # zeros after float32 gradients), a finite mean may overflow.
            finite = finite & all_finite(narrowed, (), figures)
        if self.plan.needs_value:
            finite = finite & jnp.isfinite(window_loss)
        # Where the mean is the accumulator itself, `run` reads it from the
        # state it updates (one buffer, not two names for it).
        same = _same_buffers(mean, acc_grads)
        updated = has_tokens & finite
        in_place, out = in_place_cond(
            updated,
            self.run,
            self.hold,
            carry.in_place,
            None if same else mean,
            read_only_params,
            dynamic_args,
        )
        # The window's statistics (`()` without them), recorded only where
        # a window closes, not on every microbatch.
        stats = self.recorder.close(
            carry.stats,
            tokens=totals.tokens,
            mean_sq_norm=mean_sq_norm,
            loss=totals.value,
            loss_tokens=totals.value_count,
            sums=totals.stats_sums,
        )
        if self.forced_only is not None:
            # A window that `close_window=` alone closes without tokens
            # (the data ended on a window's boundary) completes no window:
            # the last one's statistics stay readable. (One whose tokens
            # a deferred reduction could not total held tokens: it
            # completes, dropped, as its rule would close it.)
            discard = self.forced_only & ~has_tokens
            if totals.overflowed is not None:
                discard = discard & ~totals.overflowed
            stats = jax.tree.map(
                lambda kept, closed: jnp.where(discard, kept, closed),
                carry.stats,
                stats,
            )
        before = carry.counters
        counters = Counters(
            mini_step=jnp.zeros_like(before.mini_step),
            gradient_step=jnp.where(
                updated,
                optax.safe_increment(before.gradient_step),
                before.gradient_step,
            ),
            num_invalid_counts=add_counts(
                before.num_invalid_counts, totals.num_invalid
            ),
            num_nonfinite_windows=jnp.where(
                has_tokens & ~finite,
                optax.safe_increment(before.num_nonfinite_windows),
                before.num_nonfinite_windows,
            ),
            updated=updated,
        )
        # The next window starts empty.
        return Carry(
            in_place,
            stats,
            jax.tree.map(jnp.zeros_like, carry.so_far),
            counters,
            self.reduction.reset(carry.reduction_state),
        ), out

    def keep(self, carry: Carry, read_only_params, dynamic_args):
        """The window stays open: the state passes through, and the output
        besides it is :meth:`hold`'s."""
        return self.hold(carry.in_place, None, read_only_params, dynamic_args)


def _placements(avals: Any, *likes: Any) -> list[Any]:
    """For each leaf of ``avals``, the leaf in its place of the first of
    ``likes`` whose tree matches and whose leaf there has its shape, or
    ``None``: where ``update``'s updates are placed (the gradients, or, where
    those carry a device axis, the params)."""
    structure = jax.tree.structure(avals)
    likes = tuple(t for t in likes if jax.tree.structure(t) == structure)
    leaves = [structure.flatten_up_to(t) for t in likes]
    return [
        next((xs[i] for xs in leaves if jnp.shape(xs[i]) == jnp.shape(aval)), None)
        for i, aval in enumerate(jax.tree.leaves(avals))
    ]


def _zeros_placed_like(avals: Any, *likes: Any) -> Any:
    """Zeros of ``avals``, each placed as its leaf of :func:`_placements` (an
    eager step's zeros would otherwise land on the default device, not the
    gradients' or the params'; under ``jit`` the same program), also where
    jax 0.12 would not split them (:func:`zeros_placed_as`: the window's
    branches then agreed on a replicated output)."""
    places = _placements(avals, *likes)
    zeros = [
        jnp.zeros_like(aval, dtype=aval.dtype)
        if like is None
        else zeros_placed_as(like, aval.dtype)
        for aval, like in zip(jax.tree.leaves(avals), places, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(avals), zeros)


def _placed_like(updates: Any, *likes: Any) -> Any:
    """``updates`` with the shardings, on explicit mesh axes, of the leaves
    :func:`_zeros_placed_like` places its zeros as: an inner optimizer that
    keeps no state of its parameters' layout (``optax.sgd``) returns the
    window mean's, which can differ (a deferred reduction's mean, replicated,
    of params split over the data axis), and the window's two branches must
    agree."""
    placed = [
        u if like is None else resharded_as(u, like)
        for u, like in zip(
            jax.tree.leaves(updates), _placements(updates, *likes), strict=True
        )
    ]
    return jax.tree.unflatten(jax.tree.structure(updates), placed)


def _same_buffers(a: Any, b: Any) -> bool:
    """Whether two trees hold the very same arrays (traced values), leaf by leaf."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x is y for x, y in zip(la, lb))
