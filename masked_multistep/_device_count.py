"""Moving a window in progress onto another number of devices.

With ``reduction=mm.deferred(mesh, axis)`` the wrapper's state holds one
running mean per device of ``axis`` (``acc_grads``' leading axis) and each
device's share of the window's figures (``reduction_state``): a checkpoint of
it restores only onto as many devices. :func:`device_count_target` gives the
tree to restore such a checkpoint into on the new mesh, and
:func:`from_device_count` regroups the old devices' shares into the new
devices', token-weighted, so the window in progress continues with the same
mean, token total, loss and statistics.

Old device ``d`` of ``D`` joins new device ``⌊d·D′/D⌋`` of ``D′``: when the
count shrinks each new device takes a contiguous group of old ones (their
running means combined as the window's end combines all of them, by
:func:`mean_over_devices`, the one weighted mean); when it grows some new
devices start empty. Token totals, invalid counts, the statistics' sums and
microbatch counts add up; the window's global figures are unchanged.

A state without a reduction counts as one device, so the same conversion moves
a run between one device and a deferred reduction, either way. Where the
layouts differ, the window's figures (token total, loss, the statistics'
sums) move between the state's own fields and the devices' shares in
``reduction_state`` (a deferred reduction agreeing only at the window's end
keeps them per device; a converted window's figures become the first
device's share).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from masked_multistep._by_name import array as _array
from masked_multistep._by_name import bare_stats, is_named
from masked_multistep._by_name import get as _get
from masked_multistep._by_name import like as _like
from masked_multistep._checkpoint import (
    check_counters,
    check_matches,
    check_stats_tallies,
    like_template,
    refuse_swapped,
)
from masked_multistep._checks import (
    check_microbatches,
    is_host_int,
    refuse_restore_target,
    traced,
)
from masked_multistep._deferred import _exact_sums
from masked_multistep._reduction import (
    _from_host,
    mean_over_devices,
    placed_like,
    through_key_data,
)
from masked_multistep._state import MaskedMultiStepsState
from masked_multistep._stats_state import SLOTS, LeafSums

__all__ = ["device_count_target", "from_device_count"]

# The layouts of a window: one device (no reduction), a deferred reduction
# whose devices agree on every microbatch's count, or only at the window's end.
_LOCAL, _SYNCED, _WINDOW = "local", "synced", "per-window"
# The fields that hold the window's figures in one layout or another.
_LAYOUT_FIELDS = frozenset(
    (
        "acc_grads",
        "acc_count",
        "acc_value",
        "value_count",
        "num_invalid_counts",
        "stats",
        "reduction_state",
    )
)
# The window's scalars as `_convert` names them, and their state fields.
_SCALAR_FIELDS = {
    "acc_count": "acc_count",
    "acc_value": "acc_value",
    "value_count": "value_count",
    "num_invalid": "num_invalid_counts",
}
_FIGURES = (
    "acc_count",
    "acc_value",
    "value_count",
    "num_invalid",
    "sq",
    "k",
    "leaf_sq",
)
# The per-window layout's per-device sums, and every per-device field's dtype
# (the counts' is the count dtype).
_SUMS = ("invalid", "sq_norms", "microbatches")
_DEVICE_DTYPES = {
    "invalid": jnp.int32,
    "value": jnp.float32,
    "sq_norms": jnp.float32,
    "microbatches": jnp.int32,
}


def _is_state(x: Any) -> bool:
    return isinstance(x, MaskedMultiStepsState) or is_named(x)


def _state_path(tree: Any, what: str) -> tuple[Any, ...]:
    """The path of the one wrapper state in ``tree`` (a bare state, one inside
    a ``TrainState``, a ``dict`` of checkpoint items or ``nnx.state``)."""
    found = [
        path
        for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_state)[0]
        if _is_state(x)
    ]
    if len(found) != 1:
        hint = ""
        if found:
            # (One deferred wrapper per optax.multi_transform branch.)
            paths = ", ".join(f"`{what}{_where(path)}`" for path in found)
            hint = (
                f", at {paths}: convert each on its own, passing the one "
                "state and its template (restore each against its own "
                "`mm.device_count_target`)"
            )
        elif isinstance(tree, optax.GradientTransformation):
            hint = (
                ": that is the optimizer, not its state; pass "
                "`tx.init(params)` (or its abstract form)"
            )
        raise ValueError(
            f"`{what}` must hold exactly one MaskedMultiStepsState (bare, in an "
            "optax state, a TrainState, or `nnx.state(optimizer)`), found "
            f"{len(found)}{hint}"
        )
    return found[0]


def _where(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def device_count_target(template: Any, num_devices: int) -> Any:
    """The tree to restore a deferred state saved on ``num_devices`` devices into.

    ``template`` as it is, but for the leaves with a device axis (the
    accumulator and the reduction's per-device state), which become
    ``jax.ShapeDtypeStruct``\\ s of ``num_devices`` entries on the template's
    mesh: sharded over its axis where ``num_devices`` is a multiple of the
    axis' size (each device then restores ``num_devices / D′`` running means),
    replicated otherwise (every device holds all ``num_devices`` while
    converting). Restore against it (through ``ocp.utils.to_shape_dtype_struct``
    for orbax, which leaves these as they are), then convert with
    :func:`from_device_count`. (A state saved without a reduction restores
    against that wrapper's ``init``; one saved with a deferred reduction onto a
    wrapper without one, against this function's result for a deferred
    wrapper configured as the saved one, on the devices at hand.)

    Args:
      template: what the checkpoint's item is restored against on the new
        mesh: ``tx.init(params)`` of ``MaskedMultiSteps(...,
        reduction=mm.deferred(new_mesh, axis))`` (or its abstract form), or a
        tree holding it: a ``TrainState``, a ``dict`` of items,
        ``nnx.state(optimizer)``.
      num_devices: the number of devices of the saved state's axis.

    Returns:
      ``template``'s tree with the device-axis leaves resized.

    Raises:
      TypeError: if ``num_devices`` is not an integer.
      ValueError: if ``num_devices`` is below 1, or ``template`` holds no
        wrapper state, several, or one without a deferred reduction.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import masked_multistep as mm
      >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1],
      ...                      axis_types=(jax.sharding.AxisType.Auto,))
      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2,
      ...                          reduction=mm.deferred(mesh, "data"))
      >>> target = mm.device_count_target(tx.init({"w": jnp.zeros(3)}), 4)
      >>> target.acc_grads["w"].shape, target.reduction_state.counts.shape
      ((4, 3), (4,))
    """
    if is_host_int(template) and not is_host_int(num_devices):
        raise TypeError(
            f"`num_devices` must be an integer, got {type(num_devices).__name__}, "
            f"and `template` is one ({template}): are the arguments swapped? "
            "The call is device_count_target(template, num_devices)"
        )
    num = check_microbatches(num_devices, "`num_devices`")
    at = _state_path(template, "template")

    def resize(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(
            (num, *np.shape(x)[1:]),
            jnp.result_type(x),
            sharding=_resized(getattr(x, "sharding", None), num),
        )

    def target(path: tuple[Any, ...], node: Any) -> Any:
        if path != at:
            return node
        if _layout(node) == _LOCAL:
            raise ValueError(
                "`template` holds no per-device state: only a wrapper with "
                "reduction=mm.deferred(mesh, axis) keeps one (a state saved "
                "without one restores against that wrapper's `init` as it is)"
            )
        return _with(
            node,
            acc_grads=jax.tree.map(resize, _get(node, "acc_grads")),
            reduction_state=jax.tree.map(resize, _get(node, "reduction_state")),
        )

    return jax.tree_util.tree_map_with_path(target, template, is_leaf=_is_state)


def _resized(sharding: Any, num: int) -> Any:
    """A template leaf's ``sharding`` for ``num`` entries along the device
    axis: as it is where ``num`` divides evenly over the axis, else with that
    axis replicated."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) or (None,)
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    if num % math.prod(sharding.mesh.shape[a] for a in axes if a is not None):
        spec = (None, *spec[1:])
    return NamedSharding(sharding.mesh, P(*spec))


def _placed(got: Any, want: Any) -> Any:
    """``got`` where the template's ``want`` is (see :func:`_onto`)."""
    if isinstance(want, jax.Array) and not getattr(want, "_committed", True):
        # Left where jax puts it (params on no particular device): so is the
        # result, or the first step after converting would compile again.
        return _uncommitted(got) if getattr(got, "_committed", 0) else got
    got = placed_like(got, want)
    sharding = getattr(want, "sharding", None)
    if isinstance(got, jax.Array) and isinstance(sharding, jax.sharding.Sharding):
        return _onto(got, sharding)
    return got


def _uncommitted(x: jax.Array) -> jax.Array:
    """``x`` read to the host and back, on no particular device."""
    return through_key_data(lambda v: jnp.asarray(np.asarray(v)), x)


def _onto(x: Any, sharding: Any) -> Any:
    """``x`` on ``sharding``: read from the host, or moved from another
    placement (a state converted in memory, not restored onto the new mesh:
    other devices, the same ones in another order, another layout)."""
    if not getattr(x, "_committed", True):
        return _from_host(x, sharding)
    # Equal, not merely equivalent: jit compiles again for a replicated array
    # on another mesh over the same devices.
    if isinstance(x, jax.Array) and x.sharding != sharding:
        return jax.device_put(x, sharding)
    return x


def _groups(old: int, new: int) -> tuple[np.ndarray, np.ndarray]:
    """``(index, member)``, shape ``(new, G)``: the old devices in each new
    device's group (``⌊d·new/old⌋``), padded with index 0 where ``member`` is
    False."""
    target = np.arange(old) * new // old
    size = max(1, int(np.bincount(target, minlength=new).max()))
    index = np.zeros((new, size), np.int32)
    member = np.zeros((new, size), bool)
    for j in range(new):
        (mine,) = np.nonzero(target == j)
        index[j, : len(mine)] = mine
        member[j, : len(mine)] = True
    return index, member


class _Regroup:
    """Per-device arrays (leading axis ``old``) regrouped onto ``new`` devices."""

    def __init__(self, old: int, new: int):
        self.new = new
        self.index, self.member = _groups(old, new)
        self.contiguous = old % new == 0

    def group(self, x: jax.Array) -> jax.Array:
        """``x``, shape ``(old, ...)``, as ``(new, G, ...)``."""
        if self.contiguous:  # each new device's group is a block of the old axis
            return x.reshape(self.new, self.index.shape[1], *x.shape[1:])
        return x[self.index]

    def masked(self, x: jax.Array) -> jax.Array:
        x = self.group(x)
        where = self.member.reshape(self.member.shape + (1,) * (x.ndim - 2))
        return jnp.where(where, x, jnp.zeros_like(x))

    def total(self, counts: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Every group's total, and whether it fits the counts' dtype."""
        sums, fits = _exact_sums(self.masked(counts))
        return sums, jnp.all(fits)

    def sum(self, x: jax.Array) -> jax.Array:
        return jnp.sum(self.masked(x), axis=1).astype(x.dtype)

    def mean(self, tree: Any, counts: jax.Array, totals: jax.Array) -> Any:
        """Every group's token-weighted mean (:func:`mean_over_devices`)."""
        counts = self.masked(counts)
        if jnp.issubdtype(counts.dtype, jnp.floating):
            # Each group's counts and total scaled by a power of two (exactly)
            # to a total in [0.5, 1): XLA divides a vector by a broadcast
            # total as a product with its reciprocal, which is below float32's
            # normal range for a total past 2**126 and flushed to 0 (the
            # group's mean would be zeros).
            totals, exponent = jnp.frexp(totals)
            counts = jnp.ldexp(counts, -exponent[:, None])
        return jax.vmap(lambda x, n, t: mean_over_devices(x, n, t)[0])(
            jax.tree.map(self.group, tree), counts, totals
        )


def _first(x: jax.Array, new: int) -> jax.Array:
    """A window's figure (a scalar, or each leaf's) as the share of the first
    of ``new`` devices."""
    return jnp.zeros((new, *jnp.shape(x)), x.dtype).at[0].set(x)


def _convert(r: dict[str, Any], layouts: tuple[str, str], old: int, new: int):
    """The window's arrays in layout ``layouts[0]`` on ``old`` devices, in
    layout ``layouts[1]`` on ``new``, and whether the counts were valid.

    ``r`` holds ``acc`` (the running means, with a leading device axis unless
    local), the scalars ``acc_count``, ``acc_value``, ``value_count``,
    ``num_invalid`` and, with statistics, ``sq`` and ``k``, and a deferred
    layout's per-device ``rs`` fields."""
    r_layout, t_layout = layouts
    rs = r.get("rs", {})
    if r_layout == _LOCAL:
        means = [x[None] for x in r["acc"]]
        counts = r["acc_count"][None]
    else:
        means, counts = r["acc"], rs["counts"]
    ok = jnp.ones([], jnp.bool_)
    # Counts and tallies, per device and the window's: none negative or
    # non-finite. The squared norms' sums none negative: a NaN or inf is one
    # a step makes (a gradient not finite, or one whose square overflows),
    # and the window's end decides on it as it would have without the move.
    window = {name: r[name] for name in _FIGURES if name in r}
    for name, x in [("counts", counts), *rs.items(), *window.items()]:
        if name in ("value", "acc_value"):  # the loss: any value
            continue
        if name in ("sq", "leaf_sq", "sq_norms"):
            ok &= ~jnp.any(x < 0)
            continue
        ok &= jnp.all(x >= 0)
        if jnp.issubdtype(x.dtype, jnp.floating):
            ok &= jnp.all(jnp.isfinite(x))
    # The window's figures, where the layout keeps them per device (and the
    # target does not).
    if r_layout == _WINDOW and t_layout == _WINDOW:
        figures = {}
    elif r_layout == _WINDOW:
        whole = _Regroup(old, 1)
        (n,), fits = whole.total(counts)
        (value_count,), value_fits = whole.total(rs["value_counts"])
        ok &= fits & value_fits
        (value,) = whole.mean(rs["value"], rs["value_counts"], value_count[None])
        sq = whole.sum(rs["sq_norms"])[0]
        figures = {
            "acc_count": n,
            "acc_value": value,
            "value_count": value_count,
            "sq": jnp.sum(sq),
            "k": whole.sum(rs["microbatches"])[0],
            "num_invalid": r["num_invalid"] + whole.sum(rs["invalid"])[0],
        }
        if sq.ndim:  # each leaf's shares, summed over the devices
            figures["leaf_sq"] = sq
    else:
        figures = {name: r[name] for name in _FIGURES if name in r}
    if t_layout == _LOCAL:
        whole = _Regroup(old, 1)
        totals, fits = whole.total(counts)
        out = {**figures, "acc": [m[0] for m in whole.mean(means, counts, totals)]}
        return {k: v for k, v in out.items() if k in r or k == "acc"}, ok & fits
    regroup = _Regroup(old, new)
    totals, fits = regroup.total(counts)
    ok &= fits
    out = {"acc": regroup.mean(means, counts, totals)}
    if t_layout == _SYNCED:
        # (Those the target keeps: a per-device layout tallies the
        # statistics' sums with or without statistics.)
        out.update({k: v for k, v in figures.items() if k in r})
        out["rs"] = {"counts": totals}
    elif r_layout == _WINDOW:  # each device's shares regrouped
        value_totals, value_fits = regroup.total(rs["value_counts"])
        ok &= value_fits
        out.update({name: r[name] for name in _FIGURES if name in r})
        out["rs"] = {
            "counts": totals,
            "value_counts": value_totals,
            "value": regroup.mean(rs["value"], rs["value_counts"], value_totals),
            **{name: regroup.sum(rs[name]) for name in _SUMS},
        }
    else:  # the window's figures become the first device's shares
        zero = {name: jnp.zeros_like(r[name]) for name in _FIGURES if name in r}
        out.update(zero, num_invalid=r["num_invalid"])
        out["rs"] = {
            "counts": totals,
            "value_counts": _first(figures["value_count"], new),
            "value": _first(figures["acc_value"], new),
            "sq_norms": _first(
                figures.get("leaf_sq", figures.get("sq", jnp.float32(0))), new
            ),
            "microbatches": _first(figures.get("k", jnp.int32(0)), new),
            "invalid": jnp.zeros((new,), jnp.int32),
        }
    return out, ok


def _open_at(name: str) -> tuple[tuple[str, ...], int, int]:
    """Where the open window's figure ``name`` lies in the packed statistics:
    the fields down to its array, its index there, and that index's axis."""
    if name == "leaves.weighted_sq_norms":  # each leaf's (per_leaf_stats=True)
        return ("leaves", "shares"), LeafSums.FIGURES.index("weighted_sq_norms"), -2
    vector, index = SLOTS[name]
    return (vector,), index, -1


def _open_figure(stats: Any, name: str) -> Any:
    """The open window's figure ``name`` of the bare packed statistics
    (``weighted_sq_norms``, ``microbatches``, or each leaf's
    ``leaves.weighted_sq_norms``); of an abstract state (a
    ``jax.ShapeDtypeStruct``), its type."""
    path, index, axis = _open_at(name)
    packed = stats
    for field in path:
        packed = getattr(packed, field)
    if not isinstance(packed, jax.ShapeDtypeStruct):
        return jax.lax.index_in_dim(packed, index, packed.ndim + axis, keepdims=False)
    shape = list(packed.shape)
    del shape[axis]
    sharding = packed.sharding
    if isinstance(sharding, NamedSharding):
        spec = [*sharding.spec, *[None] * (len(packed.shape) - len(sharding.spec))]
        del spec[axis]
        sharding = NamedSharding(sharding.mesh, P(*spec))
    return jax.ShapeDtypeStruct(tuple(shape), packed.dtype, sharding=sharding)


def _with_open_figure(stats: Any, name: str, value: Any) -> dict[str, Any]:
    """The field of ``stats`` (bare or held by name) that holds the open
    window's figure ``name`` (its packed array bare or in its NNX variable),
    with the figure set to ``value``, placed as it was: ``{field: it}``."""
    path, index, axis = _open_at(name)
    node = stats if len(path) == 1 else _get(stats, path[0])
    held = _get(node, path[-1])
    array = _array(held)
    new = np.array(array)
    new[(..., index, *[slice(None)] * (-axis - 1))] = np.asarray(value)
    field = _like(held, _placed(jnp.asarray(new), array))
    if len(path) == 1:
        return {path[0]: field}
    return {path[0]: _with(node, **{path[1]: field})}


def _fields(node: Any) -> tuple[str, ...]:
    if isinstance(node, Mapping):
        return tuple(node.keys())
    return getattr(node, "_fields", ())


def _with(node: Any, **fields: Any) -> Any:
    if isinstance(node, Mapping):  # a dict, or flax's nnx.State
        kind: Any = type(node)
        return kind({**node, **fields})
    return node._replace(**fields)


def _layout(node: Any) -> str:
    names = _fields(_get(node, "reduction_state"))
    if not names:
        return _LOCAL
    return _WINDOW if "invalid" in names else _SYNCED


def _check_same(name: str, got: Any, want: Any) -> None:
    check_matches(
        f"`restored`'s {name}",
        got,
        want,
        "the template must come from a wrapper configured like the one that "
        "saved the state (the same inner optimizer, params, window_stats, skip "
        "function and window policy), whatever its reduction",
    )


class _Side:
    """One side of a conversion: a wrapper state (restored, or the template),
    its layout and number of devices (1 without a reduction)."""

    def __init__(self, node: Any):
        self.node = node
        self.layout = _layout(node)
        self.rs = _get(node, "reduction_state")
        self.stats = _get(node, "stats")
        # Each leaf's share of the statistics (per_leaf_stats=True), or ().
        self.leaves = _get(self.stats, "leaves") if _fields(self.stats) else ()
        self.lead = int(self.layout != _LOCAL)
        self.devices = (
            int(np.shape(_array(_get(self.rs, "counts")))[0]) if self.lead else 1
        )
        self.acc = jax.tree_util.tree_flatten_with_path(_get(node, "acc_grads"))[0]

    def scalars(self) -> dict[str, Any]:
        """The window's scalars, keyed as :func:`_convert` takes them."""
        out = {k: _array(_get(self.node, f)) for k, f in _SCALAR_FIELDS.items()}
        if _fields(self.stats):
            stats = bare_stats(self.stats)
            out["sq"] = _open_figure(stats, "weighted_sq_norms")
            out["k"] = _open_figure(stats, "microbatches")
            if _fields(self.leaves):
                out["leaf_sq"] = _open_figure(stats, "leaves.weighted_sq_norms")
        return out


def _check_window_arrays(r: _Side, t: _Side) -> None:
    """The restored accumulator has the template's leaves (by path) and
    shapes, and every per-device field one entry per saved device."""
    r_paths, t_paths = [_where(p) for p, _ in r.acc], [_where(p) for p, _ in t.acc]
    if r_paths != t_paths:
        raise ValueError(
            f"`restored`'s accumulator holds {r_paths} where the template's holds "
            f"{t_paths}: the template must be for the same params"
        )
    # The device count is read off the counts: where every accumulator leaf
    # holds another, the counts are the odd one out.
    leading = {np.shape(a)[0] for _, a in r.acc if np.ndim(a)} if r.lead else set()
    if len(leading) == 1 and leading != {r.devices}:
        raise ValueError(
            f"`restored`'s reduction_state.counts has shape ({r.devices},) where "
            f"({leading.pop()},) was expected, one entry per saved device (as "
            "its accumulator's leading axis)"
        )
    for name in _fields(r.rs):
        shape = np.shape(_array(_get(r.rs, name)))
        # Each leaf's shares (per_leaf_stats=True) add an axis of the leaves.
        want = (r.devices,)
        if name == "sq_norms" and _fields(t.leaves):
            want += np.shape(_array(_get(t.leaves, "shares")))[-1:]
        if shape != want:
            raise ValueError(
                f"`restored`'s reduction_state.{name} has shape {shape} where "
                f"{want} was expected, one entry per saved device (as its counts)"
            )
    for (_, a), (path, b) in zip(r.acc, t.acc):
        want = (r.devices,) * r.lead + tuple(np.shape(b)[t.lead :])
        if np.shape(a) != want:
            raise ValueError(
                f"`restored`'s accumulator holds shape {np.shape(a)} at "
                f"{_where(path)} where {want} was expected (the template's"
                + (f", with {r.devices} devices in front)" if r.lead else ")")
            )


def _in_template_dtypes(where: str, got: Any, want: Any) -> Any:
    """:func:`like_template`, whose error says how to change the dtypes."""
    return like_template(
        where,
        got,
        want,
        hint=" (to change `count_dtype` or `accumulator_dtype`: convert onto a "
        "template with the saved run's and no reduction, change them there with "
        "mm.from_other_settings, then convert onto this template)",
    )


def _inputs(r: _Side, t: _Side, like: dict[str, Any]) -> dict[str, Any]:
    """``r``'s window, as :func:`_convert` takes it: in the template's dtypes,
    on its devices (the device axis sharded over them where it divides)."""
    replicated = like["acc_count"].sharding
    inputs: dict[str, Any] = {
        k: _onto(_in_template_dtypes(f"`restored`'s {k}", v, like[k]), replicated)
        for k, v in r.scalars().items()
    }
    inputs["acc"] = [
        _onto(
            _in_template_dtypes(f"`restored`'s accumulator at {_where(path)}", a, b),
            _resized(b.sharding, r.devices) if r.lead and t.lead else replicated,
        )
        for (_, a), (path, b) in zip(r.acc, t.acc)
    ]
    if r.lead:
        count_dtype = jnp.result_type(like["acc_count"])
        dtypes = {**_DEVICE_DTYPES, "counts": count_dtype, "value_counts": count_dtype}
        where = replicated
        if t.lead:
            where = _resized(_array(_get(t.rs, "counts")).sharding, r.devices)
        inputs["rs"] = {
            name: _onto(
                _in_template_dtypes(
                    f"`restored`'s reduction_state.{name}",
                    _array(_get(r.rs, name)),
                    np.zeros((), dtypes[name]),
                ),
                where,
            )
            for name in _fields(r.rs)
        }
    return inputs


def _convert_state(r_node: Any, t_node: Any) -> Any:
    """The wrapper state ``r_node`` in the layout and on the devices of
    ``t_node``."""
    r, t = _Side(r_node), _Side(t_node)
    for name in _fields(t.node):
        if name not in _LAYOUT_FIELDS:
            _check_same(f"`{name}`", _get(r.node, name), _get(t.node, name))
    check_counters(r.node, "`restored`'s `{}`")
    _check_same("`stats`", r.stats, t.stats)
    if _fields(r.stats):
        check_stats_tallies(r.stats, "`restored`'s `{}`")
    _check_window_arrays(r, t)
    like = t.scalars()
    replicated = like["acc_count"].sharding
    if replicated is None:
        raise TypeError(
            "`template`'s arrays must say where they go: pass `tx.init(params)`, "
            "or its abstract form with shardings (ocp.utils.to_shape_dtype_struct)"
        )
    # Where each converted array goes: the template's placement.
    targets: dict[str, Any] = {**like, "acc": [b for _, b in t.acc]}
    if t.lead:
        targets["rs"] = {name: _array(_get(t.rs, name)) for name in _fields(t.rs)}
    out, ok = jax.jit(
        _convert,
        static_argnums=(1, 2, 3),
        out_shardings=(jax.tree.map(lambda w: w.sharding, targets), replicated),
    )(_inputs(r, t, like), (r.layout, t.layout), r.devices, t.devices)
    if not bool(ok):
        raise ValueError(
            "`restored` holds token counts, per device or the window's (or "
            "tallies: invalid counts, microbatches, the loss's token counts) "
            "that are negative or not finite, squared "
            "norms' sums that are negative, or counts that add up beyond the "
            f"count dtype on one of the {t.devices} devices: it cannot continue "
            f"its window on {t.devices} devices"
        )
    out = jax.tree.map(_placed, out, targets)
    # The other fields as restored, in the template's dtypes and placement;
    # the window's own from `out`, in the template's containers.
    fields = {
        name: jax.tree.map(
            lambda g, w, name=name: _placed(
                _in_template_dtypes(f"`restored`'s `{name}`", g, w), w
            ),
            _get(r.node, name),
            _get(t.node, name),
        )
        for name in _fields(t.node)
        if name not in _LAYOUT_FIELDS or name == "stats"
    }
    if _fields(t.stats):
        stats = fields["stats"]
        fields["stats"] = _with(
            stats,
            **_with_open_figure(stats, "weighted_sq_norms", out["sq"]),
            **_with_open_figure(stats, "microbatches", out["k"]),
        )
        if _fields(t.leaves):
            fields["stats"] = _with(
                fields["stats"],
                **_with_open_figure(
                    fields["stats"], "leaves.weighted_sq_norms", out["leaf_sq"]
                ),
            )
    for k, f in _SCALAR_FIELDS.items():
        fields[f] = _like(_get(t.node, f), out[k])
    fields["acc_grads"] = jax.tree.unflatten(
        jax.tree.structure(_get(t.node, "acc_grads")), out["acc"]
    )
    if t.lead:
        fields["reduction_state"] = _with(
            t.rs,
            **{
                name: _like(_get(t.rs, name), out["rs"][name]) for name in _fields(t.rs)
            },
        )
    return _with(t.node, **fields)


def from_device_count(restored: Any, template: Any) -> Any:
    """A window in progress, moved onto the template's devices and reduction.

    ``restored`` is a checkpoint of a :class:`MaskedMultiSteps` state (or of a
    tree holding one) saved with ``reduction=mm.deferred(...)`` on ``D``
    devices, restored against ``device_count_target(template, D)``, or saved
    without a reduction and restored against that wrapper's ``init``. The
    result has ``template``'s structure, placement and dtypes: with a deferred
    reduction on ``D′`` devices, the saved devices' running means and shares
    of the window regrouped onto them (old device ``d`` joins new device
    ``⌊d·D′/D⌋``, see the module docstring; a state without a reduction is
    one device); without one, combined into the one running mean. The window
    continues where it stopped: its mean gradient, token total, loss and
    window statistics are those of the saved state (a group's means are
    combined in float32, as the window's end combines devices; onto the same
    devices and reduction the run continues bit for bit, the running mean of a
    device without tokens, scratch, coming back as zeros). Every other field
    (``mini_step``, the inner optimizer's state, ...) is kept as restored.

    Args:
      restored: the restored tree.
      template: the tree the converted state should match, e.g.
        ``tx.init(params)`` of the wrapper that continues (or its abstract
        form), or a tree holding it: a ``TrainState``, a ``dict`` of items,
        ``nnx.state(optimizer)`` (then ``nnx.update(optimizer, converted)``).
        Its wrapper must be configured like the one that saved the state
        (inner optimizer, params, ``window_stats``, skip function, window
        policy), but for ``reduction=``; window rules that keep no state
        (``k`` alone, a fixed budget alone) stand in for each other, the
        window carried over as :func:`from_other_settings` would carry it.

    Returns:
      ``restored`` converted, in ``template``'s structure, on its devices.

    Raises:
      TypeError: if called under ``jit`` (the restored counts are read); if
        ``restored`` is abstract (a restore target, not what the restore
        returned), or ``template`` is abstract without shardings.
      ValueError: if either tree holds no wrapper state (or several), the
        trees differ outside the window's layout (another configuration, or
        the accumulator for other params), a leaf's shape is not the
        template's (with ``D`` entries along the device axis), a leaf's
        dtype is of another kind or holds values its template dtype cannot,
        or the restored counts, per device or the window's, are negative,
        not finite (or its invalid counts, microbatches or the loss's token
        counts are, or its squared norms' sums, step counters, or the last
        window's microbatches or windows closed negative), or add up beyond
        ``count_dtype`` on a new device (a window whose combined total is past
        it still moves onto as many devices, and is dropped where it closes),
        or
        ``template`` has taken steps and ``restored`` none (the arguments
        swapped).

    Examples:
      Two devices' halves of a window (2 tokens of mean 1, 6 tokens of mean 3)
      moved onto one device keep the window's mean, 2.5:

      >>> import jax, jax.numpy as jnp, optax
      >>> import masked_multistep as mm
      >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1],
      ...                      axis_types=(jax.sharding.AxisType.Auto,))
      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2,
      ...                          reduction=mm.deferred(mesh, "data"))
      >>> params = {"w": jnp.zeros(())}
      >>> template = tx.init(params)
      >>> saved = jax.tree.map(jnp.zeros_like, mm.device_count_target(template, 2))
      >>> saved = saved._replace(  # stands for a checkpoint of two devices
      ...     mini_step=jnp.int32(1),
      ...     acc_grads={"w": jnp.array([1.0, 3.0])},
      ...     reduction_state=saved.reduction_state._replace(
      ...         counts=jnp.array([2.0, 6.0])))
      >>> state = mm.from_device_count(saved, template)
      >>> print(state.acc_grads["w"], state.reduction_state.counts)
      [2.5] [8.]
      >>> updates, state = tx.update({"w": jnp.ones((1,))}, state, params,
      ...                            count=jnp.ones(1))
      >>> print(updates["w"])  # -(8 · 2.5 + 1 · 1) / 9
      -2.3333333

      The same window continues without a reduction:

      >>> local = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
      >>> state = mm.from_device_count(saved, local.init(params))
      >>> print(state.acc_grads["w"], state.acc_count)
      2.5 8.0
    """
    if traced((restored, template)):
        raise TypeError(
            "from_device_count reads the restored token counts to check them, so "
            "it must be called eagerly (outside jit), once, after restoring"
        )
    refuse_restore_target(restored, "`restored`")
    at = _state_path(template, "template")
    if _state_path(restored, "restored") != at:
        raise ValueError(
            "`restored` holds its MaskedMultiStepsState elsewhere than the "
            "template: restore against a target of the template's structure"
        )

    # Outside the wrapper state the trees must hold the same leaves at the
    # same paths; their static parts (a TrainState's `tx`) are the template's.
    t_outside, treedef = jax.tree_util.tree_flatten_with_path(
        template, is_leaf=_is_state
    )
    r_outside = jax.tree_util.tree_flatten_with_path(restored, is_leaf=_is_state)[0]
    t_paths = [_where(p) for p, _ in t_outside]
    r_paths = [_where(p) for p, _ in r_outside]
    if r_paths != t_paths:
        missing = sorted(set(t_paths) - set(r_paths))
        extra = sorted(set(r_paths) - set(t_paths))
        raise ValueError(
            "`restored` does not have the template's structure outside its "
            f"MaskedMultiStepsState: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    # Where the wrapper's scalars are: replicated over the template's devices.
    state = next(x for path, x in t_outside if path == at)
    refuse_swapped(
        next(x for path, x in r_outside if path == at),
        state,
        "restored",
        "from_device_count(restored, template) keeps `restored`'s values in "
        "`template`'s layout: pass the restored checkpoint first, and "
        "`tx.init(params)` (or its abstract form) as the template",
    )
    replicated = _array(_get(state, "acc_count")).sharding
    out = []
    for (path, t), (_, r) in zip(t_outside, r_outside):
        if path == at:
            out.append(_convert_state(r, t))
            continue
        got = _in_template_dtypes(f"`restored` at {_where(path)}", r, t)
        if not isinstance(t, (jax.Array, jax.ShapeDtypeStruct)) and isinstance(
            got, jax.Array
        ):
            # A Python number in the template (a TrainState's step): replicated
            # where the wrapper's state is, not left on the saved devices.
            got = _onto(got, replicated)
        out.append(_placed(got, t))
    return jax.tree.unflatten(treedef, out)
