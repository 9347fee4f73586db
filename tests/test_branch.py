"""The window's conditional in both of its forms (``masked_multistep._branch``).

GPUs run the window's conditional as a ``while_loop`` that runs at most once
(XLA:GPU copies the buffers a ``lax.cond`` branch passes through); CPUs and
TPUs keep ``lax.cond``. These tests give the CPU the loop form too
(``_branch.FORM``) and check that it computes the same bits as the
conditional through whole training runs (statistics, skips, empty and NaN
microbatches, token budgets, the deferred reduction on 8 devices), that
derivatives and ``vmap`` work through it, and that its compiled program updates
the state in place (no parameter-sized copies).
"""

import gc
import re
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm
from masked_multistep import _branch

W = 64  # parameters per leaf: 64 x 64 float32, 16 KiB


@pytest.fixture(params=["cond", "loop"])
def form(request, monkeypatch):
    """Runs the test with the CPU program in the given form."""
    if request.param == "loop":
        monkeypatch.setattr(_branch, "FORM", "loop")
    return request.param


def _loop_on_cpu(monkeypatch):
    monkeypatch.setattr(_branch, "FORM", "loop")


def _jvp_with_traced_pred(f, pred, primals, tangents):
    """``jax.jvp`` of ``f(*primals, pred)`` with ``pred`` a tracer (under jit):
    the conditional's form runs, not the eager call's branch of its own."""
    return jax.jit(lambda p: jax.jvp(lambda *a: f(*a, p), primals, tangents))(pred)


def test_both_forms_compute_the_taken_branch(form):
    def step(state, g, scale):
        return (state[0] - scale * g, state[1] + 1), jnp.float32(1)

    def hold(state, g, scale):
        return jnp.float32(0)

    state = (jnp.ones(3), jnp.int32(5))

    @jax.jit
    def f(pred):
        return _branch.in_place_cond(pred, step, hold, state, jnp.ones(3), 2.0)

    (x, n), extra = f(jnp.bool_(True))
    np.testing.assert_array_equal(x, -np.ones(3))
    assert int(n) == 6 and float(extra) == 1.0
    (x, n), extra = f(jnp.bool_(False))
    np.testing.assert_array_equal(x, np.ones(3))
    assert int(n) == 5 and float(extra) == 0.0
    # A batched predicate: each example its own branch.
    (x, n), extra = jax.vmap(f)(jnp.array([True, False]))
    np.testing.assert_array_equal(x, [[-1.0] * 3, [1.0] * 3])
    np.testing.assert_array_equal(n, [6, 5])
    np.testing.assert_array_equal(extra, [1.0, 0.0])


def test_derivatives_go_through_in_both_forms_also_for_closed_over_values(form):
    # Reverse mode (a while loop has none of its own) and forward mode, with
    # respect to an operand and to a value the branch closes over.
    def f(x, lr, pred):
        def step(state, g):
            return lr * state * g, jnp.sum(state)

        def hold(state, g):
            return jnp.zeros([])

        y, extra = _branch.in_place_cond(pred, step, hold, x, x)
        return jnp.sum(y) + extra

    x = jnp.array([1.0, 2.0])
    for pred, dx, dlr in ((True, 2 * 3.0 * x + 1, 5.0), (False, np.ones(2), 0.0)):
        g = jax.jit(jax.grad(f, argnums=(0, 1)))(x, 3.0, jnp.bool_(pred))
        np.testing.assert_allclose(g[0], dx)
        np.testing.assert_allclose(g[1], dlr)
        _, t = _jvp_with_traced_pred(
            lambda lr, p: f(x, lr, p), jnp.bool_(pred), (3.0,), (1.0,)
        )
        np.testing.assert_allclose(t, dlr)


def _params():
    rng = np.random.default_rng(0)
    return {
        "a": jnp.asarray(rng.normal(size=(W, W)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(W, W)), jnp.float32) / 4,
    }


def _loss(params, mb):
    h = jnp.tanh(mb["x"] @ params["a"]) @ params["b"]
    return mm.masked_mean((h - mb["y"]) ** 2, mb["mask"])


def _microbatches(rows=4, n=10, seed=1):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        mb = {
            "x": rng.normal(size=(rows, W)).astype(np.float32),
            "y": rng.normal(size=(rows, W)).astype(np.float32),
            "mask": rng.random((rows, W)) < 0.7,
        }
        if i == 2:
            mb["mask"][:] = False  # an empty microbatch
        if i == 6:
            mb["x"][0, 0] = np.nan  # a NaN gradient
        out.append(mb)
    return out


def _tx(**kwargs):
    return mm.MaskedMultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), **kwargs
    )


CONFIGS = {
    "update": dict(every_k_schedule=3),
    "update, skip, stats": dict(
        every_k_schedule=3,
        should_skip_update_fn=optax.skip_not_finite,
        window_stats=True,
    ),
    "token budget": dict(tokens_per_window=300),
}


def _step(tx, apply_params):
    """One microbatch: `tx.apply_gradients`, or `tx.update` and `apply_updates`."""

    def step(params, state, mb):
        (loss, count), grads = jax.value_and_grad(_loss, has_aux=True)(params, mb)
        if apply_params:
            return tx.apply_gradients(grads, state, params, count=count, value=loss)
        updates, state = tx.update(grads, state, params, count=count, value=loss)
        return optax.apply_updates(params, updates), state

    return step


def _run(tx, apply_params):
    step = jax.jit(_step(tx, apply_params))
    params = _params()
    state = tx.init(params)
    for mb in _microbatches():
        params, state = step(params, state, mb)
    return params, state


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("apply_params", [False, True], ids=["update", "apply"])
def test_the_loop_form_trains_bit_for_bit_like_the_conditional(
    config, apply_params, monkeypatch
):
    want = _run(_tx(**CONFIGS[config]), apply_params)
    _loop_on_cpu(monkeypatch)
    got = _run(_tx(**CONFIGS[config]), apply_params)
    assert int(got[1].gradient_step) >= 2
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_the_loop_form_with_the_deferred_reduction_on_8_devices(monkeypatch):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    grad_fn = mm.per_device_value_and_grad(_loss, mesh, "data")

    def run():
        tx = _tx(every_k_schedule=3, reduction=mm.deferred(mesh, "data"))
        params = jax.device_put(_params(), NamedSharding(mesh, P()))
        state = tx.init(params)

        @jax.jit
        def step(params, state, mb):
            (loss, count), grads = grad_fn(params, mb)
            return tx.apply_gradients(grads, state, params, count=count, value=loss)

        for mb in _microbatches(rows=16):
            mb = jax.device_put(mb, NamedSharding(mesh, P("data")))
            params, state = step(params, state, mb)
        return params, state

    want = run()
    _loop_on_cpu(monkeypatch)
    got = run()
    assert int(got[1].gradient_step) == 2  # of 3 windows, one NaN
    jax.tree.map(np.testing.assert_array_equal, got, want)


_COPY = re.compile(r"=\s*f32\[(\d+),(\d+)\]\S*\s+copy\(")


@pytest.mark.parametrize("apply_params", [False, True], ids=["update", "apply"])
def test_the_loop_form_updates_the_state_in_place(apply_params, monkeypatch):
    # The loop's state is the accumulator, the inner state and the params: no
    # parameter-sized copy anywhere in the step (the window's mean is read from
    # the state, not passed in beside it as a second name for one buffer).
    _loop_on_cpu(monkeypatch)
    tx = _tx(every_k_schedule=3, window_stats=True)
    params = _params()
    compiled = (
        jax.jit(_step(tx, apply_params), donate_argnums=(0, 1))
        .lower(params, tx.init(params), _microbatches()[0])
        .compile()
    )
    text = compiled.as_text()
    assert " while(" in text and " conditional(" not in text.split("ENTRY")[1]
    assert not [m for m in _COPY.finditer(text) if m.groups() == (str(W), str(W))]


@pytest.mark.parametrize("platform", ["cpu", "tpu", "cuda", "rocm"])
def test_gpus_get_their_gradients_materialized_for_the_statistics(platform):
    # Lowered (not compiled) for each platform: on GPUs each gradient leaf goes
    # through an optimization barrier before the accumulation and the
    # statistics read it; elsewhere the gradients are read as they are.
    gpu = platform in ("cuda", "rocm")
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True)
    params = _params()

    def lowered(fn, *args):
        trace = jax.jit(fn).trace(*args)
        return trace.lower(lowering_platforms=(platform,)).as_text()

    text = lowered(_step(tx, True), params, tx.init(params), _microbatches()[0])
    assert ("optimization_barrier" in text) == gpu
    grad_fn = mm.microbatched_value_and_grad(_loss, 2, with_stats=True)
    text = lowered(grad_fn, params, _microbatches(rows=4, n=1)[0])
    assert ("optimization_barrier" in text) == gpu


def test_gpus_materialize_matrices_gradients_not_vectors():
    # A bias's gradient, a sum over the batch, fuses into its accumulation and
    # the statistics' one reduction as it is: a barrier would cost it a kernel
    # of its own on every microbatch. Only the matrix goes through one.
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True)
    params = {"w": _params()["a"], "bias": jnp.zeros(W), "scale": jnp.ones(())}

    def loss(p, mb):
        h = jnp.tanh(mb["x"] @ p["w"] + p["bias"][None]) * p["scale"]
        return mm.masked_mean(jnp.square(h - mb["y"]), mb["mask"])

    def step(params, state, mb):
        (_, count), grads = jax.value_and_grad(loss, has_aux=True)(params, mb)
        return tx.apply_gradients(grads, state, params, count=count)

    mb = _microbatches()[0]
    trace = jax.jit(step).trace(params, tx.init(params), mb)
    text = trace.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.optimization_barrier") == 1


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_the_form_follows_the_default_backend(backend, monkeypatch):
    # The loop where the default backend is a GPU, the conditional elsewhere.
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2)
    params = _params()
    text = (
        jax.jit(_step(tx, True))
        .trace(params, tx.init(params), _microbatches()[0])
        .lower()
        .as_text()
    )
    assert ("stablehlo.while" in text) == (backend == "gpu")


def test_closed_over_integer_tracers_under_jit_and_grad(form):
    # An inner optimizer whose schedule closes over an integer tracer (its
    # warmup) and a learning rate being differentiated, built inside the
    # differentiated function, in a scan over microbatches.
    x = jnp.asarray(np.random.default_rng(3).normal(size=(6, 3)), jnp.float32)

    def train(lr, warmup):
        sched = lambda c: jnp.where(c < warmup, lr / 2, lr)  # noqa: E731
        tx = mm.MaskedMultiSteps(optax.sgd(sched), 2)
        w = jnp.ones(3)

        def body(carry, xi):
            w, state = carry
            g = jax.grad(lambda w: jnp.sum((xi @ w) ** 2))(w)
            return tx.apply_gradients(g, state, w, count=1), None

        (w, _), _ = jax.lax.scan(body, (w, tx.init(w)), x)
        return jnp.sum(w**2)

    got = jax.jit(jax.grad(train))(0.1, jnp.int32(2))
    assert got == jax.grad(jax.jit(train))(0.1, jnp.int32(2))
    eps = 1e-3
    fd = (train(0.1 + eps, jnp.int32(2)) - train(0.1 - eps, jnp.int32(2))) / (2 * eps)
    np.testing.assert_allclose(got, fd, rtol=1e-2)


def test_eager_steps_keep_no_gradients_alive(form):
    # The branches' closures hold this call's gradients; nothing may keep them
    # (or their trace) once the call returns.
    tx = mm.MaskedMultiSteps(optax.adam(1e-3), 4)
    params = {"w": jnp.zeros(1 << 18)}  # 1 MiB
    state = tx.init(params)

    def live():
        gc.collect()
        return sum(a.nbytes for a in jax.live_arrays())

    for i in range(6):
        grads = {"w": jnp.full(1 << 18, float(i))}
        updates, state = tx.update(grads, state, params, count=jnp.int32(10))
        params = optax.apply_updates(params, updates)
        del grads, updates
        if i == 1:
            before = live()
    assert live() <= before


def test_reverse_mode_through_vmap_with_examples_in_different_branches(monkeypatch):
    # Two training runs side by side under `vmap`, their windows closing on
    # different microbatches (a token budget), one run's second microbatch
    # empty with NaN gradients: derivatives with respect to the learning rate
    # and the gradients' scale in the loop form equal the conditional's (a
    # batched conditional inside the loop's rule had no transpose).
    counts = jnp.array([[3, 0, 2, 4, 1], [1, 2, 5, 1, 3]], jnp.int32)

    def train(theta, lr, counts):
        tx = mm.MaskedMultiSteps(optax.adam(lr), tokens_per_window=4)
        w = jnp.array([1.0, -2.0, 0.5])
        state = tx.init(w)
        for i in range(counts.shape[0]):
            g = theta * w * (i + 1) + jnp.where(counts[i] == 0, jnp.nan, 0)
            w, state = tx.apply_gradients(g, state, w, count=counts[i])
        return jnp.sum(w**2) + state.acc_grads.sum()

    def loss(theta, lr):
        return jnp.sum(jax.vmap(train, in_axes=(None, None, 0))(theta, lr, counts))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    want = grad(0.7, 0.1)
    _loop_on_cpu(monkeypatch)
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(0.7, 0.1)
    assert all(np.isfinite(g) for g in got), got
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # Eager on purpose: the loop form's jvp rule under an eager vmap, unstaged.
    _, tangent = jax.jvp(lambda lr: loss(0.7, lr), (0.1,), (1.0,))
    np.testing.assert_allclose(tangent, want[1], rtol=1e-5)


def test_a_branch_not_taken_passes_no_nan_from_its_derivative(form):
    # The update branch takes sqrt of the state, whose derivative at 0 is
    # infinite; where it is not taken the state passes through with derivative
    # 1, in reverse mode and forward mode alike.
    def f(x, pred):
        def step(state, g):
            return jnp.sqrt(state) * g, jnp.float32(0)

        def hold(state, g):
            return jnp.float32(0)

        y, _ = _branch.in_place_cond(pred, step, hold, x, x)
        return jnp.sum(y)

    x = jnp.array([0.0, 4.0])
    g = jax.jit(jax.grad(f))(x, jnp.bool_(False))
    np.testing.assert_array_equal(g, np.ones(2))
    _, t = _jvp_with_traced_pred(f, jnp.bool_(False), (x,), (jnp.ones(2),))
    assert float(t) == 2.0


def test_the_held_branchs_output_has_its_derivatives(form):
    # What the branch that holds the state returns besides it may depend on
    # the operands; where it is the branch taken, its derivative is theirs.
    def f(x, pred):
        def step(state, g):
            return state, jnp.float32(0)

        def hold(state, g):
            return 3.0 * jnp.sum(g)

        _, extra = _branch.in_place_cond(pred, step, hold, x, 2.0 * x)
        return extra

    x = jnp.array([1.0, 2.0])
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x, jnp.bool_(False)), [6.0, 6.0])
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x, jnp.bool_(True)), [0.0, 0.0])
    _, t = _jvp_with_traced_pred(f, jnp.bool_(False), (x,), (jnp.ones(2),))
    assert float(t) == 12.0


def test_a_numeric_predicate_picks_a_branch_as_its_truth_value(form):
    # An integer predicate is true where it is not zero, as in `lax.cond`.
    def step(state, g):
        return state - g, jnp.int32(1)

    def hold(state, g):
        return jnp.int32(0)

    f = jax.jit(lambda pred: _branch.in_place_cond(pred, step, hold, jnp.ones(2), 1.0))
    for pred, want, extra in ((jnp.int32(2), 0.0, 1), (jnp.int32(0), 1.0, 0)):
        x, e = f(pred)
        np.testing.assert_array_equal(x, [want, want])
        assert int(e) == extra


def test_an_eager_call_runs_only_the_taken_branch(form):
    # Outside any trace the predicate is known: the other branch is not even
    # traced (a conditional would trace and compile both, on every call).
    def never(*args):
        raise AssertionError("the branch not taken ran")

    def step(state, g):
        return state - g, jnp.int32(1)

    state = jnp.ones(2)
    x, e = _branch.in_place_cond(jnp.bool_(True), step, never, state, 1.0)
    np.testing.assert_array_equal(x, [0.0, 0.0])
    assert int(e) == 1
    x, e = _branch.in_place_cond(jnp.int32(0), never, lambda s, g: 7, state, 1.0)
    assert x is state and e == 7


@pytest.mark.parametrize(
    "config",
    [
        dict(every_k_schedule=3),
        dict(
            every_k_schedule=3,
            should_skip_update_fn=optax.skip_not_finite,
            window_stats=True,
        ),
        dict(tokens_per_window=300),
    ],
    ids=["k", "skip, stats", "token budget"],
)
@pytest.mark.parametrize("apply_params", [False, True], ids=["update", "apply"])
def test_eager_steps_compile_nothing_once_both_branches_ran(config, apply_params):
    # An eager `update` compiled the window's conditional on every call (0.2-0.5
    # s a microbatch, as `optax.MultiSteps` does); now its operations compile
    # once, and a window of eager steps after the first compiles nothing.
    from _helpers import backend_compiles

    tx = _tx(**config)
    grads = jax.tree.map(lambda p: 0.01 * p, _params())
    counts = [jnp.int32(n) for n in (120, 0, 190, 90, 130, 100)]

    def window(params, state):
        for n in counts:
            if apply_params:
                params, state = tx.apply_gradients(grads, state, params, count=n)
            else:
                updates, state = tx.update(grads, state, params, count=n)
                params = optax.apply_updates(params, updates)
        return params, state

    params = _params()
    params, state = window(params, tx.init(params))
    assert int(state.gradient_step) == 2
    with backend_compiles() as compiles:
        params, state = window(params, state)
    assert compiles == []
    assert int(state.gradient_step) == 4


def test_eager_key_tells_apart_what_abstract_evaluation_sees():
    key = _branch.eager_key
    base = key({"w": jnp.ones(2)}, 3, "a")
    assert base == key({"w": jnp.zeros(2)}, 3, "a")  # values aside
    assert base == key({"w": np.zeros(2, np.float32)}, 3, "a")
    for other in [
        key({"w": jnp.ones(3)}, 3, "a"),  # shape
        key({"w": jnp.ones(2, jnp.bfloat16)}, 3, "a"),  # dtype
        key({"v": jnp.ones(2)}, 3, "a"),  # structure
        key([jnp.ones(2)], 3, "a"),
        key({"w": jnp.ones(2)}, 4, "a"),  # a number or string by value
        key({"w": jnp.ones(2)}, 3.0, "a"),  # and by type
        key({"w": jnp.ones(2)}, True, "a"),
        key({"w": jnp.ones(2)}, 3, "b"),
    ]:
        assert other is not None and other != base
    assert key(jnp.asarray(1.0)) != key(jnp.float32(1.0))  # weak type
    assert key({"w": jnp.ones(2)}, object()) is None  # could change unseen
    assert key(lambda x: x) is None
    assert key(np.array(["a"], object)) is None and key(np.str_("a")) is None
    seen = []  # traced: None
    jax.jit(lambda x: seen.append(key(x)) or x)(jnp.ones(2))
    jax.vmap(lambda x: seen.append(key(x)) or x)(jnp.ones((2, 3)))
    jax.grad(lambda x: seen.append(key(x)) or x)(1.0)
    assert seen == [None, None, None]


def test_eager_memo_keeps_the_newest_entries_and_serves_threads_at_once():
    memo = _branch.EagerMemo(size=3)
    for key in "abcd":
        memo.put(key, key.upper())
    assert [memo.get(k) for k in "abcd"] == [None, "B", "C", "D"]
    memo.put("b", "B2")  # written again: the newest
    memo.put("e", "E")
    assert [memo.get(k) for k in "bcde"] == ["B2", None, "D", "E"]
    memo.put(None, "x")  # a step with traced parts remembers nothing
    assert memo.get(None) is None

    # Threads stepping one wrapper eagerly share its memo: unlocked, one
    # thread's eviction between another's lookup and read (or two evicting
    # the same oldest entry) raised KeyError within a fraction of a second.
    memo, errors = _branch.EagerMemo(size=16), []

    def hammer(offset):
        try:
            for i in range(50_000):
                key = (7 * i + offset) % 40
                if memo.get(key) not in (None, -key):
                    raise AssertionError(f"{key} holds another key's value")
                memo.put(key, -key)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as it can
    try:
        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []


@pytest.mark.parametrize(
    "config",
    [
        dict(every_k_schedule=2),
        dict(every_k_schedule=2, window_stats=True),
        dict(every_k_schedule=4, norm_test=mm.norm_test(0.5, min_microbatches=2)),
    ],
    ids=["k", "stats", "norm test"],
)
@pytest.mark.parametrize("apply_params", [False, True], ids=["update", "apply"])
def test_eager_steps_keep_everything_on_the_arrays_device(config, apply_params):
    # A jitted step's outputs sit where its inputs do; an eager one's fresh
    # zeros (the updates between windows, the counters and sums a window's end
    # resets) landed on the default device. bfloat16 params: `update` cannot
    # hand back the accumulator's buffer, so its zeros are fresh ones.
    device = jax.devices()[3]
    tx = mm.MaskedMultiSteps(optax.adam(1e-2), **config)
    params = jax.device_put(
        {"w": jnp.arange(3.0, dtype=jnp.bfloat16), "b": jnp.ones((2, 2))}, device
    )
    state = tx.init(params)
    for i, n in enumerate([3, 0, 2, 4, 1, 5]):
        grads = jax.tree.map(lambda p, s=i - 2: (s * p).astype(p.dtype), params)
        count = jax.device_put(jnp.int32(n), device)
        if apply_params:
            params, state = out = tx.apply_gradients(grads, state, params, count=count)
        else:
            updates, state = out = tx.update(grads, state, params, count=count)
            params = optax.apply_updates(params, updates)
        for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
            assert leaf.devices() == {device}, (i, jax.tree_util.keystr(path))
    assert int(state.gradient_step) >= 2


def _counting(opt):
    """``opt`` whose ``update`` notes each call: traced (True) or run (False)."""
    calls = []

    def update(updates, state, params=None, **extra_args):
        leaf = jax.tree.leaves(updates)[0]
        calls.append(isinstance(leaf, jax.core.Tracer))
        return opt.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(opt.init, update), calls


@pytest.mark.parametrize("apply_params", [False, True], ids=["update", "apply"])
def test_eager_steps_trace_the_inner_optimizer_once(apply_params):
    # Which updates the inner optimizer returns (their shapes) is known from the
    # arguments' shapes: an eager step traced it twice on every call to find
    # out (most of such a step's time); now once, for the first call of a kind.
    inner, calls = _counting(optax.adam(1e-2))
    tx = mm.MaskedMultiSteps(inner, 3)
    params = _params()
    grads = jax.tree.map(lambda p: 0.01 * p, params)
    state = tx.init(params)
    for n in [120, 0, 190, 90, 130, 100]:
        if apply_params:
            params, state = tx.apply_gradients(grads, state, params, count=n)
        else:
            _, state = tx.update(grads, state, params, count=n)
    assert int(state.gradient_step) == 2
    assert calls.count(True) == 1  # the first call's abstract evaluation
    assert calls.count(False) == 2  # each window's end, run


def test_eager_steps_of_other_shapes_or_arguments_are_traced_for_their_own():
    # One wrapper, two models of different shapes and dtypes stepped eagerly
    # in turn, and an inner optimizer that needs `value=` (passed in some
    # calls, not in others): each call gets the shapes of its own kind, and
    # the run equals the jitted one.
    tx = mm.MaskedMultiSteps(
        optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=1)), 2
    )
    models = [
        {"w": jnp.arange(3.0)},
        {"w": jnp.ones((2, 2), jnp.bfloat16), "b": jnp.zeros(2)},
    ]

    def run(update):
        states = [tx.init(p) for p in models]
        params = list(models)
        for i in range(8):
            for j, p in enumerate(params):
                grads = jax.tree.map(lambda x, s=i + j: (x + s).astype(x.dtype), p)
                extra = {"value": jnp.float32(1.0 + i)} if i % 3 else {}
                updates, states[j] = update(
                    grads, states[j], p, count=jnp.int32(i + 1), **extra
                )
                params[j] = optax.apply_updates(p, updates)
        return params, states

    with pytest.warns(UserWarning, match="needs `value=`"):
        eager = run(tx.update)
    with pytest.warns(UserWarning, match="needs `value=`"):
        jitted = run(jax.jit(tx.update))
    for e, j in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        assert e.dtype == j.dtype and e.shape == j.shape
        rtol = 1e-2 if e.dtype == jnp.bfloat16 else 1e-6
        np.testing.assert_allclose(np.float32(e), np.float32(j), rtol=rtol)
    assert [int(s.gradient_step) for s in eager[1]] == [
        int(s.gradient_step) for s in jitted[1]
    ]


def test_an_eager_derivative_through_steps_equals_the_jitted_one():
    # Eagerly the counts decide each window's branch on the host: a derivative
    # goes through the taken branch alone, as the conditional's does under jit.
    tx = mm.MaskedMultiSteps(optax.sgd(0.1, momentum=0.9), 2)
    w0 = jnp.array([1.0, -2.0, 3.0])

    def train(scale):
        state, w = tx.init(w0), w0
        for i, n in enumerate([3, 0, 2, 5]):
            w, state = tx.apply_gradients(scale * w * (i + 1), state, w, count=n)
        return jnp.sum(w**2)

    x = jnp.float32(0.7)
    eager, jitted = jax.grad(train)(x), jax.jit(jax.grad(train))(x)
    np.testing.assert_allclose(eager, jitted, rtol=1e-6)


def test_eager_deferred_updates_between_windows_lie_where_the_params_do():
    # With a deferred reduction the gradients carry a leading device axis, so
    # the updates (the params' shape) cannot be placed like them: between
    # windows an eager `update`'s zeros are placed like the params
    # (replicated on the mesh), where a jitted step returns them, not on the
    # default device alone.
    mesh = jax.make_mesh(
        (4,),
        ("data",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:4],
    )
    replicated = NamedSharding(mesh, P())
    per_device = NamedSharding(mesh, P("data"))
    tx = mm.MaskedMultiSteps(optax.adam(1e-2), 2, reduction=mm.deferred(mesh, "data"))
    params = jax.device_put(
        {"w": jnp.arange(3.0), "b": jnp.ones(2, jnp.bfloat16)}, replicated
    )
    state = tx.init(params)
    for i, counts in enumerate([[1, 2, 0, 1], [3, 0, 1, 1], [2, 2, 2, 2]]):
        grads = jax.device_put(
            jax.tree.map(lambda p, s=i + 1: jnp.stack([s * p] * 4), params),
            per_device,
        )
        count = jax.device_put(jnp.array(counts, jnp.int32), per_device)
        updates, state = tx.update(grads, state, params, count=count)
        for path, leaf in jax.tree_util.tree_flatten_with_path(updates)[0]:
            assert leaf.sharding.is_equivalent_to(replicated, leaf.ndim), (
                i,
                jax.tree_util.keystr(path),
                leaf.sharding,
            )
        params = optax.apply_updates(params, updates)
    assert int(state.gradient_step) == 1


def test_an_inner_optimizer_closing_over_a_traced_value_leaks_no_tracer(form):
    # The loop form converts each branch's closure into arguments: the
    # converted function kept the closed jaxpr, whose consts (here the traced
    # learning rate) outlived the trace.
    params = {"w": jnp.ones(3)}

    def step(lr, grads, state):
        tx = mm.MaskedMultiSteps(optax.sgd(lr), 1)
        updates, state = tx.update(grads, state, params, count=jnp.int32(2))
        return optax.apply_updates(params, updates), state

    state = mm.MaskedMultiSteps(optax.sgd(0.1), 1).init(params)
    with jax.checking_leaks():
        new_params, state = jax.jit(step)(jnp.float32(0.5), params, state)
    np.testing.assert_allclose(new_params["w"], 0.5)
    assert int(state.gradient_step) == 1
