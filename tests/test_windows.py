"""Window policies: the pure functions close windows where a plain-Python model does.

Each policy is driven over random count sequences (zeros included) by the same
window mechanics the wrapper uses (fold the microbatch in, ask ``closes``,
``update``, reset on a close), under ``jit`` and ``lax.scan``, and compared
with a float64 model of its documented rule.
"""

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import masked_multistep as mm
from masked_multistep import _windows as w

F32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = 2**31 - 1

counts_st = st.lists(
    st.one_of(st.just(0), st.integers(1, 300)), min_size=1, max_size=40
)


# --- plain-Python models ----------------------------------------------------


def model_k(k):
    """every_k's documented sanitisation of a schedule's value."""
    if isinstance(k, float):
        if math.isnan(k):
            return 1
        if math.isinf(k):
            return 1 if k < 0 else INT32_MAX
        k = round(k)  # half to even, as jnp.round
        return int(min(max(k, 1), INT32_MAX))
    return int(min(max(k, 1), INT32_MAX))


def model_budget(b):
    """token_budget's documented sanitisation of a callable's value (float32)."""
    b = float(b)
    if math.isnan(b):
        return 0.0
    return float(np.float32(min(max(b, 0.0), F32_MAX)))


def model_run(counts, decide):
    """Window mechanics in Python: ``decide(mb, tokens, step, seen) -> bool``."""
    mb = tokens = step = seen = 0
    closes = []
    for n in counts:
        mb += 1
        tokens += n
        done = bool(decide(mb, tokens, step, seen))
        closes.append(done)
        if done:
            seen += tokens
            step += tokens > 0
            mb = tokens = 0
    return closes


def reached(tokens, budget):
    return tokens > 0 and tokens >= budget


# --- the implementation, driven under jit / scan -------------------------------


def drive(policy, counts, count_dtype=jnp.float32):
    """``lax.scan`` over the counts: the close flags and the final policy state."""

    def body(carry, n):
        pstate, mb, tokens, step = carry
        mb = mb + 1
        tokens = tokens + n.astype(count_dtype)
        s = w.WindowScalars(mb, tokens, step)
        closed = policy.closes(pstate, s)
        pstate = policy.update(pstate, s, closed)
        step = jnp.where(closed & (tokens > 0), step + 1, step)
        mb = jnp.where(closed, 0, mb)
        tokens = jnp.where(closed, jnp.zeros_like(tokens), tokens)
        return (pstate, mb, tokens, step), closed

    zero = jnp.zeros([], jnp.int32)
    carry = (policy.init(), zero, jnp.zeros([], count_dtype), zero)
    carry, closes = jax.lax.scan(body, carry, counts)
    return closes, carry[0]


def run(policy, counts, count_dtype=jnp.float32):
    """The close flags of ``policy`` (a new trace for each policy)."""
    closes, _ = jax.jit(lambda c: drive(policy, c, count_dtype))(
        jnp.asarray(counts, jnp.int32)
    )
    return [bool(c) for c in closes]


MAX_LEN = 40
_COMPILED = {}


def run_traced(make_policy, counts, *args, count_dtype=jnp.float32):
    """``drive(make_policy(*args), counts)``, compiled once per ``make_policy``.

    The policy's parameters are traced and the counts padded with zeros to
    ``MAX_LEN`` (later microbatches cannot change earlier decisions), so
    hypothesis examples share one compilation.
    """
    key = (make_policy, jnp.dtype(count_dtype)) + tuple(
        jnp.result_type(a) for a in args
    )
    if key not in _COMPILED:
        _COMPILED[key] = jax.jit(lambda c, *a: drive(make_policy(*a), c, count_dtype))
    padded = np.zeros(MAX_LEN, np.int32)
    padded[: len(counts)] = counts
    closes, state = _COMPILED[key](padded, *args)
    return [bool(c) for c in closes[: len(counts)]], state


def _table(values):
    """A schedule table padded to 4 entries: one dtype, and its length."""
    is_float = any(isinstance(v, float) for v in values)
    values = [float(v) for v in values] if is_float else list(values)
    arr = np.zeros(4, np.float32 if is_float else np.int32)
    arr[: len(values)] = values
    return values, arr, np.int32(len(values))


# --- every_k -------------------------------------------------------------------

k_values = st.one_of(
    st.integers(-3, 6),
    st.floats(-2.0, 7.0),
    st.sampled_from([math.nan, math.inf, -math.inf, 2.5, 3.5, 1e12, 2.0**31]),
)


def _norm_scalars(microbatches, tokens, counted, sq, var):
    return mm.WindowScalars(
        jnp.int32(microbatches),
        jnp.float32(tokens),
        jnp.int32(0),
        counted=jnp.int32(counted),
        grad_sq_norm=jnp.float32(sq),
        grad_var_trace=jnp.float32(var),
    )


@settings(max_examples=25, deadline=None)
@given(counts=counts_st, table=st.lists(k_values, min_size=1, max_size=4))
def test_microbatch_window_schedule_matches_model(counts, table):
    table, arr, length = _table(table)
    expected = model_run(
        counts,
        lambda mb, tok, step, seen: mb >= model_k(table[step % len(table)]),
    )
    assert run_traced(_k_table, counts, arr, length)[0] == expected


def _k_table(arr, length):
    return w.microbatch_window(lambda step: arr[step % length])


# --- token_budget ----------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    counts=counts_st,
    budget=st.integers(1, 1500),
    cap=st.one_of(st.none(), st.integers(1, 8)),
    count_dtype=st.sampled_from([jnp.float32, jnp.int32]),
)
def test_token_budget_matches_model(counts, budget, cap, count_dtype):
    policy = w.token_budget(budget, max_microbatches=cap)
    assert policy.init() == ()

    def decide(mb, tokens, step, seen):
        return reached(tokens, budget) or (cap is not None and mb >= cap)

    assert run(policy, counts, count_dtype) == model_run(counts, decide)


def test_token_budget_closes_on_the_microbatch_that_reaches_it():
    policy = w.token_budget(100)
    # 40 + 0 + 60 = 100 exactly: closes; then 99 + 0 + 0 + 1; then 250 alone.
    counts = [40, 0, 60, 99, 0, 0, 1, 250, 0]
    assert run(policy, counts) == [0, 0, 1, 0, 0, 0, 1, 1, 0]
    # A count-0 microbatch never closes a window by tokens, even an empty one.
    assert run(policy, [0, 0, 0]) == [False] * 3


budget_values = st.one_of(
    st.integers(-5, 600),
    st.floats(-10.0, 600.0),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.5, 1e30]),
)


@settings(max_examples=25, deadline=None)
@given(
    counts=counts_st,
    table=st.lists(budget_values, min_size=1, max_size=4),
    cap=st.one_of(st.none(), st.integers(1, 6)),
)
def test_token_budget_of_gradient_step_matches_model(counts, table, cap):
    table, arr, length = _table(table)

    def decide(mb, tokens, step, seen):
        b = model_budget(np.float32(table[step % len(table)]))
        return reached(tokens, b) or (cap is not None and mb >= cap)

    # No cap: a cap larger than the sequence.
    cap_arg = np.int32(cap if cap is not None else MAX_LEN + 1)
    closes, state = run_traced(_budget_table, counts, arr, length, cap_arg)
    assert state == ()
    assert closes == model_run(counts, decide)


def _budget_table(arr, length, cap):
    return w.token_budget(
        lambda step: arr[step % length],
        by="gradient_step",
        max_microbatches=lambda step: cap,
    )


@settings(max_examples=25, deadline=None)
@given(
    counts=counts_st,
    start=st.integers(1, 400),
    slope=st.sampled_from([0.0, 0.25, 0.5, 1.0, -0.5]),
)
def test_token_budget_ramp_by_tokens_seen_matches_model(counts, start, slope):
    # A linear ramp in tokens seen (a decreasing one goes negative: total).
    def decide(mb, tokens, step, seen):
        return reached(tokens, model_budget(np.float32(start + slope * seen)))

    args = np.float32(start), np.float32(slope)
    closes, state = run_traced(_ramp, counts, *args)
    expected = model_run(counts, decide)
    assert closes == expected
    # The state holds the tokens of the completed windows.
    seen = sum(n for n, c in zip(counts, np.cumsum(expected[::-1])[::-1] > 0) if c)
    assert isinstance(state, mm.TokenTotal)
    assert float(state) == seen


def _ramp(start, slope):
    return w.token_budget(lambda seen: start + slope * seen)


def test_tokens_seen_is_exact_far_beyond_float32():
    # After 2**25 tokens seen, windows of 1 token: a float32 running sum stays
    # at 2**25 (2**25 + 1 rounds back down); the state counts them exactly, and
    # the budget function sees that exact total rounded to float32.
    def budget(seen):
        return 1000.0 if seen >= 2**25 + 4 else 1.0

    counts = [2**25] + [1] * 6 + [990, 10]
    policy = w.token_budget(lambda seen: jnp.where(seen >= 2**25 + 4, 1000.0, 1.0))
    closes, state = jax.jit(lambda c: drive(policy, c))(jnp.asarray(counts))
    exact = model_run(counts, lambda mb, t, s, seen: t >= budget(np.float32(seen)))
    assert [bool(c) for c in closes] == exact
    assert exact[-1] and float(state) == sum(counts)  # every window closed
    # A float32 running sum of the windows would never move the budget.
    naive, plain = np.float32(0), []
    for n in counts:
        plain.append(n >= budget(naive))
        naive = np.float32(naive + np.float32(n)) if plain[-1] else naive
    assert plain != exact


def test_token_budget_with_a_large_integer_total_compares_exactly():
    # Near 2**31 an int32 total is compared with ceil(budget), not in float32.
    close = jax.jit(
        lambda t, b: w._tokens_reached(t, b),
    )
    assert not bool(close(jnp.int32(2**24 + 2), jnp.float32(2**24 + 4)))
    assert bool(close(jnp.int32(2**24 + 4), jnp.float32(2**24 + 4)))
    assert not bool(w._tokens_reached(jnp.int32(2**24 + 1), 2**24 + 2))
    assert bool(w._tokens_reached(jnp.int32(INT32_MAX), 2**40))
    assert bool(close(jnp.int32(INT32_MAX), jnp.float32(F32_MAX)))


@pytest.mark.parametrize(
    "big", [2**31, 3_000_000_000, 2**70, np.int64(2**40), np.array(2**40)]
)
def test_integers_beyond_int32_are_sizes_and_budgets_by_value(big):
    # A Python (or numpy) int of 2**31 or more is a valid window size or token
    # budget: clipped or converted like the float of the same value, not an
    # OverflowError from its conversion to int32.
    assert int(w._sanitize_k(big)) == INT32_MAX == int(w._sanitize_k(float(big)))
    assert float(w._sanitize_budget(big)) == model_budget(big)
    assert int(w._sanitize_k(2**24 + 1)) == 2**24 + 1  # ints stay exact
    with pytest.raises(ValueError, match="returned -1099511627776"):
        w._sanitize_k(-(2**40))
    assert int(w._sanitize_k(np.int64(-(2**40)) + jnp.int32(0))) == 1  # traced: total
    p, g = jnp.zeros(2), jnp.ones(2)
    reached = big <= 3_000_000_000  # by two microbatches of 1.5e9 tokens
    # Equal gradients pass the norm test as soon as it may decide (two
    # microbatches and `min_tokens`).
    for kwargs, closes in [
        ({"tokens_per_window": int(big)}, reached),
        ({"tokens_per_window": lambda seen: big}, reached),
        (
            {
                "tokens_per_window": mm.token_budget(
                    lambda step: big, by="gradient_step"
                )
            },
            reached,
        ),
        ({"every_k_schedule": lambda step: big}, False),
        ({"every_k_schedule": 4, "norm_test": mm.norm_test(0.5, max_tokens=big)}, True),
        (
            {"every_k_schedule": 4, "norm_test": mm.norm_test(0.5, min_tokens=big)},
            reached,
        ),
    ]:
        tx = mm.MaskedMultiSteps(optax.sgd(1.0), **kwargs)
        update = jax.jit(tx.update)
        state = tx.init(p)
        _, state = update(g, state, p, count=jnp.float32(1.5e9))
        assert int(state.gradient_step) == 0, kwargs
        _, state = update(g, state, p, count=jnp.float32(1.5e9))
        assert int(state.gradient_step) == int(closes), kwargs


# --- norm test -------------------------------------------------------------------


def window_figures(grads, counts):
    """float64 two-pass: (N, K, ‖ḡ‖², tr Σ̂) of a window."""
    counts = np.asarray(counts, np.float64)
    live = counts > 0
    n = counts.sum()
    k = int(live.sum())
    if n == 0:
        return 0.0, 0, math.nan, math.nan
    g = np.asarray(grads, np.float64)[live]
    c = counts[live]
    mean = (c[:, None] * g).sum(0) / n
    s = float((c * ((g - mean) ** 2).sum(-1)).sum())
    var = s / (k - 1) if k >= 2 else math.nan
    return float(n), k, float(mean @ mean), var


@settings(max_examples=30, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.one_of(st.just(0), st.integers(1, 64)),
            st.lists(st.floats(-3.0, 3.0), min_size=3, max_size=3),
        ),
        min_size=1,
        max_size=24,
    ),
    offset=st.floats(-2.0, 2.0),
    theta=st.sampled_from([0.1, 0.3, 0.5, 1.0]),
    min_mb=st.integers(1, 4),
    max_mb=st.one_of(st.none(), st.integers(4, 10)),
    max_tokens=st.one_of(st.none(), st.integers(64, 600)),
    min_tokens=st.sampled_from([0, 32]),
)
# Figures below float32's range: ‖ḡ‖² ≈ 3e-77 and tr Σ̂ ≈ 7e-77 reach the policy
# as 0 and 0, and 0 <= θ²·N·0 passes.
@example(
    data=[(1, [0.0, 0.0, 0.0]), (1, [0.0, 0.0, 1.175494351e-38])],
    offset=0.0,
    theta=0.1,
    min_mb=1,
    max_mb=None,
    max_tokens=None,
    min_tokens=0,
)
def test_norm_test_matches_model(
    data, offset, theta, min_mb, max_mb, max_tokens, min_tokens
):
    counts = [n for n, _ in data]
    grads = [np.asarray(g) + offset for _, g in data]  # a common mean direction
    policy = w.norm_test(
        theta,
        min_tokens=min_tokens,
        min_microbatches=min_mb,
        max_tokens=max_tokens,
        max_microbatches=max_mb,
    )
    closes_fn = jax.jit(policy.closes)
    start = 0
    for i in range(len(counts)):
        window = slice(start, i + 1)
        tokens, k, sq, var = window_figures(grads[window], counts[window])
        # The policy decides on float32 scalars: a figure below float32's range
        # (gradients of 1e-38) reaches it as 0.
        sq, var = float(np.float32(sq)), float(np.float32(var))
        mb = i + 1 - start
        lhs, rhs = var, theta**2 * tokens * sq
        # Decisions within float32 rounding of the boundary are not compared.
        assume(not (k >= 2 and abs(lhs - rhs) <= 1e-4 * max(abs(lhs), abs(rhs))))
        passes = k >= 2 and tokens > 0 and lhs <= rhs
        expected = (
            passes and k >= min_mb and (min_tokens == 0 or reached(tokens, min_tokens))
        ) or (
            (max_tokens is not None and reached(tokens, max_tokens))
            or (max_mb is not None and mb >= max_mb)
        )
        s = _norm_scalars(mb, tokens, k, sq, var)
        assert bool(closes_fn((), s)) == expected, (i, tokens, k, sq, var)
        if expected:
            start = i + 1


def test_norm_test_min_microbatches_counts_microbatches_with_tokens():
    # Four microbatches, two of them empty: K = 2, one degree of freedom, so a
    # minimum of 4 keeps the test from deciding; with K = 4 it decides.
    policy = w.norm_test(1.0, min_microbatches=4)

    def s(mb, k):
        return w.WindowScalars(
            jnp.int32(mb),
            jnp.float32(10.0),
            jnp.int32(0),
            counted=jnp.int32(k),
            grad_sq_norm=jnp.float32(1.0),
            grad_var_trace=jnp.float32(0.0),
        )

    assert not bool(policy.closes((), s(4, 2)))
    assert not bool(policy.closes((), s(6, 3)))
    assert bool(policy.closes((), s(4, 4)))


def test_norm_test_needs_two_counted_microbatches_and_never_passes_on_nan():
    policy = w.norm_test(1.0)

    def s(k, var, sq=1.0, tokens=10.0):
        return w.WindowScalars(
            jnp.int32(5),
            jnp.float32(tokens),
            jnp.int32(0),
            counted=jnp.int32(k),
            grad_sq_norm=jnp.float32(sq),
            grad_var_trace=jnp.float32(var),
        )

    assert not bool(policy.closes((), s(1, 0.0)))  # one counted microbatch
    assert bool(policy.closes((), s(2, 0.0)))
    assert not bool(policy.closes((), s(3, math.nan)))
    assert not bool(policy.closes((), s(3, 1.0, sq=math.nan)))
    assert not bool(policy.closes((), s(3, 1.0, tokens=0.0)))
    # No noise and no gradient (converged): nothing to wait for.
    assert bool(policy.closes((), s(3, 0.0, sq=0.0)))
    with pytest.raises(ValueError, match="window statistics"):
        policy.closes((), w.WindowScalars(jnp.int32(1), jnp.float32(1), jnp.int32(0)))


def test_norm_test_window_grows_as_the_gradient_shrinks_against_its_noise():
    # Per-token noise of variance σ² per coordinate: the test passes at about
    # N ≈ (1 − θ²)/θ² · d·σ²/|G|², so halving |G| about quadruples N.
    policy = w.norm_test(0.5, max_microbatches=10_000)
    closes_fn = jax.jit(policy.closes)
    rng = np.random.default_rng(0)
    d, sigma, n = 8, 1.0, 4

    def window_tokens(g_norm):
        g_true = np.full(d, g_norm / np.sqrt(d))
        grads, counts = [], []
        while True:
            counts.append(n)
            grads.append(g_true + rng.normal(0, sigma / np.sqrt(n), d))
            tokens, k, sq, var = window_figures(grads, counts)
            s = w.WindowScalars(
                jnp.int32(len(counts)),
                jnp.float32(tokens),
                jnp.int32(0),
                counted=jnp.int32(k),
                grad_sq_norm=jnp.float32(sq),
                grad_var_trace=jnp.float32(var),
            )
            if bool(closes_fn((), s)):
                return tokens

    sizes = {
        g: np.median([window_tokens(g) for _ in range(15)]) for g in (1, 0.5, 0.25)
    }
    predicted = {g: 3 * d * sigma**2 / g**2 for g in sizes}  # θ = 0.5
    assert sizes[1] < sizes[0.5] < sizes[0.25]
    for g in sizes:
        # Within a factor 2 of the prediction (optional stopping makes the test
        # close a little early).
        assert predicted[g] / 2 <= sizes[g] <= predicted[g] * 1.5, (sizes, predicted)


# --- composition, jit --------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(counts=counts_st, budget=st.integers(1, 800), k=st.integers(1, 6))
def test_any_of_closes_when_either_would(counts, budget, k):
    def decide(mb, tokens, step, seen):
        return mb >= k or reached(tokens, budget + seen)

    closes, state = run_traced(_either, counts, np.int32(k), np.float32(budget))
    assert closes == model_run(counts, decide)
    assert jax.tree.structure(state) == jax.tree.structure(
        ((), mm.TokenTotal(0.0, 0.0))
    )


def _either(k, budget):
    return w.any_of(
        w.microbatch_window(lambda step: k), w.token_budget(lambda s: budget + s)
    )


def test_policies_do_not_retrace_and_keep_their_state_shape():
    policy = w.any_of(
        w.microbatch_window(lambda s: 2 + s),
        w.token_budget(lambda seen: 100 + seen / 4),
        w.norm_test(0.5, max_tokens=10_000),
    )
    state = policy.init()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, mb, tokens, k, sq, var):
        s = w.WindowScalars(mb, tokens, jnp.int32(0), k, sq, var)
        closed = policy.closes(state, s)
        return closed, policy.update(state, s, closed)

    for i in range(6):
        closed, new = step(
            state,
            jnp.int32(i + 1),
            jnp.float32(60.0 * i),
            jnp.int32(i),
            jnp.float32(1.0),
            jnp.float32(2.0),
        )
        chex.assert_trees_all_equal_shapes_and_dtypes(new, state)
        state = new


def test_tokens_schedule_evaluates_the_schedule_at_step_times_tokens():
    seen = []
    sched = mm.tokens_schedule(lambda t: seen.append(t) or t / 1000, 256)
    assert float(jax.jit(sched)(jnp.int32(3))) == pytest.approx(0.768)
    assert float(sched(0)) == 0.0
    with pytest.raises(ValueError, match="tokens_per_step"):
        mm.tokens_schedule(lambda t: t, 0)
    with pytest.raises(TypeError, match="tokens_per_step"):
        mm.tokens_schedule(lambda t: t, True)
    # Rates float32 flushes to 0 or rounds to inf.
    for rate in (1e-50, 1e39):
        with pytest.raises(ValueError, match="`tokens_per_step` .*float32 holds"):
            mm.tokens_schedule(lambda t: t, rate)
    with pytest.raises(TypeError, match="schedule"):
        mm.tokens_schedule(3e-4, 256)
    # As token budgets: jnp.bfloat16(3001) is 3008 already (it was accepted).
    with pytest.raises(TypeError, match="`tokens_per_step`.*bfloat16"):
        mm.tokens_schedule(lambda t: t, jnp.bfloat16(3001))


# --- errors ------------------------------------------------------------------------


def _scalars():
    return w.WindowScalars(jnp.int32(1), jnp.float32(1.0), jnp.int32(0))


def test_budget_callable_returning_non_scalar_fails_at_trace_time():
    policy = w.token_budget(lambda step: jnp.ones(2), by="gradient_step")
    with pytest.raises(
        ValueError, match=r"`budget\(gradient_step\)` must return a scalar.*\(2,\)"
    ):
        jax.jit(policy.closes)((), _scalars())


@pytest.mark.parametrize("value", [True, 1 + 2j])
def test_budget_callable_returning_bool_or_complex_is_a_type_error(value):
    policy = w.token_budget(lambda step: jnp.asarray(value), by="gradient_step")
    with pytest.raises(TypeError, match=r"`budget\(gradient_step\)`"):
        policy.closes((), _scalars())


@pytest.mark.parametrize(
    "budget, error",
    [
        (0, ValueError),
        (-1, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (True, TypeError),
        ("100", TypeError),
        (np.bool_(True), TypeError),
    ],
)
def test_bad_constant_budget(budget, error):
    # The error names the argument as the caller wrote it.
    with pytest.raises(error, match="`budget`"):
        w.token_budget(budget)
    with pytest.raises(error, match="`tokens_per_window`"):
        mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=budget)


def test_bad_budget_input_name():
    with pytest.raises(ValueError, match="`by`.*'tokens'"):
        w.token_budget(lambda s: 10, by="tokens")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"theta": 0.0}, ValueError, "theta"),
        ({"theta": -0.5}, ValueError, "theta"),
        ({"theta": math.nan}, ValueError, "theta"),
        ({"theta": "0.5"}, TypeError, "theta"),
        ({"theta": 0.5, "min_microbatches": 0}, ValueError, "min_microbatches"),
        ({"theta": 0.5, "min_microbatches": 2.0}, TypeError, "min_microbatches"),
        ({"theta": 0.5, "min_tokens": -1}, ValueError, "min_tokens"),
        ({"theta": 0.5, "max_tokens": 0}, ValueError, "max_tokens"),
        (
            {"theta": 0.5, "min_tokens": 100, "max_tokens": 50},
            ValueError,
            "max_tokens.*min_tokens",
        ),
        (
            {"theta": 0.5, "min_microbatches": 4, "max_microbatches": 2},
            ValueError,
            "max_microbatches.*min_microbatches",
        ),
        ({"theta": 0.5, "max_microbatches": 0}, ValueError, "max_microbatches"),
        ({"theta": 0.5, "max_microbatches": 2.5}, TypeError, "max_microbatches"),
        # Beyond the state's int32 microbatch count: refused here, not an
        # OverflowError at the first update.
        (
            {"theta": 0.5, "min_microbatches": 2**31, "max_tokens": 100},
            ValueError,
            r"`min_microbatches` must be in \[1, 2\*\*31 - 1\], got 2147483648",
        ),
    ],
)
def test_bad_norm_test_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        w.norm_test(**kwargs)


def test_any_of_refuses_what_is_not_a_policy():
    with pytest.raises(ValueError, match="at least one"):
        w.any_of()
    with pytest.raises(TypeError, match="WindowPolicy"):
        w.any_of(w.token_budget(10), 3)


# --- budgets returned by a callable, and what a policy is shown --------------


@pytest.mark.parametrize(
    "tokens_per_window",
    [
        20_000_001,
        lambda seen: 20_000_001,
        lambda seen: np.int64(20_000_001),
        mm.token_budget(lambda step: 20_000_001, by="gradient_step"),
    ],
)
def test_a_returned_budget_is_compared_as_exactly_as_a_constant(tokens_per_window):
    # With int32 counts the total is exact: a budget of 20,000,001 tokens is not
    # reached by 20,000,000 (float32 would round the budget to 20,000,000).
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), tokens_per_window=tokens_per_window, count_dtype=jnp.int32
    )
    p, g = jnp.zeros(2), jnp.ones(2)
    update = jax.jit(tx.update)
    _, state = update(g, tx.init(p), p, count=jnp.int32(20_000_000))
    assert not bool(state.updated)
    _, state = update(g, state, p, count=jnp.int32(1))
    assert bool(state.updated)


@pytest.mark.parametrize(
    "tokens_per_window",
    [
        2.0000001,
        lambda seen: 2.0000001,
        lambda seen: np.float64(2.0000001),
        lambda seen: np.array(2.0000001),  # a 0-d array went through float32
        mm.token_budget(lambda step: 2.0000001, by="gradient_step"),
    ],
)
@pytest.mark.parametrize("count_dtype", [jnp.int32, jnp.float32])
def test_a_returned_float_budget_is_compared_as_exactly_as_a_constant(
    tokens_per_window, count_dtype
):
    # A returned Python float went through float32 (2.0): a window of 2 tokens,
    # below the budget, where the constant closes at 3. With float32 totals
    # the budget is rounded up to them (to the nearest, it was 2.0 as well).
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), tokens_per_window=tokens_per_window, count_dtype=count_dtype
    )
    p, g = jnp.zeros(2), jnp.ones(2)
    update = jax.jit(tx.update)
    state = tx.init(p)
    closed = []
    for _ in range(3):
        _, state = update(g, state, p, count=jnp.asarray(1, count_dtype))
        closed.append(bool(state.updated))
    assert closed == [False, False, True]


def test_a_float64_budget_keeps_its_precision_under_x64():
    with jax.enable_x64(True):
        for count_dtype in (jnp.int64, jnp.float64):
            budget = 2**24 + 1
            closes = [
                w._tokens_reached(jnp.asarray(n, count_dtype), w._sanitize_budget(b))
                for n in (2**24, 2**24 + 1)
                for b in (budget, np.float64(budget), jnp.float64(budget))
            ]
            assert [bool(c) for c in closes] == [False] * 3 + [True] * 3
        # An integer array budget against float totals: rounded up too (it was
        # rounded to the nearest, 2**53 + 1 to 2**53: a window closed early).
        budget = jnp.int64(2**53 + 1)
        assert not bool(w._tokens_reached(jnp.float64(2**53), budget))
        assert bool(w._tokens_reached(jnp.float64(2**53 + 2), budget))
        # A float64 array budget against float32 totals: rounded up too.
        budget = jnp.float64(2.0000001)
        assert not bool(w._tokens_reached(jnp.float32(2.0), budget))
        assert bool(w._tokens_reached(jnp.nextafter(jnp.float32(2), 3), budget))


def test_returned_budgets_beyond_the_totals_range_close_at_its_largest_value():
    # An int32 total closes at 2**31 - 1 rather than overflow, whatever the
    # budget's dtype; below that, ceil(budget) exactly.
    top = jnp.int32(INT32_MAX)
    for budget in (jnp.float32(2**31), jnp.float32(F32_MAX), jnp.float32(jnp.inf)):
        assert bool(w._tokens_reached(top, w._sanitize_budget(budget)))
        assert not bool(w._tokens_reached(top - 1, w._sanitize_budget(budget)))
    assert not bool(w._tokens_reached(jnp.int32(5), jnp.float32(5.5)))
    assert bool(w._tokens_reached(jnp.int32(6), jnp.float32(5.5)))
    assert not bool(w._tokens_reached(jnp.float32(1e30), jnp.float32(jnp.inf)))
    # An int32 budget against float32 totals rounds up (2**24 + 1 to 2**24 + 2),
    # and one that rounds past int32's range is reached there, not wrapped.
    assert not bool(w._tokens_reached(jnp.float32(2**24), jnp.int32(2**24 + 1)))
    assert bool(w._tokens_reached(jnp.float32(2**24 + 2), jnp.int32(2**24 + 1)))
    assert bool(w._tokens_reached(jnp.float32(2**31), top))
    assert not bool(w._tokens_reached(jnp.float32(2**31 - 128), top))
    for bad in (jnp.float32(jnp.nan), jnp.float32(-3.0), jnp.int32(-3)):
        assert float(w._sanitize_budget(bad)) == 0.0
    # A Python or numpy number is known when returned, under jit too: NaN or
    # a negative one is refused (it counted as 0, silently); 0 is a budget
    # (a warmup may start there).
    for bad in (float("nan"), -3.0, np.float32(-1), -3, np.int64(-2)):
        with pytest.raises(ValueError, match=r"`tokens_per_window\(\.\.\.\)` "):
            w._sanitize_budget(bad)
    assert w._sanitize_budget(0) == 0 and w._sanitize_budget(np.float32(0)) == 0
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=lambda seen: np.nan)
    with pytest.raises(
        ValueError,
        match=r"`tokens_per_window\(tokens_seen\)` returned nan: a token budget "
        r"must be a number >= 0",
    ):
        jax.jit(tx.update)(jnp.ones(2), tx.init(jnp.zeros(2)), jnp.zeros(2), count=1.0)
    # A returned Python or numpy inf, against an int32 total: no token limit
    # (was an OverflowError from ceil(inf) while tracing).
    for budget in (float("inf"), np.float64(np.inf), np.float32(np.inf)):
        assert bool(w._tokens_reached(top, w._sanitize_budget(budget)))
        assert not bool(w._tokens_reached(top - 1, w._sanitize_budget(budget)))
    # A wider integer budget (x64) is clipped before the cast: 2**32 cast to
    # int32 is 0, which every total reaches.
    with jax.enable_x64(True):
        for budget in (jnp.int64(2**32), jnp.int64(2**40), jnp.uint32(2**32 - 1)):
            budget = w._sanitize_budget(budget)
            assert bool(w._tokens_reached(top, budget))
            assert not bool(w._tokens_reached(top - 1, budget))
            assert not bool(w._tokens_reached(jnp.int32(5), budget))
    # A Python number past float32's range: its largest finite value.
    for budget in (10**39, 1e39):
        assert bool(w._tokens_reached(jnp.float32(F32_MAX), budget))
        assert not bool(w._tokens_reached(jnp.float32(1e38), budget))
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), 3, tokens_per_window=lambda seen: np.inf, count_dtype=jnp.int32
    )
    p, state, step = jnp.zeros(2), tx.init(jnp.zeros(2)), jax.jit(tx.update)
    for _ in range(3):
        _, state = step(jnp.ones(2), state, p, count=jnp.int32(5))
    assert int(state.gradient_step) == 1  # the cap closed it


@pytest.mark.parametrize(
    "kwargs, count_dtype",
    [
        ({"tokens_per_window": 3_000_000_000}, jnp.int32),
        ({"tokens_per_window": 1e39}, jnp.float32),
        ({"norm_test": mm.norm_test(0.5, max_tokens=2**31)}, jnp.int32),
    ],
)
def test_a_fixed_budget_the_total_cannot_reach_is_refused(kwargs, count_dtype):
    # The window's total stops below it (a microbatch that would pass the
    # largest total is skipped), so the window never closed and every later
    # microbatch was dropped as an invalid count.
    with pytest.raises(ValueError, match=r"token budget .* beyond the largest window"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 4, count_dtype=count_dtype, **kwargs)


@pytest.mark.parametrize("returned", ["a", None])
def test_a_schedule_returning_what_is_not_a_number_is_named(returned):
    p = jnp.zeros(2)
    cap = mm.token_budget(4, max_microbatches=lambda s: returned)
    for kwargs, name in [
        ({"every_k_schedule": lambda step: returned}, "`every_k_schedule(step)`"),
        (
            {"tokens_per_window": lambda seen: returned},
            "`tokens_per_window(tokens_seen)`",
        ),
        ({"tokens_per_window": cap}, "`max_microbatches(step)`"),
    ]:
        tx = mm.MaskedMultiSteps(optax.sgd(1.0), **kwargs)
        match = re.escape(name) + " must return an integer or float"
        with pytest.raises(TypeError, match=match):
            tx.update(jnp.ones(2), tx.init(p), p, count=1)


def test_a_cap_returning_a_bool_names_the_cap():
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        tokens_per_window=mm.token_budget(4, max_microbatches=lambda s: True),
    )
    p = jnp.zeros(2)
    with pytest.raises(TypeError, match=r"`max_microbatches\(step\)` must return"):
        tx.update(jnp.ones(2), tx.init(p), p, count=1)


def test_jax_and_numpy_integer_scalars_are_accepted_where_ints_are():
    policy = w.norm_test(
        0.5, min_microbatches=jnp.int32(2), max_microbatches=np.int64(4)
    )
    assert policy.minimum == (2, 0)
    other = w.norm_test(0.5, min_microbatches=5, min_tokens=10, max_tokens=100)
    assert w.any_of(policy, other).minimum == (2, 0)
    tokens_only = w.norm_test(0.5, min_tokens=3, max_tokens=9)
    assert w.any_of(other, tokens_only).minimum == (2, 3)  # the test needs K >= 2
    lr = mm.tokens_schedule(lambda t: t, tokens_per_step=jnp.float32(4))
    assert float(lr(3)) == 12.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"every_k_schedule": 2, "norm_test": mm.norm_test(0.5, min_microbatches=4)},
            r"`every_k_schedule` \(2\) is below the norm test's "
            r"`min_microbatches` \(4\)",
        ),
        (
            {"tokens_per_window": 100, "norm_test": mm.norm_test(0.5, min_tokens=1000)},
            r"`tokens_per_window` \(100\) is below the norm test's "
            r"`min_tokens` \(1000\)",
        ),
        (  # A fixed budget is a fixed budget, however it is written.
            {
                "tokens_per_window": mm.token_budget(100),
                "norm_test": mm.norm_test(0.5, min_tokens=1000),
            },
            r"`tokens_per_window` \(100\) is below the norm test's "
            r"`min_tokens` \(1000\)",
        ),
        (
            {
                "tokens_per_window": mm.token_budget(10**6, max_microbatches=2),
                "norm_test": mm.norm_test(0.5, min_microbatches=4),
            },
            r"`tokens_per_window`'s `max_microbatches` \(2\) is below the norm "
            r"test's `min_microbatches` \(4\)",
        ),
        # The test decides on 2 microbatches with tokens at the fewest: these
        # windows all closed at their maximum, the test never consulted.
        (
            {"every_k_schedule": 1, "norm_test": 0.5},
            r"`every_k_schedule` \(1\) is below 2, the fewest microbatches",
        ),
        (
            {
                "tokens_per_window": mm.token_budget(10**6, max_microbatches=1),
                "norm_test": 0.5,
            },
            r"`tokens_per_window`'s `max_microbatches` \(1\) is below 2, the fewest",
        ),
        (
            {
                "every_k_schedule": 8,
                "norm_test": mm.norm_test(0.5, min_tokens=2**32),
                "count_dtype": jnp.int32,
            },
            r"`min_tokens` \(4294967296\) is beyond the largest window total "
            r"count_dtype int32 holds",
        ),
    ],
)
def test_a_window_that_closes_before_the_norm_test_is_consulted_is_refused(
    kwargs, match
):
    with pytest.raises(ValueError, match=match):
        mm.MaskedMultiSteps(optax.sgd(1.0), **kwargs)
    # At the minimum the test is consulted (and agrees with the cap): allowed.
    mm.MaskedMultiSteps(
        optax.sgd(1.0),
        every_k_schedule=4,
        norm_test=mm.norm_test(0.5, min_microbatches=4),
    )


def test_a_norm_test_capped_below_two_microbatches_is_refused():
    with pytest.raises(
        ValueError, match=r"`max_microbatches` \(1\) is below 2, the fewest"
    ):
        mm.norm_test(0.5, max_microbatches=1)
    mm.norm_test(0.5, max_microbatches=2)


def test_a_skipped_microbatch_leaves_a_custom_policys_state_as_it_was():
    # The policy counts the microbatches it is shown; a skipped microbatch (NaN
    # gradient) or an invalid count under jit must not reach its state.
    def closes(ps, s):
        return s.microbatches >= 3

    def update(ps, s, closed):
        return (s.microbatches, jnp.where(closed, 0, ps[1] + 1))

    policy = mm.WindowPolicy(lambda: (jnp.int32(0), jnp.int32(0)), closes, update)
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        tokens_per_window=policy,
        should_skip_update_fn=optax.skip_not_finite,
    )
    p = jnp.zeros(2)
    update_fn = jax.jit(tx.update)
    _, state = update_fn(jnp.ones(2), tx.init(p), p, count=jnp.float32(2))
    assert [int(x) for x in state.policy_state] == [1, 1]
    for grads, count in [(jnp.full(2, jnp.nan), 5.0), (jnp.ones(2), -1.0)]:
        _, after = update_fn(grads, state, p, count=jnp.float32(count))
        chex.assert_trees_all_equal(after.policy_state, state.policy_state)
        assert int(after.mini_step) == 1
    _, state = update_fn(jnp.ones(2), state, p, count=jnp.float32(2))
    assert [int(x) for x in state.policy_state] == [2, 2]


@pytest.mark.parametrize(
    "verdict, error, got",
    [
        (
            lambda s: s.microbatches >= jnp.array([3]),
            ValueError,
            "dtype bool and shape \\(1,\\)",
        ),
        (lambda s: s.tokens, TypeError, "dtype float32 and shape \\(\\)"),
        (lambda s: jnp.int32(1), TypeError, "dtype int32 and shape \\(\\)"),
        (lambda s: None, TypeError, "NoneType None$"),
    ],
    ids=["shape", "dtype", "int", "None"],
)
@pytest.mark.parametrize("alone", [True, False], ids=["alone", "with k"])
def test_a_custom_policy_whose_closes_is_not_a_boolean_scalar_is_named(
    verdict, error, got, alone
):
    # Also beside `every_k_schedule`, where the policies' verdicts are or-ed
    # (an int32 1 was taken as True there, and the window closed).
    policy = mm.WindowPolicy(
        lambda: (), lambda ps, s: verdict(s), lambda *a: (), name="P"
    )
    k = {} if alone else {"every_k_schedule": 5}
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=policy, **k)
    p = jnp.zeros(2)
    with pytest.raises(
        error,
        match=f"policy P's `closes` must return a boolean scalar, got {got}",
    ):
        tx.update(jnp.ones(2), tx.init(p), p, count=jnp.float32(2))


@pytest.mark.parametrize(
    "update, error, match",
    [
        (
            lambda ps, s, c: ps + 0.5,
            TypeError,
            "leaf of shape \\(\\) and dtype float32 where",
        ),
        (
            lambda ps, s, c: jnp.zeros(3, jnp.int32),
            ValueError,
            "leaf of shape \\(3,\\) and",
        ),
        (lambda ps, s, c: (ps, ps), ValueError, "of the structure its `init` built"),
    ],
    ids=["dtype", "shape", "structure"],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_custom_policys_update_must_keep_the_state_init_built(
    update, error, match, jit
):
    # The state is carried through jit and checkpoints: a float where `init`
    # built an int32 changed the state's layout (a jitted step compiled
    # again), a vector was broadcast into it.
    policy = mm.WindowPolicy(
        lambda: jnp.int32(0), lambda ps, s: s.microbatches >= 2, update, name="P"
    )
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=policy)
    p = jnp.zeros(2)
    step = lambda s: tx.update(jnp.ones(2), s, p, count=jnp.int32(3))  # noqa: E731
    with pytest.raises(
        error, match="policy P's `update` must return a state " + ".*" + match
    ):
        (jax.jit(step) if jit else step)(tx.init(p))


@pytest.mark.parametrize("start", ["start", {"n": None, "s": "x"}, np.array(["a"])])
def test_a_custom_policys_init_must_build_arrays(start):
    # A string was jax's error about "function <lambda> at _multisteps.py"
    # traced for jit, naming neither the policy nor `init`.
    policy = mm.WindowPolicy(
        lambda: start, lambda ps, s: s.microbatches >= 2, lambda ps, s, c: ps, name="P"
    )
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=policy)
    with pytest.raises(TypeError, match=r"policy P's `init` must return a pytree of"):
        tx.init(jnp.zeros(2))
    # Numbers and arrays are a state (ml_dtypes' numpy ones too).
    bf16 = np.zeros((), jnp.bfloat16)
    for start in (0, 1.5, True, np.int32(2), {"a": jnp.zeros(2)}, (), bf16):
        policy = mm.WindowPolicy(
            lambda s=start: s, lambda ps, s: s.microbatches >= 2, lambda ps, s, c: ps
        )
        tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=policy)
        tx.update(jnp.ones(2), tx.init(jnp.zeros(2)), jnp.zeros(2), count=1)


def test_a_custom_policys_weakly_typed_init_takes_the_width_update_gives_it():
    # `init=lambda: 0` is int64 under x64, and `update` returns the int32 its
    # arithmetic with an int32 gives: taken (as jax promotes it), not another
    # kind.
    with jax.enable_x64(True):
        for init in (lambda: 0, lambda: jnp.asarray(0)):
            policy = mm.WindowPolicy(
                init,
                lambda ps, s: s.microbatches >= 2,
                lambda ps, s, c: ps + c.astype(jnp.int32),
            )
            tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=policy)
            p = jnp.zeros(2)
            state = tx.init(p)
            for _ in range(4):
                _, state = jax.jit(tx.update)(jnp.ones(2), state, p, count=2)
            assert int(state.policy_state) == 2
        floats = mm.WindowPolicy(
            lambda: 0, lambda ps, s: s.microbatches >= 2, lambda ps, s, c: ps + 0.5
        )
        tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=floats)
        with pytest.raises(TypeError, match="dtype float64 where `init` built"):
            tx.update(jnp.ones(2), tx.init(p), p, count=2)


@pytest.mark.parametrize("field", ["init", "closes", "update"])
@pytest.mark.parametrize("keyword", ["tokens_per_window", "norm_test"])
def test_a_custom_policy_whose_functions_are_not_callable_is_refused(field, keyword):
    functions = {
        "init": lambda: (),
        "closes": lambda ps, s: s.microbatches >= 2,
        "update": lambda ps, s, c: ps,
    }
    functions[field] = ()
    policy = mm.WindowPolicy(**functions, needs_stats=keyword == "norm_test")
    window = {"every_k_schedule": 4} if keyword == "norm_test" else {}
    with pytest.raises(
        TypeError,
        match=f"`{keyword}` got a WindowPolicy whose `{field}` is not callable: "
        r"\(\) of type tuple",
    ):
        mm.MaskedMultiSteps(optax.sgd(1.0), **window, **{keyword: policy})


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        # Each was Python's own error from the constructor's checks or repr:
        # "tuple index out of range", "cannot unpack non-iterable NoneType",
        # "'NoneType' object has no attribute 'startswith'".
        ({"maximum": (1,)}, TypeError, r"`maximum` is not a pair \(microbatches"),
        ({"minimum": None}, TypeError, r"`minimum` is not a pair .*: None"),
        ({"maximum": (1, "x")}, TypeError, r"`maximum` has 'x' tokens of type str"),
        ({"minimum": (1.5, 0)}, TypeError, r"`minimum` has 1.5 microbatches of type"),
        ({"name": None}, TypeError, r"`name` is not a str: None"),
        ({"name": 3}, TypeError, r"`name` is not a str: 3"),
        ({"bounded": "yes"}, TypeError, r"`bounded` is not a bool: 'yes' of type"),
        ({"needs_stats": None}, TypeError, r"`needs_stats` is not a bool: None"),
        # Accepted without a word.
        ({"maximum": (0, 0)}, ValueError, r"`maximum` has 0 microbatches: it must "),
        ({"maximum": (None, -1.0)}, ValueError, r"`maximum` has -1.0 tokens"),
        ({"maximum": (None, math.nan)}, ValueError, r"`maximum` has nan tokens"),
        ({"minimum": (-1, 0)}, ValueError, r"`minimum` has -1 microbatches: .*>= 0"),
    ],
)
@pytest.mark.parametrize("keyword", ["tokens_per_window", "norm_test"])
def test_a_custom_policys_descriptive_fields_are_checked(fields, error, match, keyword):
    policy = mm.WindowPolicy(
        init=lambda: (),
        closes=lambda ps, s: s.microbatches >= 2,
        update=lambda ps, s, c: ps,
        needs_stats=keyword == "norm_test",
    )._replace(**fields)
    with pytest.raises(error, match=f"^`{keyword}` got a WindowPolicy whose {match}"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 4, **{keyword: policy})
    # repr reads `name` before any check runs.
    assert isinstance(repr(policy), str)


@pytest.mark.parametrize(
    "policy",
    [
        mm.token_budget(0.5),  # below one token: soft masks count fractions
        mm.token_budget(0.5, max_microbatches=4),
        mm.norm_test(0.5, max_tokens=0.75),
        mm.WindowPolicy(
            init=lambda: (),
            closes=lambda ps, s: s.microbatches >= 2,
            update=lambda ps, s, c: ps,
            maximum=(jnp.int32(4), jnp.float32(100.0)),  # 0-d arrays, a list
            minimum=[np.int64(1), np.float32(0.0)],
        ),
    ],
    ids=repr,
)
def test_policies_whose_fields_hold_fractions_or_arrays_are_accepted(policy):
    keyword = "norm_test" if policy.needs_stats else "tokens_per_window"
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 4, **{keyword: policy})
    params = jnp.zeros(())
    _, state = tx.apply_gradients(jnp.float32(1.0), tx.init(params), params, count=0.3)
    assert int(state.gradient_step) == 0
    _, state = tx.apply_gradients(jnp.float32(1.0), state, params, count=0.3)
    assert int(state.gradient_step) == 1


def test_a_policy_field_too_large_for_a_float_is_named():
    # math.isfinite(10**400) is Python's "int too large to convert to float".
    policy = mm.WindowPolicy(
        init=lambda: (),
        closes=lambda ps, s: s.microbatches >= 2,
        update=lambda ps, s, c: ps,
        maximum=(None, 10**400),
    )
    with pytest.raises(ValueError, match=r"token budget 1000.* is beyond the largest"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 4, tokens_per_window=policy)


@pytest.mark.parametrize(
    ("field", "function", "match"),
    [
        ("init", lambda x: (), "`init` must be a callable of no arguments"),
        ("closes", lambda ps: True, "`closes` must be a callable of two arguments"),
        ("update", lambda ps, s: ps, "`update` must be a callable of three arg"),
    ],
)
def test_a_custom_policy_whose_functions_take_other_arguments_is_refused(
    field, function, match
):
    # Python's "<lambda>() takes 2 positional arguments but 3 were given",
    # from deep inside the first step, named neither the policy nor the field.
    functions = {
        "init": lambda: (),
        "closes": lambda ps, s: s.microbatches >= 2,
        "update": lambda ps, s, c: ps,
    }
    functions[field] = function
    with pytest.raises(TypeError, match=f"`tokens_per_window`'s WindowPolicy {match}"):
        mm.MaskedMultiSteps(
            optax.sgd(1.0), tokens_per_window=mm.WindowPolicy(**functions)
        )


@pytest.mark.parametrize(
    ("closes", "match"),
    [
        # Python's "'<' not supported between instances of 'NoneType' and
        # 'float'": a statistic read without needs_stats=True.
        (
            lambda ps, s: s.grad_var_trace < 1.0,
            r"mine's `closes` failed on a `None`: .* unless the policy is built "
            r"with `needs_stats=True`",
        ),
        # jax's TracerBoolConversionError alone.
        (
            lambda ps, s: True if s.tokens > 3 else False,
            r"mine's `closes` failed on a traced value: .* Write it with jax.numpy",
        ),
        # jax's "None is not a valid value for jnp.array" (a ValueError).
        (
            lambda ps, s: jnp.asarray(s.grad_sq_norm) < 1.0,
            r"mine's `closes` failed on a `None`",
        ),
    ],
    ids=["statistic-without-needs_stats", "python-if", "jnp-of-a-statistic"],
)
def test_a_custom_policy_failing_in_its_step_is_named_with_the_cause(closes, match):
    policy = mm.WindowPolicy(lambda: (), closes, lambda ps, s, c: ps, name="mine")
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=policy)
    p = jnp.zeros(2)
    with pytest.raises(TypeError, match=match):
        jax.jit(lambda s: tx.update(jnp.ones(2), s, p, count=2))(tx.init(p))


@pytest.mark.parametrize(
    ("update", "error", "match"),
    [
        (
            lambda ps, s, closed: ps + (1 if closed else 0),
            TypeError,
            r"mine's `update` failed on a traced value: .* Write it with jax.numpy",
        ),
        (
            lambda ps, s, closed: ps + s.grad_sq_norm,
            TypeError,
            r"mine's `update` failed on a `None`: .* `needs_stats=True`",
        ),
        (
            lambda ps, s, closed: (ps, ps),
            ValueError,
            r"mine's `update` must return a state of the structure its `init` "
            r"built, PyTreeDef\(\*\); got PyTreeDef\(\(\*, \*\)\)",
        ),
    ],
    ids=["python-if", "statistic-without-needs_stats", "another-structure"],
)
@pytest.mark.parametrize("beside", [{}, {"every_k_schedule": 8}], ids=["alone", "cap"])
def test_a_custom_policys_failing_update_is_named_beside_other_rules(
    update, error, match, beside
):
    # Beside `every_k_schedule` (the usual cap) the same mistakes gave jax's
    # bare TracerBoolConversionError, Python's "unsupported operand type(s)
    # ... 'NoneType'", or named the combination "WindowPolicy(...)" with the
    # structure of all the rules' states.
    policy = mm.WindowPolicy(
        lambda: jnp.int32(0), lambda ps, s: s.microbatches >= 2, update, name="mine"
    )
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=policy, **beside)
    p = jnp.zeros(2)
    with pytest.raises(error, match=match):
        jax.jit(lambda s: tx.update(jnp.ones(2), s, p, count=2))(tx.init(p))


@pytest.mark.parametrize("keyword", ["tokens_per_window", "norm_test"])
def test_a_custom_unbounded_policy_alone_is_refused_by_its_name(keyword):
    # It was refused as "The norm test needs a maximum window ... pass
    # `tokens_per_window`", to a user who had no norm test and had passed one.
    policy = mm.WindowPolicy(
        lambda: (),
        lambda ps, s: s.tokens >= 4096,
        lambda ps, s, c: ps,
        needs_stats=keyword == "norm_test",
        bounded=False,
        name="my_rule",
    )
    number = "" if keyword == "tokens_per_window" else " or a number of tokens as "
    with pytest.raises(
        ValueError,
        match=r"^No rule sets a maximum window \(my_rule: a policy of your own "
        r"declared `bounded=False` sets none\), .* pass `every_k_schedule` \(a "
        rf"maximum number of microbatches\){number}",
    ):
        mm.MaskedMultiSteps(optax.sgd(1.0), **{keyword: policy})
    mm.MaskedMultiSteps(optax.sgd(1.0), 16, **{keyword: policy})  # a cap beside it
    with pytest.raises(ValueError, match=r"^The norm test needs a maximum window"):
        mm.MaskedMultiSteps(optax.sgd(1.0), norm_test=0.5)
    if keyword == "tokens_per_window":
        # Beside the norm test without a maximum: not told to pass the
        # `tokens_per_window` it passed.
        with pytest.raises(
            ValueError,
            match=r"^No rule sets a maximum window \(my_rule, mm.norm_test\(0.5\): ",
        ):
            mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=policy, norm_test=0.5)
        mm.MaskedMultiSteps(optax.sgd(1.0), norm_test=0.5, tokens_per_window=4096)


def test_a_custom_policys_own_errors_pass_through_as_they_are():
    # Not relabelled as a statistic read without needs_stats: the policy's own
    # ValueError keeps its type and message, "None" in it or not.
    def closes(ps, s):
        raise ValueError("the threshold is None for this run")

    policy = mm.WindowPolicy(lambda: (), closes, lambda ps, s, c: ps, name="mine")
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=policy)
    p = jnp.zeros(2)
    with pytest.raises(ValueError, match=r"^the threshold is None for this run"):
        jax.jit(lambda s: tx.update(jnp.ones(2), s, p, count=2))(tx.init(p))


def test_a_custom_test_below_a_fixed_window_is_named_by_its_own_name():
    # It was called "the norm test's `min_microbatches`".
    test = mm.WindowPolicy(
        lambda: (),
        lambda ps, s: s.grad_var_trace < 1.0,
        lambda ps, s, c: ps,
        needs_stats=True,
        minimum=(4, 0),
        name="my_test",
    )
    with pytest.raises(
        ValueError, match=r"\(3\) is below my_test's `minimum` \(4 microbatches\)"
    ):
        mm.MaskedMultiSteps(optax.sgd(1.0), 3, norm_test=test)
    with pytest.raises(
        ValueError, match=r"\(8\) is below my_test's `minimum` \(16 tokens\)"
    ):
        mm.MaskedMultiSteps(
            optax.sgd(1.0),
            tokens_per_window=8,
            norm_test=test._replace(minimum=(1, 16)),
        )


def test_norm_test_waits_for_min_tokens_before_it_is_consulted():
    # The test is not consulted on a window below its minimum budget.
    # tr Σ̂ = 1 <= 0.5² · N · ‖ḡ‖² = 0.25 · 16 · 1 = 4: the test passes.
    policy = mm.norm_test(0.5, min_tokens=32, max_microbatches=64)
    assert not bool(policy.closes((), _norm_scalars(3, 16, 3, 1.0, 1.0)))  # 16 < 32
    assert not bool(policy.closes((), _norm_scalars(3, 31, 3, 1.0, 1.0)))
    assert bool(policy.closes((), _norm_scalars(3, 32, 3, 1.0, 1.0)))  # reached
    # The same through the wrapper: microbatches of 8 tokens that agree closely
    # pass the test from K = 2 on, but the window holds until 32 tokens.
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), norm_test=mm.norm_test(0.5, min_tokens=32, max_microbatches=64)
    )
    params = jnp.zeros(2)
    state = tx.init(params)
    closed_at = []
    for i in range(8):
        g = jnp.array([1.0, 1.0 + 0.01 * (i % 2)])
        _, state = tx.update(g, state, params, count=8)
        if int(state.mini_step) == 0:
            closed_at.append(i + 1)
    assert closed_at == [4, 8], closed_at


def test_the_smallest_fixed_token_budget_is_the_one_checked_for_reach():
    # The smallest of the policies' fixed token budgets is checked for
    # reach: the norm test's unreachable max_tokens is no reason to refuse
    # when tokens_per_window closes every window.
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        tokens_per_window=100,
        norm_test=mm.norm_test(0.5, max_tokens=2**31),
        count_dtype=jnp.int32,
    )
    params = jnp.zeros(2)
    state = tx.init(params)
    _, state = tx.update(jnp.ones(2), state, params, count=jnp.int32(100))
    assert int(state.gradient_step) == 1


def test_a_token_budget_of_exactly_the_largest_total_is_accepted():
    # A window total can reach its dtype's largest value, so a budget of it
    # is reachable.
    mm.MaskedMultiSteps(
        optax.sgd(1.0), 4, tokens_per_window=2**31 - 1, count_dtype=jnp.int32
    )
    mm.MaskedMultiSteps(
        optax.sgd(1.0),
        4,
        norm_test=mm.norm_test(0.5, max_tokens=2**31 - 1),
        count_dtype=jnp.int32,
    )


# A skipped microbatch (NaN gradient under skip_not_finite, or an invalid
# count under jit) does not close the window, even where the policy, asked
# now, would close it.
def _closes_once_a_microbatch_counted():
    # Closes on any microbatch once one counted microbatch was seen (its state
    # counts the microbatches kept), so the verdict on a skipped microbatch
    # after the first one is True.
    return mm.WindowPolicy(
        lambda: jnp.int32(0),
        lambda ps, s: ps >= 1,
        lambda ps, s, closed: jnp.where(closed, 0, ps + 1),
    )


def test_a_skipped_microbatch_does_not_close_the_window():
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        tokens_per_window=_closes_once_a_microbatch_counted(),
        should_skip_update_fn=optax.skip_not_finite,
    )
    p = jnp.zeros(2)
    step = jax.jit(tx.update)
    _, state = step(jnp.full(2, 1.0), tx.init(p), p, count=jnp.float32(1))
    assert int(state.gradient_step) == 0
    for grads, count in [(jnp.full(2, jnp.nan), 3.0), (jnp.full(2, 9.0), -1.0)]:
        updates, after = step(grads, state, p, count=jnp.float32(count))
        assert int(after.gradient_step) == 0
        assert not bool(mm.has_updated(after))
        assert int(after.mini_step) == 1
        assert float(jnp.abs(updates).max()) == 0.0
    # The next counted microbatch closes it, with the mean of the two kept.
    updates, state = step(jnp.full(2, 4.0), state, p, count=jnp.float32(3))
    assert int(state.gradient_step) == 1
    assert jnp.allclose(updates, -(1.0 * 1 + 4.0 * 3) / 4)


def test_tokens_schedule_keeps_a_fractional_tokens_per_step():
    # A measured mean tokens per window is rarely a whole number: 2.5 tokens
    # per step puts step 4 at 10 tokens, not at 8.
    sched = mm.tokens_schedule(lambda t: t, 2.5)
    assert float(sched(4)) == 10.0
    assert float(jax.jit(sched)(jnp.int32(3))) == 7.5
    assert float(mm.tokens_schedule(lambda t: t, 0.75)(8)) == 6.0


def test_tokens_schedule_reads_a_host_integer_step_by_value():
    # A numpy int64 of 2**32 + 5 was wrapped into 5, and a Python int of 2**31
    # was jax's bare OverflowError.
    sched = mm.tokens_schedule(lambda t: t, 1.0)
    assert float(sched(np.int64(2**32 + 5))) == np.float32(2**32 + 5)
    assert float(sched(2**31)) == 2.0**31
    assert float(sched(np.uint64(3))) == 3.0


@pytest.mark.parametrize("step", [None, "3", True, 1 + 2j, "key"])
def test_tokens_schedule_names_a_step_that_is_no_real_number(step):
    # A key was jax's NotImplementedError ("Cannot call abstract method
    # astype"), None a ValueError of jnp.array's.
    step = jax.random.key(0) if step == "key" else step
    lr = mm.tokens_schedule(optax.linear_schedule(1.0, 0.0, 100), 10)
    with pytest.raises(TypeError, match=r"the schedule's `step` must be a real number"):
        lr(step)


def test_tokens_schedule_accepts_the_ends_of_float32s_range():
    # The smallest normal float32 and the largest are rates float32 holds;
    # only what lies beyond them is refused.
    f32 = np.finfo(np.float32)
    assert float(mm.tokens_schedule(lambda t: t, float(f32.tiny))(1)) == f32.tiny
    assert float(mm.tokens_schedule(lambda t: t, float(f32.max))(1)) == f32.max
    with pytest.raises(ValueError, match="`tokens_per_step` .*float32 holds"):
        mm.tokens_schedule(lambda t: t, float(f32.tiny) / 2)


def test_tokens_schedule_returns_an_array_for_a_schedule_returning_a_number():
    # An optax.Schedule returns an array, whatever the wrapped function returns.
    lr = mm.tokens_schedule(lambda t: 0.1, 256)(3)
    assert isinstance(lr, jax.Array) and lr.shape == ()
    np.testing.assert_allclose(lr, 0.1)


def test_the_int32_maximum_is_a_valid_number_of_microbatches():
    # The state counts microbatches in int32: 2**31 - 1 is the largest number
    # it holds, taken wherever microbatches are counted (2**31 is refused).
    w.norm_test(0.5, min_microbatches=INT32_MAX, max_tokens=100)
    w.norm_test(0.5, max_microbatches=INT32_MAX)
    mm.microbatched_value_and_grad(lambda p, mb: (jnp.sum(p * mb), 1.0), INT32_MAX)
