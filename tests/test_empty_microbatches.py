"""Empty microbatches are as if they had not been passed.

A count-0 microbatch (whose gradient and loss are an all-masked mean's 0/0, or
anything else) adds nothing: with windows that close on tokens or on the norm
test, where it closes no window, a run with such microbatches inserted anywhere
has, after every real microbatch, the same outputs and the same state, bit for
bit, as the run without them; only ``mini_step`` (it counts toward its window)
differs. On the empty microbatch itself the updates are zeros (the params pass
through ``apply_gradients`` untouched) and ``updated`` is False. This holds
with the window statistics, a skip function, int32 counts, and the deferred
reduction on 8 devices. With the deferred reduction, a device that holds no
tokens in a microbatch is ignored whatever its gradient and loss hold.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bit_identical
from _recording import records_value
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm

NDEV, W, L = 8, 3, 12

CONFIGS = {
    "budget": dict(tokens_per_window=100, window_stats=True),
    "ramp": dict(tokens_per_window=lambda seen: 50 + seen / 4, window_stats=True),
    "by_step_skip": dict(
        tokens_per_window=mm.token_budget(lambda s: 40.0 + 30 * s, by="gradient_step"),
        should_skip_update_fn=optax.skip_not_finite,
    ),
    "norm_test": dict(
        norm_test=mm.norm_test(0.9, min_microbatches=3, min_tokens=30, max_tokens=300)
    ),
    "int32": dict(tokens_per_window=100, count_dtype=jnp.int32, window_stats=True),
    "deferred": dict(tokens_per_window=150, window_stats=True, deferred=True),
    "deferred_skip": dict(
        tokens_per_window=70,
        should_skip_update_fn=optax.skip_not_finite,
        deferred=True,
    ),
}


@functools.cache
def _mesh():
    return jax.make_mesh((NDEV,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


@functools.cache
def _setup(name, fused):
    kwargs = dict(CONFIGS[name])
    deferred = kwargs.pop("deferred", False)
    params = jnp.zeros(W)
    if deferred:
        kwargs["reduction"] = mm.deferred(_mesh(), "data")
        params = jax.device_put(params, NamedSharding(_mesh(), P()))
    tx = mm.MaskedMultiSteps(optax.chain(optax.adam(0.1), records_value()), **kwargs)
    if fused:
        step = jax.jit(
            lambda p, s, g, n, v: tx.apply_gradients(g, s, p, count=n, value=v)
        )
    else:
        step = jax.jit(lambda p, s, g, n, v: tx.update(g, s, p, count=n, value=v))
    return tx, params, step, deferred


_BAD = [math.nan, math.inf, -math.inf, 1e30]


# Each configuration through `update` or `apply_gradients` (both for the
# deferred reduction): between them, every rule meets both.
_CASES = [
    ("budget", False),
    ("by_step_skip", True),
    ("deferred", False),
    ("deferred", True),
    ("deferred_skip", True),
    ("int32", True),
    ("norm_test", False),
    ("ramp", True),
]


@pytest.mark.parametrize(
    ("name", "fused"),
    _CASES,
    ids=[f"{n}-{'apply' if f else 'update'}" for n, f in _CASES],
)
def test_empty_microbatches_leave_the_state_as_if_they_were_never_passed(name, fused):
    tx, params, step, deferred = _setup(name, fused)
    dtype = np.int32 if name == "int32" else np.float32
    shape = (L, NDEV) if deferred else (L,)
    data = NamedSharding(_mesh(), P("data")) if deferred else None

    def run(microbatches):
        state, out, trace = tx.init(params), params, []
        for g, n, v in microbatches:
            if deferred:
                g, n = jax.device_put(g, data), jax.device_put(n, data)
            result, state = step(out if fused else params, state, g, n, v)
            if fused:
                out = result
            trace.append((result, state))
        return trace

    applied = []

    @settings(max_examples=8, deadline=None)
    @given(
        where=st.lists(st.integers(0, L), min_size=1, max_size=5),
        bad=st.sampled_from(_BAD),
        seed=st.integers(0, 2**16),
    )
    def check(where, bad, seed):
        rng = np.random.default_rng(seed)
        counts = rng.integers(1, 12 if deferred else 60, size=shape)
        counts[rng.random(shape) < 0.25] = 0
        counts = counts.astype(dtype)
        grads = (rng.normal(size=(*shape, W)) + 0.3).astype(np.float32)
        grads[counts == 0] = np.nan
        if "skip" in name:  # some microbatches for the skip function to reject
            grads.reshape(-1, W)[rng.random(counts.size) < 0.1, 0] = np.inf
        values = rng.normal(size=L).astype(np.float32)
        empty = (
            np.full((*shape[1:], W), bad, np.float32),
            np.zeros(shape[1:], dtype),
            np.float32(bad),
        )
        real = [(grads[i], counts[i], values[i]) for i in range(L)]
        plain = run(real)
        applied.append(int(plain[-1][1].gradient_step))
        mixed, is_real = [], []
        for i in range(L + 1):
            mixed += [empty] * where.count(i)
            is_real += [False] * where.count(i)
            if i < L:
                mixed.append(real[i])
                is_real.append(True)
        padded = run(mixed)
        previous = params
        for (out, state), real_one in zip(padded, is_real, strict=True):
            if not real_one:
                assert not bool(state.updated)
                if fused:
                    assert_bit_identical(out, previous)
                else:
                    assert not np.any(np.asarray(out))
            previous = out
        kept = [x for x, r in zip(padded, is_real, strict=True) if r]
        for (out_a, state_a), (out_b, state_b) in zip(plain, kept, strict=True):
            assert_bit_identical(out_a, out_b)
            assert_bit_identical(
                state_a._replace(mini_step=0), state_b._replace(mini_step=0)
            )
            assert int(state_b.mini_step) >= int(state_a.mini_step)

    check()
    # The runs close windows and apply updates, which the comparison covers.
    assert sum(applied) >= len(applied), applied


@functools.cache
def _deferred_step(synced):
    skip = optax.skip_not_finite if synced else None
    tx = mm.MaskedMultiSteps(
        optax.chain(optax.adam(0.1), records_value()),
        3,
        reduction=mm.deferred(_mesh(), "data"),
        should_skip_update_fn=skip,
        window_stats=True,
    )
    params = jax.device_put(jnp.zeros(W), NamedSharding(_mesh(), P()))
    step = jax.jit(lambda s, g, n, v: tx.update(g, s, params, count=n, value=v))
    return tx, params, step


@pytest.mark.parametrize("synced", [False, True], ids=["per-window", "synced"])
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), int_counts=st.booleans())
def test_a_device_without_tokens_is_ignored_whatever_it_holds(synced, seed, int_counts):
    tx, params, step = _deferred_step(synced)
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 10, size=(7, NDEV)).astype(np.float32)
    counts[rng.random(counts.shape) < 0.4] = 0
    if int_counts:  # integer counts into the float32 total, converted by value
        counts = counts.astype(np.int32)
    grads = rng.normal(size=(7, NDEV, W)).astype(np.float32)
    values = rng.normal(size=(7, NDEV)).astype(np.float32)
    data = NamedSharding(_mesh(), P("data"))
    runs = []
    for fill in (np.nan, np.inf, -1e30):
        g, v = grads.copy(), values.copy()
        g[counts == 0], v[counts == 0] = fill, fill
        state, trace = tx.init(params), []
        for i in range(len(counts)):
            out, state = step(
                state,
                jax.device_put(g[i], data),
                jax.device_put(counts[i], data),
                jax.device_put(v[i], data),
            )
            trace.append((out, state))
        runs.append(trace)
    assert int(runs[0][-1][1].gradient_step) >= 1
    for other in runs[1:]:
        assert_bit_identical(runs[0], other)
