"""The deferred reductions: each device's running mean, combined once per window.

With ``reduction=mm.deferred(mesh, axis_name)`` the gradients and counts handed
to :class:`MaskedMultiSteps` are every device's own, stacked along a leading
axis of size ``D`` sharded over the mesh axis. Each device accumulates its own
running mean (no cross-device traffic) and the window's end combines them,
token-weighted, with one gradient-sized all-reduce (``_reduction``'s
:func:`mean_over_devices`). Two variants, chosen by the wrapper:
:class:`Deferred` agrees on every microbatch's global count as it arrives (what
token budgets and skip functions need);
:class:`DeferredPerWindow` agrees on the window's figures only at its end, so a
step between window ends communicates nothing.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from masked_multistep import _checks, _running_mean
from masked_multistep._branch import staging
from masked_multistep._placement import (
    names_an_axis,
    spec_axes,
    trimmed,
    without_axes,
)
from masked_multistep._reduction import (
    KnownTotals,
    WindowTotals,
    all_explicit,
    any_explicit,
    check_mesh_axes,
    mean_over_devices,
    place_uncommitted,
)
from masked_multistep._running_mean import (
    compute_dtype,
    running_mean_update,
    safe_fraction,
)
from masked_multistep._stats import device_shares, sum_over_devices

__all__ = [
    "Deferred",
    "DeferredPerWindow",
    "DeferredState",
    "DeferredWindowState",
    "deferred",
]


class DeferredState(NamedTuple):
    """The per-device part of a deferred window (``state.reduction_state``).

    Attributes:
      counts: shape ``(D,)``, sharded over the mesh axis: each device's token
        total ``Nᵈ`` behind its running mean in ``acc_grads[d]``.
    """

    counts: jax.Array


def _sharding_of(leaf: Any) -> Any:
    """``leaf``'s ``NamedSharding``, if it has one: its placement, or under
    ``jit`` the sharding its type holds on explicit axes."""
    if isinstance(leaf, jax.core.Tracer):
        sharding = jax.typeof(leaf).sharding
        named = sharding is not None and names_an_axis(sharding.spec)
        return sharding if named else None
    sharding = getattr(leaf, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


def _zeros_on(shape: tuple, dtype: Any, sharding: NamedSharding) -> jax.Array:
    """Zeros laid out by ``sharding``, also under ``jit`` (``jax.jit(tx.init)``),
    where ``jnp.zeros``' ``device=`` is ignored: there the layout is imposed, as
    a reshard on ``AxisType.Explicit`` axes (part of the type) and as a
    constraint on ``AxisType.Auto`` ones."""
    zeros = jnp.zeros(shape, dtype, device=sharding)
    if not isinstance(zeros, jax.core.Tracer):
        return zeros
    mesh, entries = sharding.mesh, tuple(sharding.spec)
    named = [a for entry in entries for a in spec_axes(entry)]
    if not any_explicit(mesh, named):
        return jax.lax.with_sharding_constraint(zeros, sharding)
    # On a mesh with auto axes too, `device_put` under `jit` replicates (jax
    # 0.10.2): the explicit entries are resharded (which needs this mesh set,
    # `jax.set_mesh`), the auto ones constrained.
    mixed = not all_explicit(mesh, mesh.axis_names)
    if not mixed:
        return jax.device_put(zeros, sharding)
    if jax.sharding.get_abstract_mesh() != mesh.abstract_mesh:
        if entries and any_explicit(mesh, spec_axes(entries[0])):
            # The per-device gradients meet a replicated accumulator on an
            # explicit data axis: the first step would fail inside jax
            # ("Mapped away dimension of inputs passed to vmap should be
            # sharded the same").
            types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
            raise ValueError(
                "`tx.init` traced (`jax.jit(tx.init)`, `jax.eval_shape`) with "
                "reduction=mm.deferred on a mesh of explicit and auto axes "
                f"({types}) cannot lay the accumulator out over the explicit "
                "data axis without the mesh set: jax would replicate it, and "
                "no step could use it. Call it inside `with jax.set_mesh(mesh):`, "
                "or call `tx.init` eagerly"
            )
        warnings.warn(
            "`jax.jit(tx.init)` with reduction=mm.deferred on a mesh of explicit "
            "and auto axes lays the accumulator out over the data axis only "
            "under `jax.set_mesh(mesh)` (jax places it so); without it every "
            "device holds all of the devices' running means. Call it inside "
            "`with jax.set_mesh(mesh):`, or call `tx.init` without `jit`",
            UserWarning,
            stacklevel=2,
        )
        return jax.device_put(zeros, sharding)

    def only(explicit: bool, other: Any) -> P:
        return P(
            *(
                e
                if spec_axes(e) and all_explicit(mesh, spec_axes(e)) == explicit
                else other
                for e in entries
            )
        )

    placed = jax.sharding.reshard(zeros, NamedSharding(mesh, only(True, None)))
    auto = only(False, P.UNCONSTRAINED)
    if any(map(spec_axes, auto)):
        placed = jax.lax.with_sharding_constraint(placed, NamedSharding(mesh, auto))
    return placed


def _sum_counts(per_device: jax.Array, bad: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``Σ_d nᵈ`` and whether it is usable (no bad count, no overflow).

    One scalar-sized all-reduce (the ``(D,)`` axis is sharded over the devices)
    for the total and the number of bad counts together: the one cross-device
    synchronisation per microbatch, which every device needs to agree on the
    window's total and on skipped microbatches. (A per-device ``value=`` adds a
    second, dependent, all-reduce right after it; folding it into this one
    measured no faster on two processes, where the cost is the synchronisation,
    not the number of collectives.)
    """
    (total, num_bad), fits = _exact_sums(jnp.stack([per_device, bad]))
    return total, fits[0] & (num_bad == 0)


def _exact_sums(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every row's sum over the device axis (``rows``: shape ``(R, D)``), and
    whether it fits the dtype: one all-reduce for all rows.

    Integer rows are summed as high and low halves, so a sum beyond the
    dtype's range is detected (and replaced by 0) instead of wrapped (exact for
    fewer than 2¹⁵ devices); a float sum fits where it is finite.
    """
    dtype = rows.dtype
    if jnp.issubdtype(dtype, jnp.integer):
        half = jnp.iinfo(dtype).bits // 2
        low_mask = (1 << half) - 1
        sums = jnp.sum(jnp.concatenate([rows >> half, rows & low_mask]), axis=1)
        hi, lo = jnp.split(sums, 2)
        hi = hi + (lo >> half)
        fits = hi < (1 << (jnp.iinfo(dtype).bits - 1 - half))
        return jnp.where(fits, (hi << half) | (lo & low_mask), 0).astype(dtype), fits
    sums = jnp.sum(rows, axis=1)
    return sums, jnp.isfinite(sums)


class Deferred(KnownTotals):
    """Each device accumulates its own running mean; combined once per window.

    Build it with :func:`deferred`. The devices agree on every microbatch's
    global token count as it arrives (one scalar all-reduce per microbatch),
    which token budgets and skip functions need;
    :meth:`_per_window` is the variant that agrees only at the window's end,
    which :class:`MaskedMultiSteps` picks itself where its rules allow.
    """

    # The accumulator's leading axis: one running mean per device.
    device_axes = 1

    def __init__(self, mesh: jax.sharding.Mesh, axis_name: Any = "data"):
        self.mesh = mesh
        self.axes, self.size = check_mesh_axes(mesh, axis_name)
        self._spec_axes = self.axes[0] if len(self.axes) == 1 else self.axes

    def __repr__(self) -> str:
        axes = self._spec_axes
        return f"mm.deferred(mesh of {dict(self.mesh.shape)}, {axes!r})"

    def eager_mesh(self, *inputs: Any) -> contextlib.AbstractContextManager:
        """``jax.set_mesh(mesh)`` for a step called outside any trace (eagerly:
        no input a tracer) on a mesh with explicit axes, where no mesh is set:
        the per-device running means are a ``vmap``, and jax's eager ``vmap``
        cannot make a scalar (``ones_like``) of an array split over an
        explicit axis without a mesh set ("Please enter your `jit` into a
        mesh context", or on a mesh with automatic axes too "cannot reshape
        array of size 1"). Inside a trace (``jit``, and eager ``grad``,
        ``jvp`` or ``vmap``, where jax refuses ``set_mesh``) the caller's
        context stands."""
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(inputs))
        if (
            traced
            or staging()
            or not any_explicit(self.mesh, self.mesh.axis_names)
            or not jax.sharding.get_abstract_mesh().empty
        ):
            return contextlib.nullcontext()
        return jax.set_mesh(self.mesh)

    def traced_mesh(self) -> contextlib.AbstractContextManager:
        """The mesh's abstract form, as the context of a trace of this
        reduction's state outside any step (``jax.eval_shape`` of ``init``):
        on a mesh of explicit and automatic axes, ``init`` refuses to trace
        without a mesh set (jax would replicate the state over the explicit
        data axis)."""
        return jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (type(self), (self.mesh, self._spec_axes))

    def _per_window(
        self, stats: bool = False, per_leaf: bool = False
    ) -> DeferredPerWindow:
        """The same reduction, with the devices agreeing only at a window's end
        (``stats``: it also keeps the window statistics' per-device shares;
        ``per_leaf``: each parameter leaf's)."""
        return DeferredPerWindow(
            self.mesh, self._spec_axes, stats=stats, per_leaf=per_leaf
        )

    # ------------------------------------------------------------------ state

    def _leading_names(self, names: Any, ndim: int) -> tuple[Any, ...]:
        """``(axes, *rest)``: the device axis over ``axes``; the other dims keep
        the parameter's names over the other mesh axes (a dim sharded over
        ``axes`` itself, FSDP-style, is held whole by each device; one sharded
        over ``axes`` and another axis stays split over that other axis, as
        :func:`mm.per_device_value_and_grad`'s gradients are)."""
        names = tuple(names) + (None,) * (ndim - len(names))
        rest = [without_axes(entry, self.axes) for entry in names]
        return (self._spec_axes, *rest)

    def _leading_sharding(self, leaf: Any) -> NamedSharding:
        """The accumulator's sharding for a parameter leaf: :meth:`_leading_names`
        of the parameter's own sharding, where it is on this mesh."""
        sharding = _sharding_of(leaf)
        spec = ()
        if sharding is not None and sharding.mesh.shape == self.mesh.shape:
            spec = tuple(sharding.spec)
        names = self._leading_names(spec, jnp.ndim(leaf))
        # As a step returns it, for jit's cache: where every axis it names is
        # explicit, the type's spec, one entry per dimension. Where an auto
        # axis is named, jax spells a step's output as an input of the same
        # sharding, else without trailing Nones (P("data"), as here).
        named = set().union(*map(spec_axes, names))
        if not all_explicit(self.mesh, named):
            names = trimmed(names)
        return NamedSharding(self.mesh, P(*names))

    def place(self, state: Any, params: Any) -> Any:
        """``state`` placed as a step returns it: its scalars replicated on
        this reduction's mesh (:func:`place_uncommitted`)."""
        del params
        return place_uncommitted(state, NamedSharding(self.mesh, P()))

    def _on_device_axis(self, x: jax.Array) -> jax.Array:
        """A ``(D,)`` array (counts, values) sharded over the device axis on
        an explicit data axis, as the state's per-device arrays are."""
        if not any_explicit(self.mesh, self.axes):
            return x
        return jax.sharding.reshard(x, NamedSharding(self.mesh, P(self._spec_axes)))

    def _with_device_axis(self, tree: Any) -> Any:
        """``tree`` with the device axis put in front of its boxes' names.

        Params boxed with sharding metadata (flax linen's ``nn.Partitioned``,
        NNX variables' ``out_sharding``) keep their boxes through
        ``jax.tree.map``, and flax places optimizer state by those names
        (``nn.get_partition_spec``, ``nnx.Optimizer``). The accumulator has one
        more dimension in front, the device axis: its names must say so, as
        :meth:`_leading_sharding` does, or flax would shard the device axis by
        the params' first name. A logical name (``nn.LogicallyPartitioned``)
        cannot be resolved here: the device axis gets the mesh axis' own name,
        which the logical rules map like any other. Boxes exist only where
        flax is imported, so flax is looked up, never imported here.
        """
        meta = sys.modules.get("flax.core.meta")
        variables = sys.modules.get("flax.nnx.variablelib")
        logical = getattr(
            sys.modules.get("flax.linen.spmd"), "LogicallyPartitioned", ()
        )
        box_types = tuple(
            t
            for t in (
                getattr(meta, "Partitioned", None),
                getattr(variables, "Variable", None),
            )
            if t is not None
        )
        if not box_types:
            return tree

        def rename(box):
            if meta is not None and isinstance(box, meta.Partitioned):
                if isinstance(box, logical):
                    return box.add_axis(0, {meta.PARTITION_NAME: self._spec_axes})
                ndim = jnp.ndim(box.value) - 1
                return box.replace(names=self._leading_names(box.names, ndim))
            if isinstance(box, box_types):  # an NNX variable, made by the map
                # (`nnx.Optimizer` makes a variable's `optimizer_sharding` its
                # state's `out_sharding`: both lead with the device axis.)
                ndim = jnp.ndim(box.get_value()) - 1
                for key in ("out_sharding", "optimizer_sharding"):
                    names = box.get_metadata().get(key)
                    if isinstance(names, (tuple, list)):  # PartitionSpec included
                        box.set_metadata(**{key: self._leading_names(names, ndim)})
            return box

        return jax.tree.map(rename, tree, is_leaf=lambda x: isinstance(x, box_types))

    def init_accumulator(self, params: Any, leaf_dtype: Callable[[Any], Any]) -> Any:
        def leaf(p):
            return _zeros_on(
                (self.size, *jnp.shape(p)), leaf_dtype(p), self._leading_sharding(p)
            )

        return self._with_device_axis(jax.tree.map(leaf, params))

    def init(self, count_dtype: Any, num_leaves: int = 0) -> DeferredState:
        del num_leaves
        return DeferredState(
            counts=_zeros_on(
                (self.size,), count_dtype, NamedSharding(self.mesh, P(self._spec_axes))
            )
        )

    # ------------------------------------------------------------- per call

    def check_grads(self, grads: Any, acc_grads: Any) -> None:
        for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
            if jnp.ndim(g) < 1 or jnp.shape(g)[0] != self.size:
                raise ValueError(
                    f"With reduction={self!r}, gradients carry a leading device "
                    f"axis of size {self.size} (as mm.per_device_value_and_grad "
                    f"returns them), got shape {jnp.shape(g)} at "
                    f"{jax.tree_util.keystr(path) or '<root>'}"
                )
        for a in jax.tree.leaves(acc_grads):
            if jnp.shape(a)[0] != self.size:
                raise ValueError(
                    f"`state` holds running means for {jnp.shape(a)[0]} devices, "
                    f"but reduction={self!r} has {self.size}: use the state that "
                    "this wrapper's `init` returned (on this mesh), or, for a "
                    "checkpoint saved on another number of devices, restore it "
                    "against `mm.device_count_target(template, saved_devices)` "
                    "and convert it with `mm.from_device_count(restored, "
                    "template)`"
                )
        # Gradients boxed with the params' flax names: the accumulator's lead
        # with the device axis. Looked into only when the structures differ,
        # on a copy (the renaming sets an NNX variable's metadata in place).
        a_def = jax.tree.structure(acc_grads)
        if jax.tree.structure(grads) != a_def and a_def == jax.tree.structure(
            self._with_device_axis(jax.tree.map(lambda g: g, grads))
        ):
            raise ValueError(
                "The gradients are boxed with the params' sharding names (flax "
                "nn.Partitioned or NNX metadata), but with "
                f"reduction={self!r} the accumulator's boxes lead with the device "
                "axis: train on unboxed params and gradients (nn.unbox), and "
                "keep the boxes for placement (README, 'Data parallel at scale')"
            )
        _checks.check_grads_match(grads, acc_grads, per_device=True)

    def to_count(
        self, count: Any, count_dtype: Any
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(total, ok, per_device)`` from the ``(D,)`` per-device counts.

        Each device's count follows the count contract of ``_checks`` (by
        value, eager ``ValueError`` when concrete); ``total`` is the
        microbatch's global count (the one scalar all-reduce per microbatch),
        and ``ok`` whether every device's count is valid and the total fits.
        """
        per_device, ok = self._device_counts(count, count_dtype)
        total, ok = _sum_counts(per_device, (~ok).astype(per_device.dtype))
        return total, ok, per_device

    def _device_counts(self, count: Any, count_dtype: Any) -> tuple[Any, Any]:
        """Every device's count under the count contract, and its validity."""
        counts, ok = _checks.to_count(
            count,
            count_dtype,
            "With reduction=mm.deferred(...), `count` (every device's token "
            "count, as mm.per_device_value_and_grad returns it)",
            shape=(self.size,),
        )
        return self._on_device_axis(counts), self._on_device_axis(ok)

    def _device_values(self, value: Any) -> Any:
        """``value=`` checked: ``None``, a scalar, or one real value per device
        (shape ``(D,)``, as float32)."""
        if value is None or np.shape(value) == ():
            return _checks.check_value(value)
        if np.shape(value) != (self.size,):
            raise ValueError(
                f"With reduction={self!r}, `value` is a scalar or one value per "
                f"device, shape ({self.size},), got shape {np.shape(value)}"
            )
        _checks.refuse_count_as_value(value)
        value = _checks.real_array(value, "`value`")
        return self._on_device_axis(value.astype(compute_dtype(value.dtype)))

    def value(self, value: Any, local_counts: Any, total: jax.Array) -> Any:
        """The microbatch's global token-weighted mean of per-device ``value``s
        (``total``: the microbatch's global count, known to every device)."""
        value = self._device_values(value)
        if value is None or jnp.shape(value) == ():
            return value
        mean, _ = mean_over_devices(value, local_counts, total)
        return mean

    def skip_view(self, grads: Any, local_counts: Any, total: jax.Array) -> Any:
        """The gradients a skip function judges: device ``d``'s scaled by
        ``√(n_d / n)``, so that a sum of squares over them (what
        ``optax.skip_large_updates`` compares) is the token-weighted mean of
        the devices' squared norms, ``Σ (n_d / n) ‖g_d‖²``: never below the
        microbatch's ``‖ḡ‖²`` (the mean is convex), equal to it when the
        devices agree, and independent of the number of devices. A device
        without tokens shows zeros (its gradient is meaningless and adds
        nothing); scaling keeps every other value's finiteness."""
        weight = jnp.sqrt(jnp.clip(safe_fraction(local_counts, total), 0, 1))
        take = local_counts > 0

        def leaf(g):
            shape = (-1,) + (1,) * (g.ndim - 1)
            w = weight.astype(compute_dtype(g.dtype)).reshape(shape)
            scaled = (g.astype(w.dtype) * w).astype(g.dtype)
            return jnp.where(take.reshape(shape), scaled, jnp.zeros_like(g))

        return jax.tree.map(leaf, grads)

    def accumulate(self, acc, acc_count, reduction_state, grads, n, local_counts):
        """Every device's running mean (one :func:`running_mean_update`, mapped
        over the device axis); the global total advances by the global count."""
        take = n > 0
        local_counts = jnp.where(take, local_counts, jnp.zeros_like(local_counts))
        acc, counts = jax.vmap(running_mean_update)(
            acc, reduction_state.counts, grads, local_counts
        )
        acc_count = jnp.where(take, acc_count + n, acc_count).astype(acc_count.dtype)
        return acc, acc_count, DeferredState(counts)

    def mean(
        self, acc: Any, acc_count: jax.Array, reduction_state: DeferredState
    ) -> Any:
        """The window's global mean: ``Σ_d (Nᵈ/N)·mᵈ``, one reduction.

        ``N`` is the window's global total ``acc_count``, which every device
        already holds: the only cross-device traffic is the gradients' sum.
        """
        mean, _ = mean_over_devices(acc, reduction_state.counts, acc_count)
        return mean

    def reset(self, reduction_state: DeferredState):
        return DeferredState(jnp.zeros_like(reduction_state.counts))


class DeferredWindowState(NamedTuple):
    """The per-device part of a window that the devices agree on only at its
    end (``state.reduction_state`` of :class:`DeferredPerWindow`). Every field
    has shape ``(D,)``, sharded over the mesh axis.

    Attributes:
      counts: each device's token total ``Nᵈ`` behind its running mean.
      invalid: each device's invalid counts in the window (int32).
      value: each device's token-weighted running mean of ``value=`` (float32).
      value_counts: the tokens behind ``value``.
      sq_norms: with window statistics, each device's ``Σᵢ nᵈᵢ ‖gᵈᵢ‖²``
        (float32; 0 without); with each leaf's share too
        (``per_leaf_stats=True``), each device's for each leaf, shape
        ``(D, L)``.
      microbatches: with window statistics, each device's microbatches with
        tokens (int32; 0 without).
    """

    counts: jax.Array
    invalid: jax.Array
    value: jax.Array
    value_counts: jax.Array
    sq_norms: jax.Array
    microbatches: jax.Array


class _LocalCounts(NamedTuple):
    counts: jax.Array  # (D,), 0 where invalid
    invalid: jax.Array  # (D,) bool


class DeferredPerWindow(Deferred):
    """:class:`Deferred` with no cross-device traffic between window ends.

    What :class:`MaskedMultiSteps` uses for ``reduction=mm.deferred(...)`` when
    nothing needs a microbatch's global count before its window closes: a
    fixed (or per-gradient-step) ``every_k_schedule`` and no
    ``should_skip_update_fn``. Every device then keeps its own token total,
    invalid-count tally and ``value=`` running mean beside its gradients'
    (:class:`DeferredWindowState`), with window statistics also its own
    ``Σ nᵈ‖gᵈ‖²`` and microbatch count, and the window's end agrees on all of
    them with one scalar all-reduce before the gradients' one.
    Between window ends a step needs no synchronisation at all, so a slow
    device delays the others once per window, not on every microbatch.

    What differs from :class:`Deferred`, both consequences of no device knowing
    the others' counts before the window closes: the state's ``acc_count``,
    ``acc_value`` and ``value_count`` stay 0 (the window's global figures are
    formed when it closes; each device's are in ``reduction_state``); and a
    traced invalid count (negative, non-finite, or overflowing that device's
    total) drops that device's share of the microbatch only, not the whole
    microbatch; it is added to ``num_invalid_counts`` when the window closes.
    The microbatch still counts toward the window's ``k`` (``mini_step``
    advances) even when every device's count is invalid.
    A window whose global token total does not fit ``count_dtype`` (past an
    integer's maximum, or a float's largest finite value) applies no update and
    counts as one invalid count. With window statistics
    the state's ``stats.weighted_sq_norms`` and ``stats.microbatches`` stay 0
    likewise until the window closes.
    """

    def __init__(
        self,
        mesh: jax.sharding.Mesh,
        axis_name: Any = "data",
        stats: bool = False,
        per_leaf: bool = False,
    ):
        super().__init__(mesh, axis_name)
        # Whether the window statistics' running sums are kept here, per
        # device, rather than in the statistics' state (see WindowTotals),
        # and each parameter leaf's share of them.
        self.keeps_stats = stats
        self.per_leaf = stats and per_leaf

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        args = (self.mesh, self._spec_axes, self.keeps_stats, self.per_leaf)
        return (type(self), args)

    def init(  # type: ignore[override]
        self, count_dtype: Any, num_leaves: int = 0
    ) -> DeferredWindowState:
        devices = NamedSharding(self.mesh, P(self._spec_axes))

        def zeros(dtype, *trailing):
            return _zeros_on((self.size, *trailing), dtype, devices)

        return DeferredWindowState(
            counts=zeros(count_dtype),
            invalid=zeros(jnp.int32),
            value=zeros(jnp.float32),
            value_counts=zeros(count_dtype),
            sq_norms=zeros(jnp.float32, *((num_leaves,) if self.per_leaf else ())),
            microbatches=zeros(jnp.int32),
        )

    def to_count(  # type: ignore[override]
        self, count: Any, count_dtype: Any
    ) -> tuple[jax.Array, jax.Array, _LocalCounts]:
        """``(0, True, local)``: every device's count checked on its own; the
        global count is not known before the window's end, so the microbatch
        adds 0 to ``acc_count`` and always belongs to its window."""
        per_device, ok = self._device_counts(count, count_dtype)
        local = _LocalCounts(jnp.where(ok, per_device, jnp.zeros_like(per_device)), ~ok)
        return jnp.zeros([], count_dtype), jnp.ones([], jnp.bool_), local

    def value(self, value: Any, local_counts: Any, total: jax.Array) -> Any:
        """``value`` checked: a scalar, or one value per device (shape ``(D,)``);
        each device folds its own into its running mean (``accumulate_value``)."""
        del local_counts, total
        return self._device_values(value)

    def skip_view(self, grads: Any, local_counts: Any, total: jax.Array) -> Any:
        del local_counts, total
        return grads  # no skip function with this reduction

    def accumulate(self, acc, acc_count, reduction_state, grads, n, local_counts):
        """Every device's running mean over its own valid counts; ``acc_count``
        (the global total, not known yet) is left as it is."""
        del n
        counts, invalid = local_counts
        state = reduction_state
        fits = _running_mean.fits(state.counts, counts)
        counts = jnp.where(fits, counts, jnp.zeros_like(counts))
        invalid = invalid | ~fits
        acc, new_counts = jax.vmap(running_mean_update)(
            acc, state.counts, grads, counts
        )
        state = state._replace(
            counts=new_counts,
            invalid=state.invalid + invalid.astype(jnp.int32),
        )
        if self.keeps_stats:
            with jax.named_scope("masked_multistep/window_stats"):
                added, took = device_shares(grads, counts, counts > 0, self.per_leaf)
            state = state._replace(
                sq_norms=state.sq_norms + added,
                microbatches=state.microbatches + took,
            )
        elif not (
            any_explicit(self.mesh, self.axes)
            or jax.sharding.get_abstract_mesh().manual_axes
        ):
            # Unused without statistics, they pass through the step, and would
            # keep whatever layout they came in with: a state read back to the
            # host (flax.serialization) would stay replicated, every later
            # step's state laid out unlike `tx.init`'s (a compile more after
            # the restore, and after any restore onto `tx.init`'s layout).
            # (Not inside shard_map, whose manual axes leave no layout to set.)
            devices = NamedSharding(self.mesh, P(self._spec_axes))
            state = state._replace(
                sq_norms=jax.lax.with_sharding_constraint(state.sq_norms, devices),
                microbatches=jax.lax.with_sharding_constraint(
                    state.microbatches, devices
                ),
            )
        return acc, acc_count, state

    def accumulate_value(
        self, acc_value, value_count, reduction_state, value, n, local
    ):
        """Each device's running mean of ``value`` (its own or the microbatch's
        scalar), weighted by the counts :meth:`accumulate` takes (called
        before it, on the same device totals)."""
        del n
        if value is None:
            return acc_value, value_count, reduction_state
        state = reduction_state
        take = _running_mean.fits(state.counts, local.counts)
        counts = jnp.where(take, local.counts, jnp.zeros_like(local.counts))
        values = self._on_device_axis(
            jnp.broadcast_to(jnp.asarray(value, jnp.float32), (self.size,))
        )
        new_value, new_counts = jax.vmap(running_mean_update)(
            state.value,
            state.value_counts,
            values,
            counts.astype(state.value_counts.dtype),
        )
        state = state._replace(value=new_value, value_counts=new_counts)
        return acc_value, value_count, state

    def close_totals(self, so_far: WindowTotals, reduction_state: Any) -> WindowTotals:
        """The window's global figures from every device's: one scalar
        all-reduce, once per window (the loss's weighted sum then joins the
        gradients')."""
        state = reduction_state
        dtype = state.counts.dtype
        # One scalar all-reduce for the token total, the invalid counts and the
        # tokens behind the loss; the gradients' (and the loss's) weighted sum
        # then needs no other.
        sums, fits = _exact_sums(
            jnp.stack([state.counts, state.invalid.astype(dtype), state.value_counts])
        )
        # A window whose total does not fit is dropped whole: no tokens, no
        # loss, no microbatches in its statistics; one invalid count.
        kept = fits[0]
        total = jnp.where(kept, sums[0], jnp.zeros_like(sums[0]))
        num_invalid = sums[1].astype(jnp.int32) + (~kept).astype(jnp.int32)
        value_total = jnp.where(kept, sums[2], jnp.zeros_like(sums[2]))
        value, _ = mean_over_devices(state.value, state.value_counts, value_total)
        stats_sums = ()
        if self.keeps_stats:
            # (Σ nᵢ‖gᵢ‖², K), and with each leaf's shares their sums.
            sums = sum_over_devices(state.sq_norms, state.microbatches)
            stats_sums = tuple(jnp.where(kept, x, 0) for x in sums)
        return WindowTotals(
            tokens=total.astype(so_far.tokens.dtype),
            value=value.astype(jnp.float32),
            value_count=value_total.astype(so_far.value_count.dtype),
            num_invalid=num_invalid,
            stats_sums=stats_sums,
            overflowed=~kept,
        )

    def reset(self, reduction_state: Any):  # type: ignore[override]
        return jax.tree.map(jnp.zeros_like, reduction_state)


def deferred(mesh: jax.sharding.Mesh, axis_name: Any = "data") -> Deferred:
    """Defer the cross-device gradient reduction to the end of each window.

    For ``MaskedMultiSteps(..., reduction=mm.deferred(mesh, axis_name))``. The
    gradients and counts handed to ``update`` are every device's own, stacked
    along a leading axis of size ``D`` (the devices of ``axis_name``), as
    :func:`per_device_value_and_grad` returns them. Each device keeps its own
    token-weighted running mean of its gradients (the accumulator gets the
    leading axis, sharded over ``axis_name``: no cross-device traffic), and the
    window's end combines them, token-weighted::

        mean = Σ_d (Nᵈ / N) · mᵈ        N = Σ_d Nᵈ

    one gradient-sized all-reduce per window instead of one per microbatch. A
    device with no tokens in the window contributes nothing, even if its
    gradients were NaN. The inner optimizer sees the global full-batch
    token-mean gradient, as without the mode.

    When the devices agree on the counts: with a window of ``k`` microbatches
    (``every_k_schedule`` alone) and no ``should_skip_update_fn``, nothing needs
    a microbatch's global count before its window closes, so they agree at the
    window's end only (one scalar all-reduce for the window's token total,
    invalid counts and the loss's tokens, beside the gradients', which with
    window statistics also carries their sums of every device's ``nᵈ‖gᵈ‖²`` and
    microbatches): between window ends a step has no cross-device communication
    over the data axis at all, and a slow device holds the others up once per
    window, not on every microbatch. (Parameters sharded over an
    ``AxisType.Explicit`` model axis are gathered over it and sliced again where
    :func:`per_device_value_and_grad`'s ``shard_map`` begins, on every step:
    jax's boundary of a ``shard_map`` manual over the data axis alone; an
    ``Auto`` model axis has none of it.) Then the state's ``acc_count``,
    ``acc_value`` and ``value_count`` stay 0 (every device's own figures are in
    ``state.reduction_state``), and a traced invalid count on one device drops
    that device's share of the microbatch and is added to ``num_invalid_counts``
    when the window closes, and the microbatch counts toward ``k`` even when
    every device's count is invalid (with window statistics, ``state.stats``' running
    sums stay 0 likewise); a window whose combined token total does not fit
    ``count_dtype`` is known only when it closes, and is dropped whole (no
    update, one invalid count). Token budgets and skip functions need every
    microbatch's global count: with them the devices agree on it on every
    microbatch (a scalar all-reduce; a second one for ``value=``), ``acc_count``
    is the window's global total as it grows, and an invalid count on any device
    skips the microbatch on all. A skip function sees the stacked per-device
    gradients, device ``d``'s scaled by ``√(n_d / n)`` (zeros where ``n_d =
    0``): the squared norm ``optax.skip_large_updates`` compares is then
    ``Σ (n_d / n) ‖g_d‖² ≥ ‖ḡ‖²``, equal when the devices agree.

    Memory: the accumulator holds ``D`` copies of the gradients, one per device;
    each device stores its own, a full-size buffer. With parameters sharded
    over ``axis_name`` (FSDP), that is ``D`` times the ``1/D`` share that
    reducing (reduce-scattering) every microbatch needs; see the README.

    Args:
      mesh: the ``jax.sharding.Mesh`` the batch is sharded on; its axes may be
        ``AxisType.Auto`` or ``AxisType.Explicit`` (``jax.make_mesh``'s default).
      axis_name: the mesh axis (or tuple of axes) the batch is split over.

    Returns:
      The reduction, for ``MaskedMultiSteps``' ``reduction=`` argument.

    Raises:
      TypeError: if ``mesh`` is not a ``jax.sharding.Mesh``.
      ValueError: if ``axis_name`` does not name axes of ``mesh``, names
        one twice, or names axes of both types (``AxisType.Explicit`` and
        ``AxisType.Auto``).

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import masked_multistep as mm
      >>> n = len(jax.devices())
      >>> mesh = jax.make_mesh((n,), ("data",),
      ...                      axis_types=(jax.sharding.AxisType.Auto,))
      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2,
      ...                          reduction=mm.deferred(mesh, "data"))
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> state.acc_grads["w"].shape == (n, 3)  # one running mean per device
      True
    """
    return Deferred(mesh, axis_name)
