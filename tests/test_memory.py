"""Compiled memory of an optimizer-dominated train step, against plain adam.

The figures come from ``jit(step).lower(...).compile().memory_analysis()`` and
are deterministic for a given jax/XLA version. The step is the one that
accumulation makes expensive: a few square float32 matrices, a tiny batch, the
parameters and optimizer state donated. (That temporary memory falls with the
number of in-jit microbatches is tested in ``test_microbatch.py``.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import masked_multistep as mm

WIDTH, LAYERS, ROWS, K = 256, 4, 8, 4
# Figures of compiled programs, as a user compiles them (tests/conftest.py).
pytestmark = pytest.mark.default_emitters

PARAMS = {
    f"w{i}": jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32) for i in range(LAYERS)
}
BATCH = {
    "x": jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32),
    "y": jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32),
    "mask": jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.bool_),
}


def _bytes(tree):
    return sum(
        int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
    )


PARAM_BYTES = _bytes(PARAMS)


def _loss(params, batch):
    h = batch["x"]
    for i in range(LAYERS):
        h = jnp.tanh(h @ params[f"w{i}"])
    return mm.masked_mean((h - batch["y"]) ** 2, batch["mask"])


def _grads(params, batch):
    (_, count), grads = jax.value_and_grad(_loss, has_aux=True)(params, batch)
    return grads, count


def _optax_loop(tx):
    def step(carry, batch):
        params, opt_state = carry
        grads, count = _grads(params, batch)
        extra = {"count": count} if isinstance(tx, mm.MaskedMultiSteps) else {}
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), opt_state

    return step, (PARAMS, jax.eval_shape(tx.init, PARAMS))


def _apply_gradients_loop(tx):
    def step(carry, batch):
        params, opt_state = carry
        grads, count = _grads(params, batch)
        return tx.apply_gradients(grads, opt_state, params, count=count)

    return step, (PARAMS, jax.eval_shape(tx.init, PARAMS))


def _train_state_loop(tx):
    def step(state, batch):
        grads, count = _grads(state.params, batch)
        return state.apply_gradients(grads=grads, count=count)

    state = jax.eval_shape(
        lambda p: mm.TrainState.create(apply_fn=None, params=p, tx=tx), PARAMS
    )
    return step, state


def _memory(step_and_carry):
    step, carry = step_and_carry
    compiled = jax.jit(step, donate_argnums=0).lower(carry, BATCH).compile()
    return compiled.memory_analysis()


def _adam():
    return optax.adam(1e-3)


@pytest.fixture(scope="module")
def adam_temp():
    return _memory(_optax_loop(_adam())).temp_size_in_bytes


def test_apply_gradients_step_needs_no_more_temp_than_plain_adam(adam_temp):
    tx = mm.MaskedMultiSteps(_adam(), K)
    temp = _memory(_apply_gradients_loop(tx)).temp_size_in_bytes
    assert temp <= adam_temp, (temp, adam_temp, PARAM_BYTES)


def test_train_state_step_needs_no_more_temp_than_plain_adam(adam_temp):
    pytest.importorskip("flax")
    tx = mm.MaskedMultiSteps(_adam(), K)
    temp = _memory(_train_state_loop(tx)).temp_size_in_bytes
    assert temp <= adam_temp, (temp, adam_temp, PARAM_BYTES)


def test_plain_update_loop_needs_no_more_temp_than_plain_adam(adam_temp):
    tx = mm.MaskedMultiSteps(_adam(), K)
    temp = _memory(_optax_loop(tx)).temp_size_in_bytes
    assert temp <= adam_temp, (temp, adam_temp, PARAM_BYTES)


def test_plain_update_loop_needs_less_temp_than_optax_multisteps(adam_temp):
    ours = _memory(_optax_loop(mm.MaskedMultiSteps(_adam(), K))).temp_size_in_bytes
    theirs = _memory(_optax_loop(optax.MultiSteps(_adam(), K))).temp_size_in_bytes
    # optax.MultiSteps runs the inner update in both branches of a `select`
    # and builds its zero updates and new accumulator as temporaries: about
    # three times a plain adam step's scratch memory here.
    assert theirs > 2 * adam_temp, (theirs, adam_temp, PARAM_BYTES)
    assert ours < theirs
    assert ours <= PARAM_BYTES + adam_temp


@pytest.mark.parametrize(
    ("accumulator_dtype", "count_dtype"),
    [(jnp.float32, jnp.int32), (jnp.bfloat16, jnp.float32)],
    ids=["f32-acc", "bf16-acc"],
)
def test_persistent_state_is_inner_state_plus_one_accumulator(
    accumulator_dtype, count_dtype
):
    tx = mm.MaskedMultiSteps(
        _adam(), K, accumulator_dtype=accumulator_dtype, count_dtype=count_dtype
    )
    state = jax.eval_shape(tx.init, PARAMS)
    inner = _bytes(jax.eval_shape(_adam().init, PARAMS))
    accumulator = sum(
        int(np.prod(p.shape)) * jnp.dtype(accumulator_dtype).itemsize
        for p in jax.tree.leaves(PARAMS)
    )
    scalars = 0
    for field in state._fields:
        if field in ("inner_opt_state", "acc_grads"):
            continue
        for leaf in jax.tree.leaves(getattr(state, field)):
            assert leaf.shape == (), (field, leaf.shape)
            scalars += jnp.dtype(leaf.dtype).itemsize
    # mini_step, gradient_step, num_invalid_counts, num_nonfinite_windows
    # (int32), acc_count, acc_value, value_count (4 bytes each), updated (bool);
    # no skip_state without a skip fn.
    assert scalars == 7 * 4 + 1
    assert _bytes(state) == inner + accumulator + scalars

    # The compiled step updates the params, the inner state and the
    # accumulator in place, in the donated buffers.
    memory = _memory(_apply_gradients_loop(tx))
    assert memory.alias_size_in_bytes >= PARAM_BYTES + inner + accumulator


# The statistics' own scalars (the current window, the last completed one and
# the moving averages) may add a few hundred bytes of scalar temporaries.
STATS_SCALAR_SLACK = 1024


@pytest.mark.parametrize(
    "loop",
    [_optax_loop, _apply_gradients_loop, _train_state_loop],
    ids=["update", "apply", "train_state"],
)
def test_window_statistics_need_no_extra_scratch_memory(loop):
    """Σ nᵢ‖gᵢ‖² is reduced from each gradient and ‖ḡ‖² from the window's mean
    before the inner optimizer reads it: no parameter-sized temporary, and
    `update` still hands the inner update back in the accumulator's buffer."""
    if loop is _train_state_loop:
        pytest.importorskip("flax")
    plain = _memory(loop(mm.MaskedMultiSteps(_adam(), K))).temp_size_in_bytes
    stats = _memory(
        loop(mm.MaskedMultiSteps(_adam(), K, window_stats=True))
    ).temp_size_in_bytes
    assert plain <= stats <= plain + STATS_SCALAR_SLACK, (stats, plain)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_window_statistics_of_low_precision_gradients_scratch_memory(dtype):
    """The squared norms of bfloat16 gradients are summed in float32 without a
    float32 copy of the gradients beside the accumulation's (twice the
    gradients' bytes). XLA:CPU converts float16 for a reduction only through a
    float32 buffer, so float16 gradients take that one copy at most."""
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), PARAMS)

    def temp(tx):
        def step(carry, grads, count):
            params, opt_state = carry
            updates, opt_state = tx.update(grads, opt_state, params, count=count)
            return optax.apply_updates(params, updates), opt_state

        carry = (params, jax.eval_shape(tx.init, params))
        count = jax.ShapeDtypeStruct((), jnp.int32)
        compiled = jax.jit(step, donate_argnums=0).lower(carry, params, count)
        return compiled.compile().memory_analysis().temp_size_in_bytes

    plain = temp(mm.MaskedMultiSteps(_adam(), K))
    stats = temp(mm.MaskedMultiSteps(_adam(), K, window_stats=True))
    copy = 0 if dtype == jnp.bfloat16 else PARAM_BYTES  # float32 PARAMS' bytes
    assert plain <= stats <= plain + copy + STATS_SCALAR_SLACK, (stats, plain)


def test_window_statistics_keep_only_scalars_in_the_state():
    """Fourteen scalars, packed into three arrays (one per dtype): each array
    of a jitted call costs the host time on every call."""
    tx = mm.MaskedMultiSteps(_adam(), K, window_stats=True)
    stats = jax.eval_shape(tx.init, PARAMS).stats
    assert [x.shape for x in jax.tree.leaves(stats)] == [(9,), (3,), (2,)]
    assert _bytes(stats) == 56, _bytes(stats)  # the README's figure


@pytest.mark.parametrize(
    "loop",
    [_optax_loop, _apply_gradients_loop, _train_state_loop],
    ids=["update", "apply", "train_state"],
)
def test_each_leafs_statistics_need_no_extra_scratch_memory_and_20_bytes_a_leaf(
    loop,
):
    """Each leaf's share of the statistics is read from the same per-leaf
    squared norms: scalar temporaries only, and five float32 entries per leaf
    in the state (the README's 20 bytes)."""
    if loop is _train_state_loop:
        pytest.importorskip("flax")
    stats = _memory(
        loop(mm.MaskedMultiSteps(_adam(), K, window_stats=True))
    ).temp_size_in_bytes
    tx = mm.MaskedMultiSteps(_adam(), K, per_leaf_stats=True)
    leaves = _memory(loop(tx)).temp_size_in_bytes
    assert stats <= leaves <= stats + STATS_SCALAR_SLACK, (leaves, stats)
    state = jax.eval_shape(tx.init, PARAMS).stats
    assert _bytes(state) == 56 + 20 * len(jax.tree.leaves(PARAMS))


@pytest.mark.parametrize(
    "loop",
    [_optax_loop, _apply_gradients_loop, _train_state_loop],
    ids=["update", "apply", "train_state"],
)
def test_window_rules_need_no_extra_scratch_memory(loop):
    """A token budget (warming up with the tokens seen) decides on scalars; the
    norm test adds one reduction of the running mean per microbatch: neither
    needs a parameter-sized temporary, against a fixed k with the same
    statistics."""
    if loop is _train_state_loop:
        pytest.importorskip("flax")

    def temp(**kwargs):
        tx = mm.MaskedMultiSteps(_adam(), K, window_stats=True, **kwargs)
        return _memory(loop(tx)).temp_size_in_bytes

    fixed = temp()
    budget = temp(tokens_per_window=lambda seen: 1000 + seen / 8)
    norm = temp(norm_test=mm.norm_test(0.5, min_microbatches=2))
    assert budget <= fixed + STATS_SCALAR_SLACK, (budget, fixed)
    assert norm <= fixed + STATS_SCALAR_SLACK, (norm, fixed)


def _floor_loop():
    """The gradient and a bare running mean: what any accumulation must do."""

    def step(carry, batch):
        params, acc, total = carry
        grads, count = _grads(params, batch)
        acc, total = mm.running_mean_update(acc, total, grads, count)
        return params, acc, total

    return step, (PARAMS, PARAMS, jax.ShapeDtypeStruct((), jnp.int32))


@pytest.mark.parametrize("form", ["cond", "loop"])
def test_between_window_ends_apply_gradients_moves_what_the_floor_moves(
    form, monkeypatch
):
    # Kernel by kernel, the bytes a compiled step reads and writes on a
    # microbatch that does not close its window (tests/_helpers.traffic): the
    # fused step adds scalars to the floor's traffic, no pass over the
    # parameters or the optimizer state, and no parameter-sized copy, in both
    # forms of the window's conditional (the loop is what GPUs get).
    from _helpers import traffic

    from masked_multistep import _branch

    if form == "loop":
        monkeypatch.setattr(_branch, "FORM", "loop")

    def between(step_and_carry):
        step, carry = step_and_carry
        text = jax.jit(step, donate_argnums=0).lower(carry, BATCH).compile().as_text()
        return traffic(text, taken=False)

    floor = between(_floor_loop())
    moved = between(_apply_gradients_loop(mm.MaskedMultiSteps(_adam(), K)))
    assert floor.bytes <= moved.bytes <= floor.bytes + 1024, (moved, floor)
    assert not [b for b in moved.copies if b >= PARAM_BYTES // LAYERS], moved
    # And a few kernels on scalars (the window's counters, the microbatch's
    # checks: 7 here); what changes only when a window closes is computed in
    # the branch that closes it (selected on every microbatch, 12).
    assert moved.kernels <= floor.kernels + 8, (moved.kernels, floor.kernels)


@pytest.mark.parametrize("form", ["cond", "loop"])
@pytest.mark.parametrize(
    "loop", [_optax_loop, _apply_gradients_loop], ids=["update", "apply"]
)
def test_between_window_ends_the_statistics_add_only_their_running_sums(
    form, loop, monkeypatch
):
    # A microbatch that does not close its window adds its squared norms and
    # count to the window's sums; the closed window's figures (estimates,
    # moving averages, the last window's record) are computed only in the
    # branch that closes it. Computed on every microbatch and selected, they
    # were 33 more kernels here (16 and 6 now: XLA:CPU copies the scalars
    # `lax.cond` passes through); passed beside the window's loop instead of
    # as its state, they were copied in and out of it.
    from _helpers import traffic

    from masked_multistep import _branch

    monkeypatch.setattr(_branch, "FORM", form)

    def between(tx):
        step, carry = loop(tx)
        text = jax.jit(step, donate_argnums=0).lower(carry, BATCH).compile().as_text()
        return traffic(text, taken=False)

    plain = between(mm.MaskedMultiSteps(_adam(), K))
    stats = between(mm.MaskedMultiSteps(_adam(), K, window_stats=True))
    bound = 8 if form == "loop" else 20
    assert stats.kernels - plain.kernels <= bound, (stats.kernels, plain.kernels)
    if form == "loop":
        assert len(stats.copies) - len(plain.copies) <= 2, (stats, plain)
