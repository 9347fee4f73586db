"""MaskedMultiSteps with windows that close on a token budget.

The wrapper is driven over random microbatch sequences (zero counts, skipped
microbatches and invalid counts included) and compared with a plain-Python
float64 model: windows close where the model says, and each emitted update is
the inner optimizer on the window's token-mean gradient.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import collectives, large
from flax import serialization
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm

DIM = 3
MAX_LEN = 32
INT32_MAX = 2**31 - 1
MOMENTUM = 0.5

# A microbatch: ("ok", n) is counted (n = 0 included, its gradient NaN);
# ("skip", n) has a non-finite gradient that `optax.skip_not_finite` rejects;
# ("invalid", -1) has a count that is rejected under jit.
item_st = st.one_of(
    st.tuples(st.just("ok"), st.one_of(st.just(0), st.integers(1, 200))),
    st.tuples(st.just("skip"), st.integers(1, 200)),
    st.tuples(st.just("invalid"), st.just(-1)),
)
items_st = st.lists(item_st, min_size=1, max_size=MAX_LEN).filter(
    lambda items: any(kind == "ok" for kind, _ in items)
)


# --- the plain-Python model ---------------------------------------------------


def model_windows(items, budget_of, cap_of=None):
    """Where windows close: ``budget_of(seen, step)``, ``cap_of(step)``.

    Returns ``(windows, open_window, seen)``: the closed windows as lists of
    the indices of their counted microbatches, the open window's, and the
    tokens of the closed windows. Skipped and invalid microbatches are as if
    they never happened.
    """
    windows, current, tokens, seen, step = [], [], 0, 0, 0
    for i, (kind, n) in enumerate(items):
        if kind != "ok":
            continue
        current.append(i)
        tokens += n
        done = tokens > 0 and tokens >= budget_of(seen, step)
        if cap_of is not None:
            done = done or len(current) >= cap_of(step)
        if done:
            windows.append(current)
            seen += tokens
            step += tokens > 0
            current, tokens = [], 0
    return windows, current, seen


def window_mean(grads, counts, window):
    """float64 token-mean gradient of a window (None without tokens)."""
    n = np.asarray([counts[i] for i in window], np.float64)
    if n.sum() == 0:
        return None
    live = n > 0
    g = np.asarray([grads[i] for i in window], np.float64)
    return (n[live, None] * g[live]).sum(0) / n.sum()


def model_momentum_updates(grads, counts, windows):
    """float64 ``optax.sgd(1.0, momentum)`` on each window's mean: the update
    emitted at each window's last microbatch (windows without tokens emit none
    and leave the momentum as it was)."""
    trace, out = np.zeros(DIM), {}
    for w in windows:
        mean = window_mean(grads, counts, w)
        if mean is None:
            continue
        trace = mean + MOMENTUM * trace
        out[w[-1]] = -trace
    return out


def make_data(items, seed, mean=None):
    """Gradients and counts for ``items``, padded to ``MAX_LEN``. With ``mean``,
    microbatch ``i`` has gradient ``mean + ε/√nᵢ``, ``ε ~ N(0, I)`` (per-token
    noise of unit variance per coordinate); else ``ε`` alone."""
    rng = np.random.default_rng(seed)
    grads = rng.normal(size=(MAX_LEN, DIM))
    counts = np.full(MAX_LEN, -1, np.int32)  # padding: invalid counts
    if mean is not None:
        n = np.maximum([n for _, n in items] + [1] * (MAX_LEN - len(items)), 1)
        grads = mean + grads / np.sqrt(n)[:, None]
    grads = grads.astype(np.float32)
    for i, (kind, n) in enumerate(items):
        counts[i] = n
        if kind == "skip":
            grads[i, i % DIM] = np.inf
        elif n <= 0:
            grads[i] = np.nan  # a masked loss's 0/0; never read
    return grads, counts


def drive(tx, grads, counts):
    """``lax.scan`` of ``tx.update`` from ``tx.init``: per microbatch, the
    updates and ``updated``; and the final state."""
    params = jnp.zeros(DIM)

    def body(state, x):
        g, n = x
        updates, state = tx.update(g, state, params, count=n)
        return state, (updates, state.updated)

    state, (updates, updated) = jax.lax.scan(body, tx.init(params), (grads, counts))
    return state, updates, updated


def check_against_model(items, grads, counts, windows, rest, seen, out):
    state, updates, updated = out
    updates = np.asarray(updates)
    n_items = len(items)
    expected = model_momentum_updates(grads, counts, windows)
    assert np.flatnonzero(np.asarray(updated)).tolist() == sorted(expected)
    for i, u in expected.items():
        np.testing.assert_allclose(updates[i], u, rtol=1e-5, atol=1e-6)
    # Between windows the updates are zeros.
    quiet = [i for i in range(MAX_LEN) if i not in expected]
    assert not np.any(updates[quiet])
    assert int(state.gradient_step) == len(expected)
    assert int(state.mini_step) == len(rest)
    assert float(state.acc_count) == sum(counts[i] for i in rest)
    invalid = sum(kind == "invalid" for kind, _ in items) + MAX_LEN - n_items
    assert int(state.num_invalid_counts) == invalid
    return state


def tx_by_tokens_seen(b0, slope, cap):
    return mm.MaskedMultiSteps(
        optax.sgd(1.0, momentum=MOMENTUM),
        lambda step: cap,
        tokens_per_window=lambda seen: b0 + slope * seen,
        should_skip_update_fn=optax.skip_not_finite,
    )


@jax.jit
def _run_by_tokens_seen(grads, counts, b0, slope, cap):
    return drive(tx_by_tokens_seen(b0, slope, cap), grads, counts)


@settings(max_examples=40, deadline=None)
@given(
    items=items_st,
    b0=st.integers(1, 500),
    slope=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
    cap=st.one_of(st.just(INT32_MAX), st.integers(1, 6)),
    seed=st.integers(0, 2**16),
)
def test_budget_by_tokens_seen_closes_where_the_model_says(items, b0, slope, cap, seed):
    """A budget ``b0 + slope · seen`` (exact in float32 here), capped at ``cap``
    microbatches: windows, updates and the final state as the model says."""
    grads, counts = make_data(items, seed)
    windows, rest, seen = model_windows(
        items, lambda seen, step: b0 + slope * seen, lambda step: cap
    )
    out = _run_by_tokens_seen(
        grads, counts, np.float32(b0), np.float32(slope), np.int32(cap)
    )
    state = check_against_model(items, grads, counts, windows, rest, seen, out)
    # The policy's state: the tokens of all completed windows, exactly.
    assert float(state.policy_state[1]) == seen


@jax.jit
def _run_by_gradient_step(grads, counts, table, cap):
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0, momentum=MOMENTUM),
        lambda step: cap,
        tokens_per_window=mm.token_budget(
            lambda step: table[jnp.minimum(step, 3)], by="gradient_step"
        ),
        should_skip_update_fn=optax.skip_not_finite,
    )
    return drive(tx, grads, counts)


@settings(max_examples=30, deadline=None)
@given(
    items=items_st,
    table=st.lists(st.integers(1, 400), min_size=4, max_size=4),
    cap=st.one_of(st.just(INT32_MAX), st.integers(1, 6)),
    seed=st.integers(0, 2**16),
)
def test_budget_by_gradient_step_closes_where_the_model_says(items, table, cap, seed):
    grads, counts = make_data(items, seed)
    windows, rest, seen = model_windows(
        items, lambda seen, step: table[min(step, 3)], lambda step: cap
    )
    out = _run_by_gradient_step(
        grads, counts, np.asarray(table, np.float32), np.int32(cap)
    )
    check_against_model(items, grads, counts, windows, rest, seen, out)


@settings(max_examples=10, deadline=None)
@given(items=items_st, budget=st.integers(1, 600), seed=st.integers(0, 2**16))
def test_constant_budget_without_a_cap(items, budget, seed):
    """``tokens_per_window=int`` alone (one compilation per example)."""
    grads, counts = make_data(items, seed)
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0, momentum=MOMENTUM),
        tokens_per_window=budget,
        should_skip_update_fn=optax.skip_not_finite,
    )
    windows, rest, seen = model_windows(items, lambda seen, step: budget)
    out = jax.jit(drive, static_argnums=0)(tx, grads, counts)
    check_against_model(items, grads, counts, windows, rest, seen, out)
    assert out[0].policy_state == ()  # a constant budget keeps no state


def test_window_closes_on_the_microbatch_that_reaches_the_budget():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=100)
    params = jnp.zeros(())
    update = jax.jit(tx.update)
    state = tx.init(params)
    seen = []
    for g, n in [(1.0, 40), (jnp.nan, 0), (2.0, 60), (3.0, 99), (4.0, 1), (5.0, 250)]:
        updates, state = update(jnp.float32(g), state, params, count=jnp.float32(n))
        seen.append(round(float(updates), 5) if bool(state.updated) else None)
    # 40 + 0 + 60 = 100 closes on the budget exactly; 99 + 1 = 100; 250 alone
    # overshoots it.
    assert seen == [None, None, -1.6, None, -3.01, -5.0]
    assert int(state.gradient_step) == 3


def test_cap_closes_a_window_short_of_its_budget():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 3, tokens_per_window=1000)
    params = jnp.zeros(())
    state = tx.init(params)
    closed = []
    for n in [10, 0, 20, 990, 20, 1]:
        _, state = tx.update(jnp.float32(1.0), state, params, count=jnp.float32(n))
        closed.append(bool(state.updated))
    # The third microbatch (the cap, 30 tokens); then 990 + 20 >= 1000.
    assert closed == [False, False, True, False, True, False]


def test_adam_update_equals_adam_on_each_windows_mean():
    counts = [30, 0, 50, 120, 7, 7, 7, 90, 3]
    items = [("ok", n) for n in counts]
    grads, padded = make_data(items, 0)
    params = jnp.zeros(DIM)
    tx = mm.MaskedMultiSteps(optax.adam(0.1), tokens_per_window=64)
    update = jax.jit(tx.update)
    state = tx.init(params)
    windows, _, _ = model_windows(items, lambda seen, step: 64)
    ref_tx = optax.adam(0.1)
    ref_state = ref_tx.init(params)
    ends = {w[-1]: w for w in windows}
    for i, n in enumerate(counts):
        updates, state = update(grads[i], state, params, count=jnp.float32(n))
        assert bool(state.updated) == (i in ends)
        if i in ends:
            mean = window_mean(grads, padded, ends[i])
            expected, ref_state = ref_tx.update(
                jnp.asarray(mean, jnp.float32), ref_state
            )
            np.testing.assert_allclose(updates, expected, rtol=1e-6, atol=1e-7)
    assert int(state.gradient_step) == len(windows) == 3


def test_count_dtypes_compare_the_budget_exactly():
    # int32 totals far beyond float32's 2**24: the budget is compared exactly.
    budget = 2**25 + 1
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), tokens_per_window=budget, count_dtype=jnp.int32
    )
    params = jnp.zeros(())
    step = jax.jit(tx.update)
    state = tx.init(params)
    _, state = step(jnp.float32(1.0), state, params, count=jnp.int32(2**25))
    assert not bool(state.updated)
    _, state = step(jnp.float32(1.0), state, params, count=jnp.int32(1))
    assert bool(state.updated)


@pytest.mark.parametrize(
    "rules",
    [
        dict(tokens_per_window=lambda seen: 50 + seen / 10),
        dict(norm_test=mm.norm_test(0.9, min_microbatches=2)),
    ],
    ids=["budget", "norm_test"],
)
def test_no_retrace_and_fixed_state_shape(rules):
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 8, **rules)
    params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
    state0 = tx.init(params)

    traces = []

    @jax.jit
    def step(params, state, g, n):
        traces.append(None)
        return tx.apply_gradients(
            jax.tree.map(lambda p: jnp.full_like(p, g), params), state, params, count=n
        )

    state = state0
    for i, n in enumerate([0, 30, 31, 5, 60, 0, 2, 7, 9]):
        params, state = step(params, state, jnp.float32(i), jnp.float32(n))
        chex.assert_trees_all_equal_shapes_and_dtypes(state, state0)
    assert len(traces) == 1
    assert int(state.gradient_step) >= 2


def _resumable_run(tx, grads, counts):
    """``go(params, state, lo, hi)`` runs microbatches ``lo..hi-1`` through the
    jitted ``apply_gradients``; ``template`` is the fresh ``(params, state)``."""
    step = jax.jit(lambda p, s, g, n: tx.apply_gradients(g, s, p, count=n))

    def go(params, state, lo, hi):
        for i in range(lo, hi):
            params, state = step(params, state, grads[i], jnp.float32(counts[i]))
        return params, state

    params0 = jnp.zeros(DIM)
    return go, (params0, tx.init(params0))


def test_mid_window_checkpoint_resumes_bit_identically_at_every_microbatch():
    counts = [20, 0, 30, 45, 10, 70, 5, 5, 80, 1, 0, 33]
    items = [("ok", n) for n in counts]
    grads, _ = make_data(items, 1)
    tx = mm.MaskedMultiSteps(
        optax.adam(0.1), 5, tokens_per_window=lambda seen: 40 + seen / 4
    )
    go, template = _resumable_run(tx, grads, counts)
    straight = go(*template, 0, len(counts))
    assert int(straight[1].gradient_step) >= 3
    mid_window = 0
    for split in range(1, len(counts)):
        params, state = go(*template, 0, split)
        mid_window += int(state.mini_step) > 0
        blob = serialization.to_bytes((params, state))
        restored = serialization.from_bytes(template, blob)
        chex.assert_trees_all_equal(restored, (params, state))
        chex.assert_trees_all_equal(go(*restored, split, len(counts)), straight)
    assert mid_window >= 5


def test_train_state_nnx_and_chain():
    from flax import nnx

    tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=10)
    # mm.TrainState
    ts = mm.TrainState.create(apply_fn=None, params=jnp.zeros(2), tx=tx)
    for g, n in [(1.0, 4), (2.0, 6)]:
        ts = ts.apply_gradients(grads=jnp.full(2, g), count=jnp.float32(n))
    np.testing.assert_allclose(ts.params, -1.6)
    assert int(ts.opt_state.gradient_step) == 1
    # optax.chain: the chain forwards `count=`.
    chain = optax.chain(optax.scale(2.0), tx)
    cs = chain.init(jnp.zeros(2))
    for g, n in [(1.0, 4), (2.0, 6)]:
        u, cs = chain.update(jnp.full(2, g), cs, count=jnp.float32(n))
    np.testing.assert_allclose(u, -3.2)
    # NNX
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    before = model.bias[...]
    for n in (4, 6):
        grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
        opt.update(model, grads, count=jnp.float32(n))
    np.testing.assert_allclose(model.bias[...], before - 1.0)


def test_tokens_schedule_drives_the_inner_learning_rate_by_tokens():
    # A warmup over 400 tokens with windows of 100: lr 0, 0.25, 0.5, 0.75, 1.
    warmup = optax.linear_schedule(0.0, 1.0, transition_steps=400)
    tx = mm.MaskedMultiSteps(
        optax.sgd(mm.tokens_schedule(warmup, tokens_per_step=100)),
        tokens_per_window=100,
    )
    params = jnp.zeros(())
    state = tx.init(params)
    lrs = []
    for _ in range(5):
        updates, state = tx.update(jnp.float32(1.0), state, params, count=100.0)
        lrs.append(-float(updates))
    np.testing.assert_allclose(lrs, [0.0, 0.25, 0.5, 0.75, 1.0])


def test_at_least_one_window_rule_is_required():
    with pytest.raises(TypeError, match="every_k_schedule.*tokens_per_window"):
        mm.MaskedMultiSteps(optax.sgd(1.0))


def test_bad_window_arguments():
    with pytest.raises(ValueError, match="`tokens_per_window` must be finite and > 0"):
        mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=0)
    with pytest.raises(
        ValueError,
        match="`tokens_per_window` must be finite.*got inf: for windows with no "
        "token limit, give every_k_schedule alone",
    ):
        mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=float("inf"))
    with pytest.raises(TypeError, match="`tokens_per_window` must be a real number"):
        mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window="4096")
    with pytest.raises(TypeError, match="`tokens_per_window` must be a real number"):
        mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=True)
    with pytest.raises(ValueError, match="`every_k_schedule` must be >= 1"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 0, tokens_per_window=10)


def test_repr_and_copy_keep_the_window_rules():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 4, tokens_per_window=4096)
    assert "every_k_schedule=4, tokens_per_window=4096" in repr(tx)
    # Scalar arrays show as the numbers they hold (not `Array(4, dtype=...)`).
    arrays = mm.MaskedMultiSteps(
        optax.sgd(1.0), jnp.array(4), tokens_per_window=np.float32(4096.5)
    )
    assert "every_k_schedule=4, tokens_per_window=4096.5," in repr(arrays)
    # A policy shows as the call that built it.
    budget = mm.token_budget(4096, max_microbatches=16)
    assert repr(budget) == "mm.token_budget(4096, max_microbatches=16)"
    assert "tokens_per_window=mm.token_budget(4096, max_microbatches=16)" in repr(
        mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=budget)
    )
    test = mm.norm_test(0.5, min_tokens=1000, max_microbatches=64)
    assert "norm_test=mm.norm_test(0.5, min_tokens=1000, max_microbatches=64)" in repr(
        mm.MaskedMultiSteps(optax.sgd(1.0), norm_test=test)
    )
    rebuild, args = tx.__reduce__()  # what pickle rebuilds it from
    again = rebuild(*args)
    assert again is not tx and repr(again) == repr(tx)
    params = jnp.zeros(())
    state = again.init(params)
    _, state = again.update(jnp.float32(1.0), state, params, count=5000.0)
    assert bool(state.updated)


# --- the deferred data-parallel reduction ---------------------------------------

NDEV, H = 8, 16


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) == NDEV, "conftest sets jax_num_cpu_devices=8"
    return jax.make_mesh((NDEV,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _dp_loss(params, mb):
    pred = jnp.tanh(mb["x"] @ params["w1"].T) @ params["w2"]
    return mm.masked_mean((pred - mb["y"]) ** 2, mb["mask"])


def _dp_params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(H, DIM)), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(H,)), jnp.float32),
    }


def _dp_microbatches(num):
    rng = np.random.default_rng(1)
    out = []
    for _ in range(num):
        lengths = rng.integers(0, 5, size=2 * NDEV)
        mask = np.arange(4)[None, :] < lengths[:, None]
        out.append(
            {
                "x": rng.normal(size=(2 * NDEV, 4, DIM)).astype(np.float32),
                "y": rng.normal(size=(2 * NDEV, 4)).astype(np.float32),
                "mask": mask,
            }
        )
    return out


def test_token_budget_with_the_deferred_reduction_equals_one_device(mesh):
    """Every device closes on the same microbatch (the policy reads the global
    token total); the gradients are reduced once per window, in the branch
    that closes it, and the policy adds no collective."""
    batches = _dp_microbatches(12)
    budget = 40

    def make_tx(reduction=None):
        return mm.MaskedMultiSteps(
            optax.adam(1e-1),
            tokens_per_window=lambda seen: budget + seen / 8,
            reduction=reduction,
        )

    # One device: each microbatch's full-batch gradient.
    tx = make_tx()
    device = jax.devices()[0]

    @jax.jit
    def ref_step(params, state, mb):
        (_, count), grads = jax.value_and_grad(_dp_loss, has_aux=True)(params, mb)
        return tx.apply_gradients(grads, state, params, count=count)

    ref_params = jax.device_put(_dp_params(), device)
    ref_state = tx.init(ref_params)
    ref_updated = []
    for mb in batches:
        ref_params, ref_state = ref_step(ref_params, ref_state, mb)
        ref_updated.append(bool(ref_state.updated))
    assert 3 <= sum(ref_updated) < len(batches)

    dtx = make_tx(mm.deferred(mesh, "data"))
    grad_fn = mm.per_device_value_and_grad(_dp_loss, mesh, "data")

    @jax.jit
    def step(params, state, mb):
        (_, count), grads = grad_fn(params, mb)
        return dtx.apply_gradients(grads, state, params, count=count)

    params = jax.device_put(_dp_params(), NamedSharding(mesh, P()))
    state = dtx.init(params)
    data = NamedSharding(mesh, P("data"))
    text = step.lower(params, state, jax.device_put(batches[0], data)).compile()
    found = large(collectives(text.as_text()), min_bytes=4 * H)
    assert [(c.kind, c.where) for c in found] == [("all-reduce", "branch")], found
    small = [c for c in collectives(text.as_text()) if c not in found]
    assert [(c.kind, c.where) for c in small] == [("all-reduce", "step")], small
    updated = []
    for mb in batches:
        params, state = step(params, state, jax.device_put(mb, data))
        updated.append(bool(state.updated))
    assert updated == ref_updated
    chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal(state.policy_state, ref_state.policy_state)


# --- the norm test ------------------------------------------------------------


def norm_figures(grads, counts):
    """float64 ``(N, K, ‖ḡ‖², tr Σ̂)`` of a window's microbatches."""
    n = np.asarray(counts, np.float64)
    live = n > 0
    g, n = np.asarray(grads, np.float64)[live], n[live]
    tokens, k = n.sum(), int(live.sum())
    if k == 0:
        return 0.0, 0, np.nan, np.nan
    mean = (n[:, None] * g).sum(0) / tokens
    spread = (n * ((g - mean) ** 2).sum(1)).sum()
    return tokens, k, float(mean @ mean), spread / (k - 1) if k >= 2 else np.nan


@functools.partial(jax.jit, static_argnums=2)
def _run_norm_test(grads, counts, theta, max_mb):
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0, momentum=MOMENTUM),
        lambda step: max_mb,
        norm_test=mm.norm_test(theta, min_microbatches=2),
        should_skip_update_fn=optax.skip_not_finite,
    )
    return drive(tx, grads, counts)


small_items_st = st.lists(
    st.one_of(
        st.tuples(st.just("ok"), st.one_of(st.just(0), st.integers(1, 16))),
        st.tuples(st.just("skip"), st.integers(1, 16)),
        st.tuples(st.just("invalid"), st.just(-1)),
    ),
    min_size=MAX_LEN // 2,
    max_size=MAX_LEN,
)


@settings(max_examples=60, deadline=None)
@given(
    items=small_items_st,
    g_norm=st.floats(0.25, 2.0),
    theta=st.sampled_from([0.3, 0.6, 0.9]),
    max_mb=st.integers(2, 16),
    seed=st.integers(0, 2**16),
)
def test_norm_test_closes_where_the_float64_model_says(
    items, g_norm, theta, max_mb, seed
):
    """``tr Σ̂ / N <= θ²‖ḡ‖²`` with ``K >= 2``, from the second microbatch on,
    capped at ``max_mb``, against a float64 model over random microbatches
    (zero counts, skipped microbatches, invalid counts) with per-token noise
    about a mean gradient of norm ``g_norm``. Decisions within float32
    rounding of the boundary are not compared."""
    grads, counts = make_data(items, seed, mean=g_norm / np.sqrt(DIM))
    windows, current = [], []
    for i, (kind, _) in enumerate(items):
        if kind != "ok":
            continue
        current.append(i)
        tokens, k, sq, var = norm_figures(grads[current], counts[current])
        lhs, rhs = var, theta**2 * tokens * sq
        assume(not (k >= 2 and abs(lhs - rhs) <= 1e-3 * max(abs(lhs), abs(rhs))))
        passes = k >= 2 and len(current) >= 2 and lhs <= rhs
        if passes or len(current) >= max_mb:
            windows.append(current)
            current = []
    out = _run_norm_test(grads, counts, theta, np.int32(max_mb))
    state = check_against_model(items, grads, counts, windows, current, 0, out)
    # The statistics of the last window are its tokens and counted microbatches.
    if windows:
        last = [counts[i] for i in windows[-1]]
        assert float(state.stats.last.tokens) == sum(last)
        assert int(state.stats.last.microbatches) == sum(n > 0 for n in last)


def test_norm_test_windows_grow_as_the_gradient_shrinks_against_its_noise():
    """SGD on ``½‖x‖²`` with per-token gradient noise of variance ``σ²`` per
    coordinate: at ``x`` the test passes, on average, once the window holds
    ``N ≈ (1 − θ²)/θ² · dσ²/‖x‖²`` tokens. As SGD shrinks ``x``, the windows
    grow as predicted (``x`` is fixed within a window)."""
    d, sigma, n, theta = 8, 1.0, 4, 0.5
    tx = mm.MaskedMultiSteps(
        optax.sgd(0.05),
        norm_test=mm.norm_test(theta, min_microbatches=2, max_microbatches=100_000),
    )

    @jax.jit
    def run(key):
        def body(carry, key):
            params, state = carry
            noise = sigma / np.sqrt(n) * jax.random.normal(key, (d,))
            sq_before = jnp.sum(params**2)
            params, state = tx.apply_gradients(
                params + noise, state, params, count=jnp.float32(n)
            )
            return (params, state), (state.updated, sq_before, state.stats.last)

        params = jnp.full(d, 2.0)  # ‖x‖² = 32
        return jax.lax.scan(
            body, (params, tx.init(params)), jax.random.split(key, 6000)
        )

    _, (updated, sq_before, last) = run(jax.random.key(0))
    ends = np.flatnonzero(np.asarray(updated))
    starts = np.concatenate([[0], ends[:-1] + 1])
    tokens = np.asarray(last.tokens)[ends]
    np.testing.assert_array_equal(tokens, n * (ends - starts + 1))
    predicted = (1 - theta**2) / theta**2 * d * sigma**2 / np.asarray(sq_before)[starts]
    # Windows above the 2-microbatch minimum, in order: they grow.
    free = predicted >= 4 * n
    ratio = tokens[free] / predicted[free]
    assert free.sum() >= 30, tokens
    assert 0.7 <= np.median(ratio) <= 1.3, (np.median(ratio), tokens, predicted)
    thirds = np.array_split(tokens, 3)
    assert np.median(thirds[2]) > 10 * np.median(thirds[0]), tokens


def test_norm_test_with_budgets_resumes_bit_identically_mid_window():
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 40, size=30)
    grads = (1.0 + rng.normal(size=(30, DIM))).astype(np.float32)
    tx = mm.MaskedMultiSteps(
        optax.adam(0.1),
        tokens_per_window=lambda seen: 200 + seen / 4,
        norm_test=mm.norm_test(0.7, min_tokens=20, min_microbatches=3),
    )
    go, template = _resumable_run(tx, grads, counts)
    straight = go(*template, 0, len(counts))
    assert int(straight[1].gradient_step) >= 3
    for split in (5, 11, 17, 23):
        params, state = go(*template, 0, split)
        blob = serialization.to_bytes((params, state))
        restored = serialization.from_bytes(template, blob)
        chex.assert_trees_all_equal(go(*restored, split, len(counts)), straight)


def test_norm_test_arguments():
    with pytest.raises(ValueError, match="maximum"):
        mm.MaskedMultiSteps(optax.sgd(1.0), norm_test=0.5)
    with pytest.raises(ValueError, match="maximum"):
        mm.MaskedMultiSteps(optax.sgd(1.0), norm_test=mm.norm_test(0.5))
    with pytest.raises(ValueError, match="theta"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 4, norm_test=-1.0)
    with pytest.raises(TypeError, match="norm_test"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 4, norm_test="0.5")
    # Any maximum will do; the statistics are then kept.
    for tx in (
        mm.MaskedMultiSteps(optax.sgd(1.0), 16, norm_test=0.5),
        mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=1e4, norm_test=0.5),
        mm.MaskedMultiSteps(
            optax.sgd(1.0), norm_test=mm.norm_test(0.5, max_tokens=1e4)
        ),
    ):
        assert tx.init(jnp.zeros(2)).stats != ()
        assert "norm_test=" in repr(tx) and "window_stats=True" in repr(tx)


def test_norm_test_with_the_deferred_reduction_is_refused(mesh):
    with pytest.raises(ValueError, match="reduction=None with `norm_test`"):
        mm.MaskedMultiSteps(
            optax.sgd(1.0), 16, norm_test=0.5, reduction=mm.deferred(mesh, "data")
        )
