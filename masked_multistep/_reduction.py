"""How a window's mean is agreed across devices: the interface, and locally.

Data parallelism splits every microbatch over the devices of a mesh axis. Device
``d`` sees ``nᵈ`` of the microbatch's tokens and computes its own mean gradient
``gᵈ``. The full batch's token-mean gradient is ``Σ nᵈ gᵈ / Σ nᵈ``; since the
token-weighted mean is associative, it does not matter whether the devices are
combined on every microbatch and the results then accumulated over the window,
or each device accumulates its own running mean over the window and the devices
are combined once at its end::

    m_window = Σ_d (Nᵈ / N) · mᵈ        mᵈ = Σᵢ nᵢᵈ gᵢᵈ / Nᵈ,  Nᵈ = Σᵢ nᵢᵈ,  N = Σ_d Nᵈ

The second order costs one gradient-sized cross-device reduction per window
instead of one per microbatch. This module holds the combination over a leading
device axis (:func:`mean_over_devices`), the window's global figures
(:class:`WindowTotals`) and the default reduction :class:`MaskedMultiSteps`
uses, :class:`Local` (``reduction=None``: the gradients it receives are already
the microbatch's global mean). The deferred reductions, where each device's
gradients stay local and are combined once per window, are in ``_deferred``.
All have the same small interface, which the wrapper's state machine calls
without knowing the mode (it asks only ``device_axes``, for the shapes it
checks, and ``keeps_stats``, whether the statistics' sums are per device).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from masked_multistep import _checks
from masked_multistep._collectives import weighted_sum
from masked_multistep._placement import names_an_axis, resharded_as
from masked_multistep._running_mean import running_mean_update

__all__ = [
    "KnownTotals",
    "Local",
    "WindowTotals",
    "any_explicit",
    "check_mesh_axes",
    "mean_over_devices",
    "place_uncommitted",
    "check_on_mesh",
]


def place_uncommitted(state: Any, sharding: jax.sharding.Sharding) -> Any:
    """``state`` with its uncommitted leaves (the scalars ``init`` makes, the
    inner optimizer's step count) put where ``jit`` puts them after a step
    (``sharding``: replicated on the params' mesh, or their one device): else
    the first step's inputs differ from every later step's, and the step
    compiles twice. A traced ``init`` is left to its ``out_shardings``."""

    def leaf(x):
        if isinstance(x, jax.Array) and not getattr(x, "_committed", True):
            return _from_host(x, sharding)
        return x

    return jax.tree.map(leaf, state)


def through_key_data(place: Callable[[Any], jax.Array], x: Any) -> jax.Array:
    """``place(x)``; for a typed PRNG key (optax.noisy_sgd's state), which
    has no numpy form, its key data placed and wrapped again."""
    if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
        data = place(jax.random.key_data(x))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return place(x)


def _from_host(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` on ``sharding``, from each process's own copy (every process
    builds the same state): jax.device_put would compare them across
    processes, and the statistics' NaN placeholders never compare equal."""

    def place(x: Any) -> jax.Array:
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

    return through_key_data(place, x)


def placed_like(x: Any, like: Any) -> Any:
    """``x`` placed as ``like`` is, where ``like`` is a committed array and
    ``x`` a host array (numpy, a Python number) or an uncommitted one: a
    restored or converted state's leaves where ``tx.init`` puts them (a
    sharded accumulator stays sharded, not replicated whole on every device)."""
    if not (isinstance(like, jax.Array) and getattr(like, "_committed", False)):
        return x
    if isinstance(x, jax.core.Tracer) or (
        isinstance(x, jax.Array) and getattr(x, "_committed", True)
    ):
        return x
    if isinstance(x, (jax.Array, np.ndarray, np.generic, numbers.Number)):
        return _from_host(x, like.sharding)
    return x


def check_mesh_axes(
    mesh: Any, axis_name: Hashable | Sequence[Hashable], int_hint: str = ""
) -> tuple[tuple[Hashable, ...], int]:
    """``axis_name`` as a tuple of mesh axis names, and their total size ``D``.

    Raises ``TypeError`` if ``mesh`` is not a ``jax.sharding.Mesh`` and
    ``ValueError`` if an axis is not one of its axes, or is named twice, or
    the axes are of mixed types; with ``int_hint``, an integer that is no
    axis is a ``TypeError`` ending with ``int_hint.format(the_integer)``
    (what else it may be meant for). Axes may be ``AxisType.Auto`` or
    ``AxisType.Explicit``, all of one type: a batch split over Explicit and
    Auto axes together is a sharding that jax's ``reshard`` refuses.
    """
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh, got {type(mesh).__name__}"
        )
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not axes:
        raise ValueError("`axis_name` must name at least one mesh axis, got ()")
    for axis in axes:
        if axis not in mesh.axis_names:
            named = f"`axis_name` must name axes of the mesh {tuple(mesh.axis_names)}"
            if int_hint and _checks.is_host_int(axis):
                raise TypeError(f"{named}, got the int {axis}: {int_hint.format(axis)}")
            raise ValueError(f"{named}, got {axis!r}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"`axis_name` names an axis twice: {axes}")
    if any_explicit(mesh, axes) and not all_explicit(mesh, axes):
        types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
        raise ValueError(
            "`axis_name` must name data axes of one type, all "
            "AxisType.Explicit or all AxisType.Auto, got "
            f"{axes} of types {tuple(str(types[a]) for a in axes)}"
        )
    return axes, math.prod(mesh.shape[a] for a in axes)


def check_on_mesh(grads: Any, acc_grads: Any) -> None:
    """A ``ValueError`` where, under ``jax.set_mesh``, a leaf of the
    accumulator is on no mesh (a host array, as ``flax.serialization``
    restores a state) while its gradient is split over an
    ``AxisType.Explicit`` mesh axis: jax cannot combine the two there ("select
    cases must have the same shardings"), and the accumulator's layout is not
    known to put it anywhere. (Without a mesh set, jax combines them.)"""
    if jax.sharding.get_abstract_mesh().empty:
        return
    paths = jax.tree_util.tree_flatten_with_path(acc_grads)[0]
    for (path, acc), grad in zip(paths, jax.tree.leaves(grads), strict=False):
        have, want = jax.typeof(acc).sharding, jax.typeof(grad).sharding
        if have is None or want is None or not have.mesh.empty:
            continue
        if names_an_axis(want.spec):
            raise ValueError(
                f"`state.acc_grads{jax.tree_util.keystr(path)}` is on no mesh "
                f"while its gradient is split over it ({want.spec}), which "
                "jax cannot combine under `jax.set_mesh` (a state restored with "
                "flax.serialization holds host arrays; `tx.init` of params on "
                "no device builds one). Put it where the template's arrays "
                "are, e.g. "
                "`jax.device_put(restored, jax.tree.map(lambda x: x.sharding, "
                "template))` (orbax restores onto the template's shardings)"
            )


def any_explicit(mesh: Any, axes: Any) -> bool:
    """Whether one of ``axes`` is an ``AxisType.Explicit`` axis of ``mesh``
    (a ``Mesh`` or an ``AbstractMesh``)."""
    return any(map(_explicit_in(mesh), axes))


def all_explicit(mesh: Any, axes: Any) -> bool:
    """Whether every one of ``axes`` is an ``AxisType.Explicit`` axis of
    ``mesh`` (True for none)."""
    return all(map(_explicit_in(mesh), axes))


def _explicit_in(mesh: Any) -> Callable[[Any], bool]:
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    return lambda axis: types[axis] == jax.sharding.AxisType.Explicit


def mean_over_devices(
    tree: Any, counts: jax.Array, total: jax.Array | None = None
) -> tuple[Any, jax.Array]:
    """Token-weighted mean over a leading device axis: ``Σ_d (nᵈ/N)·xᵈ``, ``N``.

    ``tree``'s leaves and ``counts`` carry a leading axis of size ``D`` (one
    entry per device). The arithmetic of :func:`weighted_mean_across`
    (``_collectives.weighted_sum``) over that axis (float32, zero-safe: a
    device with ``nᵈ = 0`` contributes nothing even if its entries are NaN).
    Under ``jit`` with the leading axis sharded over a mesh axis, the compiler
    turns the sum into one cross-device reduction of the combined leaves.
    With ``total`` (``N``, already known to every device) the scalar
    reduction of the counts is skipped.
    """
    # A sum over the leading axis, not a `psum` under `vmap`: the same
    # reduction, which jax also accepts where that axis is sharded over an
    # AxisType.Explicit mesh axis (its sharding is part of the type there).
    if total is None:
        # As `weighted_mean_across` takes a shard's count: a float32 weight,
        # 0 where invalid (negative or non-finite: left out of the total).
        counts, _ = _checks.to_count(
            counts,
            jnp.dtype(jnp.float32),
            "the devices' counts",
            shape=tuple(counts.shape),
            dtype_name="float32, the weights' dtype",
        )
        total = jnp.sum(counts, axis=0)
    mean = weighted_sum(tree, counts, total, lambda x: jnp.sum(x, axis=0))
    return mean, total


class WindowTotals(NamedTuple):
    """A window's global figures, as :class:`MaskedMultiSteps` closes it.

    Attributes:
      tokens: the window's token total ``N`` (``count_dtype``; 0 if it could
        not be formed).
      value: the token-weighted mean of the ``value=`` arguments (float32).
      value_count: the tokens behind ``value``.
      num_invalid: invalid counts found only now (int32; 0 where every
        microbatch's counts were checked when it arrived).
      stats_sums: ``(Σ nᵢ‖gᵢ‖², K)`` of the window statistics (float32, int32)
        where the reduction keeps their per-device shares until the window
        closes (``keeps_stats``); ``()`` otherwise.
      overflowed: whether the window held tokens whose total could not be
        formed (``tokens`` is then 0), a boolean scalar; ``None`` where totals
        are formed as microbatches arrive (a count that does not fit closes
        the window it would overflow, which keeps its tokens).
    """

    tokens: jax.Array
    value: jax.Array
    value_count: jax.Array
    num_invalid: jax.Array
    stats_sums: Any = ()
    overflowed: Any = None


class KnownTotals:
    """For reductions whose microbatch counts are global when they arrive: the
    window's figures are the state's running ones, already agreed."""

    def place_inputs(self, grads: Any, acc_grads: Any) -> Any:
        """``grads`` sharded as the accumulator is where their types say
        otherwise (on a mesh with ``AxisType.Explicit`` axes): gradients laid
        out differently from the params (replicated, or stacked by hand with
        a device axis) meet the running means leaf by leaf, which jax refuses
        across two shardings. Under ``AxisType.Auto`` the types hold no
        sharding and the compiler places them itself: a no-op."""
        return jax.tree.map(resharded_as, grads, acc_grads)

    def eager_mesh(self, *inputs: Any) -> contextlib.AbstractContextManager:
        """The context a step on ``inputs`` runs in (none; see ``Deferred``'s)."""
        del inputs
        return contextlib.nullcontext()

    def traced_mesh(self) -> contextlib.AbstractContextManager:
        """The context this reduction's state is traced in, outside any step
        (none; see ``Deferred``'s)."""
        return contextlib.nullcontext()

    # The window statistics' running sums live in the statistics' state.
    keeps_stats = False
    # Leading (device) axes of the accumulator beyond the params' shape.
    device_axes = 0

    def accumulate_value(
        self, acc_value, value_count, reduction_state, value, n, local
    ):
        del local
        if value is not None:
            acc_value, value_count = running_mean_update(
                acc_value, value_count, value, n
            )
        return acc_value, value_count, reduction_state

    def close_totals(self, so_far: WindowTotals, reduction_state: Any) -> WindowTotals:
        del reduction_state
        return so_far


class Local(KnownTotals):
    """The gradients handed over are already the microbatch's global mean.

    The default reduction: whatever reduced the devices' gradients (the
    compiler, under ``jit`` with sharded arrays) did so before
    :class:`MaskedMultiSteps` saw them. The accumulation is the plain running
    mean, the counts follow the single-device contract of ``_checks``, and the
    rest is the identity (no per-device state, nothing to combine).
    """

    def __repr__(self) -> str:
        return "None"

    def init_accumulator(self, params: Any, leaf_dtype: Callable[[Any], Any]) -> Any:
        return jax.tree.map(lambda p: jnp.zeros_like(p, dtype=leaf_dtype(p)), params)

    def init(self, count_dtype: Any, num_leaves: int = 0) -> tuple:
        del count_dtype, num_leaves
        return ()

    def place(self, state: Any, params: Any) -> Any:
        """``state`` placed as a step returns it (:func:`place_uncommitted`):
        with params on one mesh (``NamedSharding``), its scalars replicated on
        that mesh; with params committed to one device, committed to it; as it
        is otherwise."""
        places, on_one_device = set(), None
        for x in jax.tree.leaves(params):
            if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
                continue
            if isinstance(x.sharding, NamedSharding):
                places.add(x.sharding.mesh)
            elif getattr(x, "_committed", False):
                places.update(x.devices())
                on_one_device = x.sharding
        if len(places) != 1:
            return state
        place = places.pop()
        if isinstance(place, jax.sharding.Mesh):
            return place_uncommitted(state, NamedSharding(place, PartitionSpec()))
        if on_one_device is None:  # (not reached: the one device is a parameter's)
            return state
        # A parameter's own sharding of its one device (jax 0.12 deprecates
        # naming `SingleDeviceSharding`).
        return place_uncommitted(state, on_one_device)

    def check_grads(self, grads: Any, acc_grads: Any) -> None:
        _checks.check_grads_match(grads, acc_grads, per_device=False)

    def to_count(self, count: Any, count_dtype: Any) -> tuple[Any, Any, None]:
        n, ok = _checks.to_count(count, count_dtype)
        return n, ok, None

    def value(self, value: Any, local_counts: Any, total: jax.Array) -> Any:
        del local_counts, total
        return _checks.check_value(value)

    def skip_view(self, grads: Any, local_counts: Any, total: jax.Array) -> Any:
        del local_counts, total
        return grads

    def accumulate(self, acc, acc_count, reduction_state, grads, n, local_counts):
        del local_counts
        acc, acc_count = running_mean_update(acc, acc_count, grads, n)
        return acc, acc_count, reduction_state

    def mean(self, acc: Any, acc_count: jax.Array, reduction_state: Any) -> Any:
        del acc_count, reduction_state
        return acc

    def reset(self, reduction_state: Any) -> Any:
        return reduction_state
