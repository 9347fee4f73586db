"""The data-parallel benchmark's competitors, for ``bench_dp.py``'s worker processes.

Every competitor is a pair ``init(params) -> carry`` and ``step(carry, batch) ->
carry`` jitted with the carry donated, run on a mesh of one axis ``data`` over
the processes' devices. The workload is ``steps.Workload``: ``rows`` rows per
device, so every process computes the same amount whatever the mesh size.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import bench
import jax
import jax.numpy as jnp
import optax
import steps
from _helpers import collectives
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm
from masked_multistep._reduction import mean_over_devices

AXIS = "data"
ROWS_PER_DEVICE = 8
MIN_REDUCTION_BYTES = 1024  # smaller collectives are scalars (token totals)


def machine_info() -> dict[str, Any]:
    """``bench.machine_info()``, with this run's processes and local devices."""
    return {
        **bench.machine_info(),
        "processes": jax.process_count(),
        "local_devices": jax.local_device_count(),
    }


def make_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh(
        (len(jax.devices()),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,)
    )


def workload(width: int) -> steps.Workload:
    return steps.Workload(width=width, rows=ROWS_PER_DEVICE)


@dataclasses.dataclass(frozen=True)
class Competitor:
    name: str
    init: Callable[[Any], Any]
    step: Callable[[Any, Any], Any]
    # Runs on this process's own device only, on its own rows (no global mesh).
    local: bool = False


def per_microbatch(mesh, workload: steps.Workload, k: int) -> Competitor:
    """Automatic sharding: the compiler all-reduces each microbatch's gradient."""
    del mesh
    tx = mm.MaskedMultiSteps(optax.adam(steps.LEARNING_RATE), k)

    def step(carry, batch):
        params, state = carry
        (_, count), grads = jax.value_and_grad(workload.loss_fn, has_aux=True)(
            params, batch
        )
        return tx.apply_gradients(grads, state, params, count=count)

    return Competitor("per-microbatch reduction", lambda p: (p, tx.init(p)), step)


def deferred(mesh, workload: steps.Workload, k: int) -> Competitor:
    """Each device's own gradient, one token-weighted all-reduce per window."""
    tx = mm.MaskedMultiSteps(
        optax.adam(steps.LEARNING_RATE), k, reduction=mm.deferred(mesh, AXIS)
    )
    grad_fn = mm.per_device_value_and_grad(workload.loss_fn, mesh, AXIS)

    def step(carry, batch):
        params, state = carry
        (_, count), grads = grad_fn(params, batch)
        return tx.apply_gradients(grads, state, params, count=count)

    return Competitor("deferred", lambda p: (p, tx.init(p)), step)


def deferred_stats(mesh, workload: steps.Workload, k: int) -> Competitor:
    """:func:`deferred` with ``window_stats=True`` (and the loss as ``value``):
    every device keeps its share of the statistics until the window closes."""
    tx = mm.MaskedMultiSteps(
        optax.adam(steps.LEARNING_RATE),
        k,
        reduction=mm.deferred(mesh, AXIS),
        window_stats=True,
    )
    grad_fn = mm.per_device_value_and_grad(workload.loss_fn, mesh, AXIS)

    def step(carry, batch):
        params, state = carry
        (loss, count), grads = grad_fn(params, batch)
        return tx.apply_gradients(grads, state, params, count=count, value=loss)

    return Competitor("deferred + statistics", lambda p: (p, tx.init(p)), step)


def floor(mesh, workload: steps.Workload, k: int) -> Competitor:
    """The deferred step without its reduction: every process trains its own
    replica on its own rows (``MaskedMultiSteps(adam, k).apply_gradients`` on
    its local device, the inner update once per window), with no
    cross-process communication at all: :func:`per_microbatch`'s step, run on
    one device."""
    step = per_microbatch(mesh, workload, k)
    return dataclasses.replace(step, name="floor", local=True)


def accumulate_only(mesh, workload: steps.Workload, k: int) -> Competitor:
    """Per-device gradients into per-device running means: no optimizer."""
    del k
    grad_fn = mm.per_device_value_and_grad(workload.loss_fn, mesh, AXIS)
    devices = NamedSharding(mesh, P(AXIS))
    size = mesh.shape[AXIS]

    def init(params):
        acc = jax.tree.map(lambda p: jnp.zeros((size, *p.shape), p.dtype), params)
        return params, jax.device_put((acc, jnp.zeros(size, jnp.float32)), devices)

    def step(carry, batch):
        params, (acc, total) = carry
        (_, count), grads = grad_fn(params, batch)
        return params, jax.vmap(mm.running_mean_update)(acc, total, grads, count)

    return Competitor("accumulate only", init, step)


def by_hand(mesh, workload: steps.Workload, k: int) -> Competitor:
    """The deferred step written out without the wrapper (the shape of the
    prototype in the issue): per-device running means, and at the window's end
    one token-weighted all-reduce and an adam update. No count checks, no
    per-microbatch count total, no skip or finiteness logic: what the
    reduction alone costs."""
    grad_fn = mm.per_device_value_and_grad(workload.loss_fn, mesh, AXIS)
    devices = NamedSharding(mesh, P(AXIS))
    size = mesh.shape[AXIS]
    opt = optax.adam(steps.LEARNING_RATE)

    def init(params):
        acc = jax.tree.map(lambda p: jnp.zeros((size, *p.shape), p.dtype), params)
        local = jax.device_put((acc, jnp.zeros(size, jnp.float32)), devices)
        return params, opt.init(params), jnp.zeros([], jnp.int32), local

    def close(params, opt_state, acc, counts):
        mean, _ = mean_over_devices(acc, counts)
        updates, opt_state = opt.update(mean, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jnp.zeros_like(counts)

    def keep(params, opt_state, acc, counts):
        del acc
        return params, opt_state, counts

    def step(carry, batch):
        params, opt_state, i, (acc, counts) = carry
        (_, count), grads = grad_fn(params, batch)
        acc, counts = jax.vmap(mm.running_mean_update)(
            acc, counts, grads, count.astype(counts.dtype)
        )
        params, opt_state, counts = jax.lax.cond(
            i == k - 1, close, keep, params, opt_state, acc, counts
        )
        return params, opt_state, (i + 1) % k, (acc, counts)

    return Competitor("one reduction, by hand", init, step)


COMPETITORS = (
    per_microbatch,
    deferred,
    deferred_stats,
    by_hand,
    floor,
    accumulate_only,
)


def competitors(mesh, workload: steps.Workload, k: int) -> list[Competitor]:
    return [make(mesh, workload, k) for make in COMPETITORS]


def local_batches(mesh, workload: steps.Workload, count: int) -> list[Any]:
    """``count`` global microbatches, as host arrays of all rows."""
    rows = ROWS_PER_DEVICE * mesh.shape[AXIS]
    return [workload.batch(seed, rows=rows) for seed in range(count)]


def local_rows(mesh, batch: Any) -> Any:
    """The rows of ``batch`` that this process's devices hold."""
    sharding = NamedSharding(mesh, P(AXIS))
    rows = jax.tree.leaves(batch)[0].shape[0]
    starts = sorted(
        {
            i[0].start or 0
            for i in sharding.addressable_devices_indices_map((rows,)).values()
        }
    )
    return jax.tree.map(
        lambda x: jnp.concatenate([x[s : s + ROWS_PER_DEVICE] for s in starts], axis=0),
        batch,
    )


def global_batches(mesh, workload: steps.Workload, count: int) -> list[Any]:
    """``count`` global microbatches; each process supplies its own rows."""
    sharding = NamedSharding(mesh, P(AXIS))
    return [
        jax.tree.map(
            lambda x, g: jax.make_array_from_process_local_data(
                sharding, x, global_shape=g.shape
            ),
            local_rows(mesh, batch),
            batch,
        )
        for batch in local_batches(mesh, workload, count)
    ]


def reductions(compiled_text: str, k: int) -> dict[str, int]:
    """Cross-device reductions and bytes per window of ``k`` calls of a step.

    Collectives at the step's top level run on every call; those inside a
    conditional's branch run once per window (the window-closing branch). One
    inside a loop runs a number of times the text does not say: refused rather
    than counted as none.
    """
    found = [c for c in collectives(compiled_text) if c.kind != "all-gather"]
    in_loops = [c for c in found if c.where == "loop"]
    if in_loops:
        raise ValueError(
            f"cannot count reductions per window: {len(in_loops)} collective(s) "
            f"inside a loop ({', '.join(c.kind for c in in_loops)})"
        )
    per_call = [c for c in found if c.where == "step"]
    per_window = [c for c in found if c.where == "branch"]
    big = lambda cs: sum(c.bytes >= MIN_REDUCTION_BYTES for c in cs)  # noqa: E731
    return {
        "reductions_per_window": k * big(per_call) + big(per_window),
        "bytes_per_window": k * sum(c.bytes for c in per_call)
        + sum(c.bytes for c in per_window),
        "scalar_reductions_per_call": len(per_call) - big(per_call),
    }


class Runner:
    """A compiled competitor, its live (donated) carry and one window's batches."""

    def __init__(self, comp: Competitor, mesh, workload: steps.Workload, k: int):
        self.comp = comp
        if comp.local:
            device = jax.local_devices()[0]
            params = jax.device_put(workload.params(), device)
            self.batches = [
                jax.device_put(local_rows(mesh, b), device)
                for b in local_batches(mesh, workload, k)
            ]
        else:
            params = jax.device_put(workload.params(), NamedSharding(mesh, P()))
            self.batches = global_batches(mesh, workload, k)
        self.carry = comp.init(params)
        t0 = time.perf_counter()
        lowered = jax.jit(comp.step, donate_argnums=0).lower(
            self.carry, self.batches[0]
        )
        self.compiled = lowered.compile()
        self.compile_s = time.perf_counter() - t0
        self.temp_bytes = int(self.compiled.memory_analysis().temp_size_in_bytes)
        self.reductions = reductions(self.compiled.as_text(), k)
        self.faults: list[int] = []  # each window's page faults, as bench's

    # Seconds for one window: the same timing as the single-process benchmark.
    window = bench.Runner.window


class AllReduceRunner:
    """One all-reduce of the parameters' bytes alone (a sum over the devices),
    run as a competitor: ``window`` times ``k`` of them, dispatched one after
    the other and waited for at the end, so that divided by ``k`` (as the
    competitors' windows are) it is the time of one all-reduce, measured in the
    same rounds as they are."""

    def __init__(self, mesh, workload: steps.Workload, k: int):
        size = mesh.shape[AXIS]
        self.stacked = jax.device_put(
            jax.tree.map(
                lambda p: jnp.broadcast_to(p, (size, *p.shape)), workload.params()
            ),
            NamedSharding(mesh, P(AXIS)),
        )
        reduce = jax.jit(lambda t: jax.tree.map(lambda x: x.sum(0), t))
        self.compiled = reduce.lower(self.stacked).compile()
        found = collectives(self.compiled.as_text())
        assert sum(c.bytes for c in found) == workload.param_bytes, found
        self.k = k

    def window(self) -> float:
        # Waited for once, at the end, as the competitors' windows are (a wait
        # after each would add a host round trip to every all-reduce).
        t0 = time.perf_counter()
        jax.block_until_ready([self.compiled(self.stacked) for _ in range(self.k)])
        return time.perf_counter() - t0


def summary(times: list[float]) -> float:
    return statistics.median(times)
