"""``close_window=True``: a window closed on its last microbatch of data.

The data (an epoch, a run) rarely ends on a window's boundary. The flag closes
the window on the microbatch that carries it, whatever the window's rules say,
and the update is the inner optimizer's on the token mean of what the window
holds; a flush with no tokens on an empty window changes nothing.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import masked_multistep as mm

# Two microbatches of a window that would hold more: (gradient, tokens).
PENDING = [(np.array([1.0, 2.0]), 2), (np.array([4.0, -1.0]), 6)]
MEAN = (2 * PENDING[0][0] + 6 * PENDING[1][0]) / 8
PARAMS = {"w": jnp.zeros(2)}
ZEROS = {"w": jnp.zeros(2)}

RULES = {
    "k": {"every_k_schedule": 4},
    "k schedule": {"every_k_schedule": lambda step: 4 + step},
    "budget": {"tokens_per_window": 150},
    "budget of seen": {"tokens_per_window": lambda seen: jnp.where(seen < 9, 50, 99)},
    "norm test": {"norm_test": mm.norm_test(1e-3, max_microbatches=8)},
}


def _tx(rule, **kwargs):
    return mm.MaskedMultiSteps(optax.sgd(1.0), **RULES[rule], **kwargs)


def _step(tx, method, jit):
    def step(grads, state, params, count, last):
        if method == "update":
            updates, state = tx.update(
                grads, state, params, count=count, close_window=last
            )
            return optax.apply_updates(params, updates), state
        return tx.apply_gradients(grads, state, params, count=count, close_window=last)

    return jax.jit(step) if jit else step


def _flag(value, jit):
    return jnp.asarray(value) if jit else value


# Both methods under a fixed k and the norm test; `apply_gradients` alone under
# the other rules (the two methods read the flag in the same step and differ
# only in where the update goes).
RULE_METHODS = [
    (rule, method)
    for rule in RULES
    for method in (
        ("update", "apply_gradients")
        if rule in ("k", "norm test")
        else ("apply_gradients",)
    )
]


@pytest.mark.parametrize(("rule", "method"), RULE_METHODS)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("window_stats", [False, True], ids=["", "stats"])
def test_the_last_microbatch_closes_its_window_on_what_it_holds(
    rule, method, jit, window_stats
):
    tx = _tx(rule, window_stats=window_stats)
    step = _step(tx, method, jit)
    params, state = PARAMS, tx.init(PARAMS)
    for i, (g, n) in enumerate(PENDING):
        params, state = step(
            {"w": jnp.asarray(g)}, state, params, jnp.asarray(n), _flag(i == 1, jit)
        )
    np.testing.assert_allclose(params["w"], -MEAN, rtol=1e-6)
    assert (int(state.gradient_step), int(state.mini_step)) == (1, 0)
    assert int(state.acc_count) == 0 and bool(state.updated)
    if window_stats:
        stats = mm.window_stats(state)
        assert (float(stats.tokens), int(stats.microbatches)) == (8.0, 2)
        assert (int(stats.windows), float(stats.tokens_seen)) == (1, 8.0)
        np.testing.assert_allclose(stats.grad_sq_norm, np.sum(MEAN**2), rtol=1e-6)
    if rule == "budget of seen":
        assert float(state.policy_state) == 8.0  # the tokens seen advanced

    # The next window starts empty and closes by its rule: on its k-th
    # microbatch (k = 4, or 5 at gradient step 1), on the microbatch of 99
    # tokens that reaches 150 or 50 tokens, or where the norm test first sees
    # two (equal) gradients.
    before, closed_on = params["w"], None
    for microbatch in range(1, 9):
        params, state = step(
            {"w": jnp.ones(2)}, state, params, jnp.asarray(99), _flag(False, jit)
        )
        if bool(state.updated):
            closed_on = microbatch
            break
    np.testing.assert_allclose(params["w"], before - 1.0, rtol=1e-6)
    assert int(state.gradient_step) == 2
    closing = {"k": 4, "k schedule": 5, "budget": 2, "budget of seen": 1}
    assert closed_on == closing.get(rule, 2)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_empty_flush_closes_a_window_the_data_ended_in(rule, jit):
    """When the end of the data is known only after its last microbatch: a
    count-0 microbatch (zeros, or the NaN of an all-padding one) with
    close_window=True."""
    tx = _tx(rule)
    step = _step(tx, "apply_gradients", jit)
    params, state = PARAMS, tx.init(PARAMS)
    for g, n in PENDING:
        params, state = step(
            {"w": jnp.asarray(g)}, state, params, jnp.asarray(n), _flag(False, jit)
        )
    assert int(state.gradient_step) == 0
    nan = {"w": jnp.full(2, jnp.nan)}
    params, state = step(nan, state, params, jnp.asarray(0), _flag(True, jit))
    np.testing.assert_allclose(params["w"], -MEAN, rtol=1e-6)
    assert (int(state.gradient_step), int(state.mini_step)) == (1, 0)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_flush_in_another_dtype_never_applies_a_corrupted_mean(jit):
    """The window's mean goes to the inner optimizer in the dtype of the
    gradients that close it. float16 zeros after float32 gradients: the mean
    7e4 became inf and was applied as a finite window's update; such a window
    is now not finite (counted, the params untouched). Real zeros for complex
    params dropped the mean's imaginary part: refused, named."""
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 4)
    step = jax.jit(tx.apply_gradients) if jit else tx.apply_gradients
    params = {"w": jnp.array([1.0, 2.0])}
    state = tx.init(params)
    params, state = step({"w": jnp.array([1.0, 7e4])}, state, params, count=3)
    flushed, state = step(
        {"w": jnp.zeros(2, jnp.float16)}, state, params, count=0, close_window=True
    )
    chex.assert_trees_all_equal(flushed, params)
    assert not bool(state.updated) and int(state.num_nonfinite_windows) == 1
    # The next window, in float16 throughout, is applied (its mean fits).
    for _ in range(4):
        flushed, state = step(
            {"w": jnp.array([0.5, 6e4], jnp.float16)}, state, flushed, count=2
        )
    np.testing.assert_allclose(flushed["w"], [0.5, 2.0 - 6e4], rtol=1e-3)
    assert int(state.gradient_step) == 1

    z = {"w": jnp.array([1 + 1j, 2 - 1j], jnp.complex64)}
    state = tx.init(z)
    z, state = step(
        {"w": jnp.array([1 + 2j, 3 + 4j], jnp.complex64)}, state, z, count=2
    )
    with pytest.raises(
        TypeError,
        match=r"gradient at \['w'\] is real \(float32\), but the state's "
        r"accumulator is complex64 .*imaginary part",
    ):
        step({"w": jnp.zeros(2)}, state, z, count=0, close_window=True)


def _assert_same_state_but_updated(after, before):
    chex.assert_trees_all_equal(
        after._replace(updated=before.updated), before, strict=True
    )
    assert not bool(after.updated)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_flush_on_a_windows_boundary_changes_nothing(rule, jit):
    """The data ended just as a window closed: the flush completes no window
    (the last window's statistics stay readable), applies nothing and leaves
    the state as it was (but ``updated``, which says what this call did)."""
    tx = _tx(rule, window_stats=True)
    step = _step(tx, "update", jit)
    params, state = PARAMS, tx.init(PARAMS)
    for i, (g, n) in enumerate(PENDING):
        params, state = step(
            {"w": jnp.asarray(g)}, state, params, jnp.asarray(n), _flag(i == 1, jit)
        )
    assert bool(state.updated)
    flushed_params, flushed = step(
        ZEROS, state, params, jnp.asarray(0), _flag(True, jit)
    )
    chex.assert_trees_all_equal(flushed_params, params)
    _assert_same_state_but_updated(flushed, state)
    assert float(mm.window_stats(flushed).tokens) == 8.0


def test_a_window_of_empty_microbatches_that_the_flag_closes_is_dropped():
    """Count-0 microbatches count toward k; closed by the flag alone, a window
    holding only them starts over (k microbatches from the next one), and
    completes no window. Closed by its rule, it completes an empty window, as
    without the flag."""
    tx = _tx("k", window_stats=True)
    params, state = PARAMS, tx.init(PARAMS)
    for i, (g, n) in enumerate(PENDING):
        params, state = tx.apply_gradients(
            {"w": jnp.asarray(g)}, state, params, count=n, close_window=i == 1
        )
    closed = state
    for last in (False, True):
        params, state = tx.apply_gradients(
            ZEROS, state, params, count=0, close_window=last
        )
    assert int(state.mini_step) == 0
    _assert_same_state_but_updated(state, closed)

    for _ in range(4):  # k count-0 microbatches, the last with the flag
        params, state = tx.apply_gradients(
            ZEROS, state, params, count=0, close_window=True
        )
        assert int(mm.window_stats(state).windows) == 1
    for _ in range(4):  # ... closed by the rule: an empty window completes
        params, state = tx.apply_gradients(ZEROS, state, params, count=0)
    stats = mm.window_stats(state)
    assert (int(stats.windows), float(stats.tokens)) == (2, 0.0)
    assert np.isnan(stats.grad_sq_norm) and int(state.gradient_step) == 1


@pytest.mark.parametrize("bad", ["nan count", "skipped"])
def test_a_microbatch_that_does_not_count_still_closes_the_window(bad):
    """An invalid count (under jit) or a microbatch the skip function rejects
    is left out, and the window closes on what it holds."""
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), 4, should_skip_update_fn=optax.skip_not_finite
    )
    step = jax.jit(_step(tx, "apply_gradients", jit=False))
    params, state = PARAMS, tx.init(PARAMS)
    for g, n in PENDING:
        params, state = step(
            {"w": jnp.asarray(g)}, state, params, jnp.float32(n), jnp.asarray(False)
        )
    grads, count = {"w": jnp.ones(2)}, jnp.float32(jnp.nan)
    if bad == "skipped":
        grads, count = {"w": jnp.full(2, jnp.inf)}, jnp.float32(5)
    params, state = step(grads, state, params, count, jnp.asarray(True))
    np.testing.assert_allclose(params["w"], -MEAN, rtol=1e-6)
    assert (int(state.gradient_step), int(state.mini_step)) == (1, 0)
    assert int(state.num_invalid_counts) == (bad == "nan count")


def test_one_compiled_program_for_both_values_and_none_without_the_flag():
    tx = _tx("k")
    state = tx.init(PARAMS)
    traces = []

    @jax.jit
    def step(grads, state, params, last):
        traces.append(1)
        return tx.apply_gradients(grads, state, params, count=3.0, close_window=last)

    for last in (False, True, False):
        _, state = step(ZEROS, state, PARAMS, jnp.asarray(last))
    assert len(traces) == 1

    def text(**kwargs):
        """The compiled program, without source locations."""
        f = jax.jit(lambda g, s, p: tx.update(g, s, p, count=jnp.float32(3), **kwargs))
        hlo = f.lower(ZEROS, state, PARAMS).compile().as_text()
        hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
        # From the first computation on (the header lists source locations).
        return hlo[re.search(r"^(%|ENTRY)", hlo, re.MULTILINE).start() :]

    assert text(close_window=False) == text() == text(close_window=None)
    assert text(close_window=True) != text()


def test_train_state_and_optax_chain_forward_it():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 4)
    state = mm.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    for i, (g, n) in enumerate(PENDING):
        state = state.apply_gradients(
            grads={"w": jnp.asarray(g)}, count=n, close_window=i == 1
        )
    np.testing.assert_allclose(state.params["w"], -MEAN, rtol=1e-6)
    assert (int(state.step), int(state.gradient_step)) == (2, 1)

    chained = optax.chain(mm.MaskedMultiSteps(optax.sgd(1.0), 4), optax.scale(2.0))
    opt_state = chained.init(PARAMS)
    for i, (g, n) in enumerate(PENDING):
        updates, opt_state = chained.update(
            {"w": jnp.asarray(g)}, opt_state, PARAMS, count=n, close_window=i == 1
        )
    np.testing.assert_allclose(updates["w"], -2 * MEAN, rtol=1e-6)


def test_nnx_optimizer_forwards_it_under_nnx_jit():
    model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, mm.MaskedMultiSteps(optax.sgd(1.0), 4), wrt=nnx.Param
    )
    start = np.asarray(model.kernel[...])

    @nnx.jit
    def step(model, optimizer, g, n, last):
        grads = nnx.State({"kernel": nnx.Param(jnp.broadcast_to(g[:, None], (2, 1)))})
        optimizer.update(model, grads, count=n, close_window=last)

    for i, (g, n) in enumerate(PENDING):
        step(model, optimizer, jnp.asarray(g), jnp.asarray(n), jnp.asarray(i == 1))
    np.testing.assert_allclose(
        np.asarray(model.kernel[...])[:, 0], start[:, 0] - MEAN, rtol=1e-6
    )
    assert int(optimizer.opt_state.gradient_step[...]) == 1


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (1, TypeError, "`close_window` must be a bool .* got 1 of type int"),
        ("yes", TypeError, "`close_window` must be a bool .* got 'yes'"),
        (jnp.array(1), TypeError, "`close_window` must be a bool .* dtype int32"),
        (jnp.array([True, False]), ValueError, "boolean scalar.* shape \\(2,\\)"),
    ],
)
def test_a_flag_that_is_not_a_boolean_scalar_is_refused(bad, error, match):
    tx = _tx("k")
    with pytest.raises(error, match=match):
        tx.update(ZEROS, tx.init(PARAMS), PARAMS, count=1, close_window=bad)


def test_a_misspelt_flag_is_named():
    tx = _tx("k")
    with pytest.raises(TypeError, match="did you mean 'close_window'"):
        tx.update(ZEROS, tx.init(PARAMS), PARAMS, count=1, close_windows=True)
    state = mm.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    with pytest.raises(TypeError, match="Did you mean 'close_window'"):
        state.apply_gradients(grads=ZEROS, count=1, close_windows=True)
    with pytest.raises(TypeError, match="Pass close_window to apply_gradients"):
        state.apply_gradients(grads=ZEROS, count=1, extra_args={"close_window": True})


def _counting_policy():
    """A window rule whose state counts the closes it is told of."""
    return mm.WindowPolicy(
        init=lambda: jnp.int32(0),
        closes=lambda state, scalars: scalars.microbatches >= 4,
        update=lambda state, scalars, closed: state + closed.astype(jnp.int32),
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_window_rule_is_told_of_the_closes_the_flag_makes(jit):
    """A custom rule sees the flag's closes, a skipped microbatch's included,
    but not the windows it drops (an empty flush)."""
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        tokens_per_window=_counting_policy(),
        should_skip_update_fn=optax.skip_not_finite,
    )
    step = _step(tx, "apply_gradients", jit)
    params, state = PARAMS, tx.init(PARAMS)
    params, state = step(ZEROS, state, params, jnp.asarray(3), _flag(True, jit))
    assert (int(state.policy_state), int(state.gradient_step)) == (1, 1)
    for _ in range(3):  # flushes of an empty window: dropped
        params, state = step(ZEROS, state, params, jnp.asarray(0), _flag(True, jit))
    assert (int(state.policy_state), int(state.gradient_step)) == (1, 1)
    # A microbatch the skip function rejects, closing a window with tokens.
    params, state = step(ZEROS, state, params, jnp.asarray(3), _flag(False, jit))
    inf = {"w": jnp.full(2, jnp.inf)}
    params, state = step(inf, state, params, jnp.asarray(3), _flag(True, jit))
    assert (int(state.policy_state), int(state.gradient_step)) == (2, 2)
    assert bool(state.skip_state["should_skip"])


def test_train_state_checks_the_flag_for_a_plain_optimizer_too():
    with pytest.warns(UserWarning, match="`tx` holds no mm.MaskedMultiSteps"):
        state = mm.TrainState.create(apply_fn=None, params=PARAMS, tx=optax.sgd(1.0))
    with pytest.raises(TypeError, match="`close_window` must be a bool"):
        state.apply_gradients(grads=ZEROS, count=1, close_window="yes")
    state = state.apply_gradients(grads=ZEROS, count=1, close_window=True)
    assert int(state.step) == 1


@pytest.mark.parametrize(
    "guess",
    ["flush", "is_last", "sync_gradients", "close", "last_batch", "flush_window"]
    + ["end_of_batch", "force_update", "is_final_microbatch", "do_update"]
    + ["apply_update", "finalize", "commit", "done", "is_accumulating"]
    + ["isLast", "CloseWindow", "lastBatch", "endOfData", "syncGradients"],
)
def test_a_guessed_name_for_the_flag_points_to_it(guess):
    """Other keywords go to the inner optimizer, which would drop these: the
    window would stay open without a word."""
    tx = _tx("k")
    with pytest.raises(TypeError, match="pass `close_window=True`"):
        tx.update(ZEROS, tx.init(PARAMS), PARAMS, count=1, **{guess: True})
    state = mm.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    with pytest.raises(TypeError, match="Did you mean 'close_window'"):
        state.apply_gradients(grads=ZEROS, count=1, **{guess: True})
