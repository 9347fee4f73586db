"""The window statistics' state: what it holds, how it is packed, and the
:class:`WindowStats` read from it.

The statistics' scalars are packed into three vectors (float32 sums, int32
tallies, token totals in the count dtype: :class:`WindowStatsState`, the
figures by name through :data:`SLOTS`), and each leaf's shares into one array
(:class:`LeafSums`): every array of a jitted call's arguments costs the host
some work on each call. Their arithmetic is ``_stats``'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

import jax
import jax.numpy as jnp

from masked_multistep._sq_norms import gpu_forms
from masked_multistep._token_total import TokenTotal

__all__ = [
    "PER_GROUP",
    "SLOTS",
    "LastWindow",
    "LeafSums",
    "WindowStats",
    "WindowStatsState",
    "each_leaf",
    "init_window_stats",
    "packed",
    "with_groups",
]

_F32 = jnp.float32


# What one of the per-group figures is: an array (the window's), a pytree
# shaped like the params (each leaf's) or a dict by label (each group's).
_Figure = TypeVar("_Figure")


class WindowStats(NamedTuple, Generic[_Figure]):
    """Statistics of the last completed window (the estimators are explained in
    the README's "Window statistics and the critical batch size").

    ``mm.window_stats(state)`` gives the window's (``WindowStats[jax.Array]``);
    with ``per_leaf=True`` or ``groups=`` the fields from ``grad_sq_norm`` to
    ``smoothed_noise_scale`` are each leaf's (a pytree shaped like the
    params) or each group's (a ``dict`` by label), the others the window's.

    Attributes:
      tokens: ``N``, the window's token total (the count dtype).
      microbatches: ``K``, its microbatches with a positive count (int32).
      loss: token-weighted mean of ``value`` over the window's microbatches that
        passed one (NaN when none did).
      grad_sq_norm: ``‖ḡ‖²``, the squared norm of the window's mean gradient
        (NaN when ``N == 0``).
      grad_var_trace: ``tr Σ̂ = S / (K − 1)`` (NaN when ``K < 2``).
      true_grad_sq_norm: ``|G|²̂ = ‖ḡ‖² − tr Σ̂ / N`` (NaN when ``K < 2``); may
        be negative when the noise swamps the signal.
      noise_scale: ``B_simple = tr Σ̂ / |G|²̂`` in tokens; NaN when undefined
        (``K < 2``, or ``|G|²̂ <= 0``: this window cannot resolve the gradient
        from its noise).
      smoothed_noise_scale: the ratio of exponential moving averages of
        ``tr Σ̂`` and ``|G|²̂`` over windows (NaN until a window has a finite
        estimate, or while the averaged ``|G|²̂ <= 0``).
      tokens_seen: the tokens of all completed windows, a :class:`TokenTotal`.
      windows: the number of completed windows (int32, saturating), with an
        inner update or without one: a window of empty microbatches, a
        non-finite one, or one a deferred reduction dropped (its combined
        total beyond ``count_dtype``) counts too, its ``tokens`` and
        ``microbatches`` 0 for the two without tokens.

    Examples:
      A window of 3 tokens with mean gradient 1 (loss 2) and 1 token with
      mean gradient 5 (loss 6): ``ḡ = 2``, ``S = 3·1 + 1·9 = 12``:

      >>> import jax.numpy as jnp, optax
      >>> import masked_multistep as mm
      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, window_stats=True)
      >>> params = jnp.zeros(())
      >>> state = tx.init(params)
      >>> for g, n, loss in [(1.0, 3, 2.0), (5.0, 1, 6.0)]:
      ...     _, state = tx.update(jnp.array(g), state, params,
      ...                          count=jnp.array(n), value=jnp.array(loss))
      >>> stats = mm.window_stats(state)
      >>> float(stats.tokens), int(stats.microbatches), float(stats.loss)
      (4.0, 2, 3.0)
      >>> float(stats.grad_sq_norm), float(stats.grad_var_trace)
      (4.0, 12.0)
      >>> float(stats.true_grad_sq_norm), float(stats.noise_scale)  # 4 − 12/4
      (1.0, 12.0)
    """

    tokens: jax.Array
    microbatches: jax.Array
    loss: jax.Array
    grad_sq_norm: _Figure
    grad_var_trace: _Figure
    true_grad_sq_norm: _Figure
    noise_scale: _Figure
    smoothed_noise_scale: _Figure
    tokens_seen: TokenTotal
    windows: jax.Array


# The fields of a :class:`WindowStats` that are each leaf's or each group's in
# a read of the leaves' shares (the others are the window's).
PER_GROUP = (
    "grad_sq_norm",
    "grad_var_trace",
    "true_grad_sq_norm",
    "noise_scale",
    "smoothed_noise_scale",
)


def with_groups(stats: WindowStats[Any], arrange: Any) -> WindowStats[Any]:
    """``stats`` (a read of the leaves' shares) with each :data:`PER_GROUP`
    vector arranged by ``arrange`` (into a tree like the params, a ``dict``
    by label)."""
    return stats._replace(**{name: arrange(getattr(stats, name)) for name in PER_GROUP})


def each_leaf(
    tree: Any, read: Callable[[tuple[int, ...]], WindowStats[Any]]
) -> WindowStats[Any]:
    """Each leaf of ``tree``'s statistics, ``read`` with one group per leaf,
    the :data:`PER_GROUP` fields arranged like ``tree``."""
    leaves, treedef = jax.tree.flatten(tree)
    return with_groups(
        read(tuple(range(len(leaves)))),
        lambda x: jax.tree.unflatten(treedef, list(x)),
    )


class LastWindow(NamedTuple):
    """What the last completed window leaves in the state: its totals and sums,
    from which :func:`read_window_stats` derives the :class:`WindowStats`.

    The state holds no NaN of its own: a figure the window does not define is
    0 here (``loss`` without ``loss_tokens``, ``grad_sq_norm`` and
    ``sq_deviation`` without ``tokens``), and the estimators' NaN are made
    where they are read. A window with a non-finite gradient keeps its
    non-finite ``grad_sq_norm`` and ``sq_deviation``.

    Attributes:
      tokens: ``N``, the window's token total (the count dtype).
      microbatches: ``K``, its microbatches with a positive count (int32).
      loss: token-weighted mean of ``value`` over the microbatches that passed
        one (float32; 0 where ``loss_tokens`` is).
      loss_tokens: the tokens behind ``loss`` (the count dtype).
      grad_sq_norm: ``‖ḡ‖²`` (float32; 0 where ``tokens`` is).
      sq_deviation: ``S = Σ nᵢ ‖gᵢ − ḡ‖²`` (float32; 0 where ``tokens`` is).
      tokens_seen: the tokens of all completed windows.
      windows: the number of completed windows (int32, saturating).
    """

    tokens: jax.Array
    microbatches: jax.Array
    loss: jax.Array
    loss_tokens: jax.Array
    grad_sq_norm: jax.Array
    sq_deviation: jax.Array
    tokens_seen: TokenTotal
    windows: jax.Array


class LeafSums(NamedTuple):
    """Each parameter leaf's share of the window statistics (with
    ``per_leaf_stats=True``): five float32 figures per leaf of the params, in
    ``jax.tree.leaves`` order, packed into one array (one array of a jitted
    call's arguments costs the host as much as a scalar, see
    :class:`WindowStatsState`) and read by name through the properties below.
    The statistics' sums are sums over the leaves, so each group of leaves has
    its own ``S``, ``‖ḡ‖²`` and estimators (:func:`read_leaf_stats`), and the
    window's totals are these summed.

    Attributes:
      shares: float32, shape ``(5, L)`` for ``L`` leaves (a state batched by
        ``jax.vmap`` has the batch's axes first), one row per figure:

    - ``weighted_sq_norms``: ``Σ nᵢ ‖gᵢ,ₗ‖²`` over the current window.
    - ``grad_sq_norm``: ``‖ḡₗ‖²`` of the last completed window (0 without
      tokens).
    - ``sq_deviation``: ``Sₗ = Σ nᵢ ‖gᵢ,ₗ − ḡₗ‖²`` of the last completed window.
    - ``ema_grad_var_trace``: moving average of ``tr Σ̂ₗ`` (not debiased; the
      window's ``ema_weight`` debiases it).
    - ``ema_true_grad_sq_norm``: moving average of ``|Gₗ|²̂`` (not debiased).

    Examples:
      >>> import jax.numpy as jnp
      >>> from masked_multistep._stats_state import LeafSums
      >>> sums = LeafSums.packed(weighted_sq_norms=jnp.array([1.0, 2.0]))
      >>> print(sums.weighted_sq_norms, sums.shares.shape)
      [1. 2.] (5, 2)
      >>> print(sums.replaced(sq_deviation=jnp.array([3.0, 4.0])).sq_deviation)
      [3. 4.]
    """

    shares: jax.Array

    FIGURES = (
        "weighted_sq_norms",
        "grad_sq_norm",
        "sq_deviation",
        "ema_grad_var_trace",
        "ema_true_grad_sq_norm",
    )

    @property
    def weighted_sq_norms(self) -> jax.Array:
        return self._row("weighted_sq_norms")

    @property
    def grad_sq_norm(self) -> jax.Array:
        return self._row("grad_sq_norm")

    @property
    def sq_deviation(self) -> jax.Array:
        return self._row("sq_deviation")

    @property
    def ema_grad_var_trace(self) -> jax.Array:
        return self._row("ema_grad_var_trace")

    @property
    def ema_true_grad_sq_norm(self) -> jax.Array:
        return self._row("ema_true_grad_sq_norm")

    def _row(self, name: str) -> jax.Array:
        return self.shares[..., self.FIGURES.index(name), :]

    @classmethod
    def packed(cls, **figures: jax.typing.ArrayLike) -> LeafSums:
        """The leaves' figures by name, in float32 (an absent one 0: of the
        shape of those given, at least one)."""
        unknown = set(figures) - set(cls.FIGURES)
        if unknown:
            raise TypeError(f"no figure named {sorted(unknown)} in the leaf sums")
        arrays = {name: jnp.asarray(x, _F32) for name, x in figures.items()}
        shape = jnp.broadcast_shapes(*(a.shape for a in arrays.values()))
        rows = [
            jnp.broadcast_to(arrays[name], shape)
            if name in arrays
            else jnp.zeros(shape, _F32)
            for name in cls.FIGURES
        ]
        return cls(jnp.stack(rows, axis=-2))

    def replaced(self, **figures: jax.typing.ArrayLike) -> LeafSums:
        """These sums with the named figures replaced (the properties'
        names), the others as they are: only the rows replaced are written,
        in place."""
        shares = self.shares
        for name, value in figures.items():
            if name not in self.FIGURES:
                raise TypeError(f"no figure named {name!r} in the leaf sums")
            row = jnp.asarray(value).astype(_F32)[..., None, :]
            shares = _with_entry(shares, self.FIGURES.index(name), row, axis=-2)
        return LeafSums(shares)


class WindowStatsState(NamedTuple):
    """The statistics' part of the wrapper's state: its scalars packed into
    three vectors (float32, int32 and the count dtype), and read by name
    through the properties below.

    Every array of a jitted call's arguments and results costs the host some
    work on each call (about 1.8 µs on the host of an H100): three vectors
    instead of fourteen scalars keep the statistics' share of a short step
    small. Build one with :func:`init_window_stats`; change its figures with
    :meth:`replaced`.

    Attributes:
      sums: float32, shape ``(9,)``: ``weighted_sq_norms``,
        ``ema_grad_var_trace``, ``ema_true_grad_sq_norm``, ``ema_weight``, and
        the last window's ``loss``, ``grad_sq_norm``, ``sq_deviation`` and
        ``tokens_seen`` (its ``hi`` and ``lo``).
      tallies: int32, shape ``(3,)``: ``microbatches``, and the last window's
        ``microbatches`` and ``windows``.
      counts: the count dtype, shape ``(2,)``: the last window's ``tokens``
        and ``loss_tokens``.
      leaves: with ``per_leaf_stats=True``, each parameter leaf's share
        (:class:`LeafSums`); ``()`` otherwise.

    The figures (properties; a state batched by ``jax.vmap`` has them batched
    alike):

    - ``weighted_sq_norms``: ``Σ nᵢ ‖gᵢ‖²`` over the current window (float32).
    - ``microbatches``: ``K`` of the current window (int32). Both stay 0 where
      a deferred reduction agrees on the window only at its end: every
      device's share is then in the wrapper's ``reduction_state``.
    - ``ema_grad_var_trace``: moving average of ``tr Σ̂`` (not debiased).
    - ``ema_true_grad_sq_norm``: moving average of ``|G|²̂`` (not debiased).
    - ``ema_weight``: ``1 − decayᵗ`` after ``t`` averaged windows, the
      debiasing divisor.
    - ``last``: the :class:`LastWindow` of the last completed window; read its
      :class:`WindowStats` with :func:`read_window_stats`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from masked_multistep._stats_state import init_window_stats
      >>> state = init_window_stats().replaced(microbatches=jnp.int32(2))
      >>> print(state.microbatches, state.tallies, state.last.windows)
      2 [2 0 0] 0
    """

    sums: jax.Array
    tallies: jax.Array
    counts: jax.Array
    leaves: LeafSums | tuple[()] = ()

    @property
    def weighted_sq_norms(self) -> jax.Array:
        return self._figure("weighted_sq_norms")

    @property
    def microbatches(self) -> jax.Array:
        return self._figure("microbatches")

    @property
    def ema_grad_var_trace(self) -> jax.Array:
        return self._figure("ema_grad_var_trace")

    @property
    def ema_true_grad_sq_norm(self) -> jax.Array:
        return self._figure("ema_true_grad_sq_norm")

    @property
    def ema_weight(self) -> jax.Array:
        return self._figure("ema_weight")

    @property
    def last(self) -> LastWindow:
        figure = self._figure
        return LastWindow(
            tokens=figure("last.tokens"),
            microbatches=figure("last.microbatches"),
            loss=figure("last.loss"),
            loss_tokens=figure("last.loss_tokens"),
            grad_sq_norm=figure("last.grad_sq_norm"),
            sq_deviation=figure("last.sq_deviation"),
            tokens_seen=TokenTotal(
                figure("last.tokens_seen.hi"), figure("last.tokens_seen.lo")
            ),
            windows=figure("last.windows"),
        )

    def _figure(self, name: str) -> jax.Array:
        vector, index = SLOTS[name]
        return getattr(self, vector)[..., index]

    def plus(
        self,
        weighted_sq_norms: jax.typing.ArrayLike,
        microbatches: jax.typing.ArrayLike,
        where: jax.typing.ArrayLike = True,
    ) -> WindowStatsState:
        """This state with the open window's ``weighted_sq_norms`` and
        ``microbatches`` increased by these where ``where`` (elsewhere, and
        every other figure, exactly as they were): what every microbatch
        does, in the pass of the figures' arithmetic on CPUs and GPUs alike
        (read through the properties and set with :meth:`replaced`, each
        figure was a kernel of its own on a GPU).

        Where programs take the forms traced for GPUs
        (:func:`_sq_norms.gpu_forms`), each vector is rewritten whole, an
        elementwise select of its entry plus the value: sliced and written
        back in place, jax 0.12's XLA:GPU copied each vector first, two
        kernels more per microbatch (six with the norm test). Elsewhere the
        entry is written in place, which XLA:CPU fuses with each leaf's
        squared-norm reduction (rewritten whole, the reductions are three
        kernels more per microbatch there)."""
        whole = gpu_forms()

        def added(
            vector: jax.Array, name: str, value: jax.typing.ArrayLike
        ) -> jax.Array:
            i = SLOTS[name][1]
            value = jnp.asarray(value).astype(vector.dtype)[..., None]
            where_ = jnp.asarray(where)[..., None]
            if whole:
                at = jax.lax.broadcasted_iota(jnp.int32, vector.shape, vector.ndim - 1)
                return jnp.where((at == i) & where_, vector + value, vector)
            old = jax.lax.slice_in_dim(vector, i, i + 1, axis=-1)
            return _with_entry(vector, i, jnp.where(where_, old + value, old))

        return self._replace(
            sums=added(self.sums, "weighted_sq_norms", weighted_sq_norms),
            tallies=added(self.tallies, "microbatches", microbatches),
        )

    def with_tokens_seen(self, seen: TokenTotal) -> WindowStatsState:
        """This state with the tokens of all completed windows set to
        ``seen``."""
        return self.replaced(last=self.last._replace(tokens_seen=seen))

    def replaced(self, **figures: Any) -> WindowStatsState:
        """This state with the named figures replaced (the properties' names,
        ``last`` a whole :class:`LastWindow`, and ``leaves``), the others as
        they are: only the entries replaced are written. A vector whose
        every entry is replaced takes the values' dtype where it follows the
        counts' (``counts``)."""
        leaves = figures.pop("leaves", self.leaves)
        flat = {}
        for name, value in figures.items():
            if name == "last":
                flat.update(_last_figures(value))
            elif name in SLOTS and not name.startswith("last."):
                flat[name] = value
            else:
                raise TypeError(f"no figure named {name!r} in the statistics")
        vectors = {}
        for vector in ("sums", "tallies", "counts"):
            old = getattr(self, vector)
            entries = {
                SLOTS[name][1]: value
                for name, value in flat.items()
                if SLOTS[name][0] == vector
            }
            if len(entries) == _SIZES[vector]:
                vectors[vector] = _stacked_figures(
                    [entries[i] for i in range(_SIZES[vector])],
                    None if vector == "counts" else old.dtype,
                )
            else:
                for i, value in sorted(entries.items()):
                    value = jnp.asarray(value).astype(old.dtype)[..., None]
                    old = _with_entry(old, i, value)
                vectors[vector] = old
        return WindowStatsState(**vectors, leaves=leaves)


# Where each figure of a `WindowStatsState` lies: its vector, and its index
# there (the open window's two sums, which conversions move, first).
SLOTS = {
    "weighted_sq_norms": ("sums", 0),
    "ema_grad_var_trace": ("sums", 1),
    "ema_true_grad_sq_norm": ("sums", 2),
    "ema_weight": ("sums", 3),
    "last.loss": ("sums", 4),
    "last.grad_sq_norm": ("sums", 5),
    "last.sq_deviation": ("sums", 6),
    "last.tokens_seen.hi": ("sums", 7),
    "last.tokens_seen.lo": ("sums", 8),
    "microbatches": ("tallies", 0),
    "last.microbatches": ("tallies", 1),
    "last.windows": ("tallies", 2),
    "last.tokens": ("counts", 0),
    "last.loss_tokens": ("counts", 1),
}
_SIZES = {"sums": 9, "tallies": 3, "counts": 2}


def _with_entry(
    vector: jax.Array, i: int, entry: jax.Array, axis: int = -1
) -> jax.Array:
    """``vector`` with its entry ``i`` along ``axis`` set to ``entry`` (that
    axis of size 1), written in place.

    jax updates a slice only within one mesh: a vector on no mesh (a state
    built on params placed nowhere, or restored to the host) beside figures
    computed on the mesh of `jax.set_mesh` takes an elementwise select
    instead, which combines the two."""
    if _mesh_of(vector) == _mesh_of(entry):
        return jax.lax.dynamic_update_slice_in_dim(vector, entry, i, axis=axis)
    at = jnp.expand_dims(jnp.arange(vector.shape[axis]) == i, range(axis + 1, 0))
    return jnp.where(at, entry, vector)


def _mesh_of(x: jax.Array) -> Any:
    sharding = jax.typeof(x).sharding
    return None if sharding is None else sharding.mesh


def _last_figures(last: LastWindow) -> dict[str, Any]:
    """The figures of ``last``, named as :data:`SLOTS` names them."""
    figures = {f"last.{name}": getattr(last, name) for name in LastWindow._fields}
    seen = figures.pop("last.tokens_seen")
    figures["last.tokens_seen.hi"], figures["last.tokens_seen.lo"] = seen
    return figures


def _stacked_figures(values: list[Any], dtype: Any) -> jax.Array:
    """``values`` along a last axis, in ``dtype`` (``None``: their own)."""
    arrays = [jnp.asarray(v) for v in values]
    dtype = jnp.result_type(*arrays) if dtype is None else dtype
    return jnp.stack([a.astype(dtype) for a in arrays], axis=-1)


def packed(
    *,
    weighted_sq_norms: jax.typing.ArrayLike,
    microbatches: jax.typing.ArrayLike,
    ema_grad_var_trace: jax.typing.ArrayLike,
    ema_true_grad_sq_norm: jax.typing.ArrayLike,
    ema_weight: jax.typing.ArrayLike,
    last: LastWindow,
    leaves: LeafSums | tuple[()] = (),
) -> WindowStatsState:
    """A :class:`WindowStatsState` of these figures (float32 and int32 but
    for the last window's token counts, which keep their dtype)."""
    empty = WindowStatsState(
        jnp.zeros([9], _F32), jnp.zeros([3], jnp.int32), jnp.zeros([2]), ()
    )
    return empty.replaced(
        weighted_sq_norms=weighted_sq_norms,
        microbatches=microbatches,
        ema_grad_var_trace=ema_grad_var_trace,
        ema_true_grad_sq_norm=ema_true_grad_sq_norm,
        ema_weight=ema_weight,
        last=last,
        leaves=leaves,
    )


def init_window_stats(
    count_dtype: jax.typing.DTypeLike = _F32, num_leaves: int | None = None
) -> WindowStatsState:
    """The state before any microbatch: no window completed (all zeros).

    Args:
      count_dtype: the dtype of token counts (of ``WindowStats.tokens``).
      num_leaves: with each parameter leaf's share (:class:`LeafSums`), the
        number of leaves of the params; ``None`` keeps the totals only.

    Examples:
      >>> from masked_multistep._stats import read_window_stats
      >>> from masked_multistep._stats_state import init_window_stats
      >>> state = init_window_stats()
      >>> stats = read_window_stats(state)
      >>> print(stats.noise_scale, float(stats.tokens_seen), int(stats.windows))
      nan 0.0 0
    """
    leaves: LeafSums | tuple[()] = ()
    if num_leaves is not None:
        leaves = LeafSums(jnp.zeros([len(LeafSums.FIGURES), num_leaves], _F32))
    return WindowStatsState(
        sums=jnp.zeros([9], _F32),
        tallies=jnp.zeros([3], jnp.int32),
        counts=jnp.zeros([2], count_dtype),
        leaves=leaves,
    )
