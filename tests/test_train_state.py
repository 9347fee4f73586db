"""`mm.TrainState`: keywords never vanish; a clear message without flax."""

import dataclasses
import importlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import masked_multistep as mm


class _StateWithStats(mm.TrainState):
    batch_stats: dict


class _Scaled(optax.GradientTransformationExtraArgs):
    """sgd(1.0) whose update is multiplied by a required `scale=`."""

    def __new__(cls):
        def init(params):
            del params
            return optax.EmptyState()

        def update(updates, state, params=None, *, scale, **extra):
            del params, extra
            return jax.tree.map(lambda u: -scale * u, updates), state

        return super().__new__(cls, init, update)


def _state(tx=None):
    return _StateWithStats.create(
        apply_fn=None,
        params={"w": jnp.zeros(2)},
        tx=tx or mm.MaskedMultiSteps(optax.sgd(1.0), 2),
        batch_stats={"n": 0},
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_misspelt_field_is_a_type_error_naming_it(jit):
    state = _state()

    def step(state):
        return state.apply_gradients(
            grads={"w": jnp.ones(2)}, count=jnp.int32(1), batch_stat={"n": 1}
        )

    with pytest.raises(
        TypeError,
        match=r"unexpected keyword argument\(s\) 'batch_stat': not a field of "
        r"_StateWithStats \(fields: .*batch_stats\)\. Did you mean 'batch_stats'\? "
        r"Arguments for the optimizer go in `extra_args",
    ):
        (jax.jit(step) if jit else step)(state)


def test_a_keyword_for_a_field_it_lacks_says_how_to_add_the_field():
    # flax's own TrainState has no batch_stats: a subclass declares it.
    state = mm.TrainState.create(
        apply_fn=None,
        params={"w": jnp.zeros(2)},
        tx=mm.MaskedMultiSteps(optax.sgd(1.0), 2),
    )
    with pytest.raises(
        TypeError,
        match=r"'batch_stats': not a field of TrainState \(fields: .*\)\. A field "
        r"of your own needs a subclass, e\.g\. `class State\(mm\.TrainState\): "
        r"batch_stats: Any = None`\. Arguments for the optimizer go in `extra_args",
    ):
        state.apply_gradients(grads={"w": jnp.ones(2)}, count=1, batch_stats={})


def test_several_unknown_keywords_are_all_named():
    with pytest.raises(TypeError, match=r"'lr', 'sacle'.*extra_args"):
        _state().apply_gradients(
            grads={"w": jnp.ones(2)}, count=jnp.int32(1), lr=0.1, sacle=2.0
        )


def test_the_fields_apply_gradients_sets_are_refused_by_name():
    # flax's replace() said "got multiple values for keyword argument 'step'".
    with pytest.raises(TypeError, match=r"got `step=`, set by .*replace\(step=...\)"):
        _state().apply_gradients(grads={"w": jnp.ones(2)}, count=1, step=0)


def test_optax_multisteps_as_tx_is_refused_as_it_ignores_the_count():
    # with_extra_args_support dropped `count`: the mean of means, silently
    # (-37 here, where the token-weighted window gives -76.9). `create` refuses
    # it, before a jitted step would.
    multisteps = optax.MultiSteps(optax.sgd(-1.0), 3)
    with pytest.raises(TypeError, match=r"optax.MultiSteps, which ignores `count`"):
        mm.TrainState.create(apply_fn=None, params=jnp.zeros(1), tx=multisteps)
    with pytest.raises(TypeError, match=r"mm.MaskedMultiSteps\(inner, k\)"):
        mm.TrainState.create(
            apply_fn=None, params=jnp.zeros(1), tx=optax.chain(multisteps)
        )
    # A state that gets one some other way is refused where it would be used.
    state = _state().replace(
        params=jnp.zeros(1), tx=multisteps, opt_state=multisteps.init(jnp.zeros(1))
    )
    with pytest.raises(TypeError, match=r"optax.MultiSteps, which ignores `count`"):
        state.apply_gradients(grads=jnp.ones(1), count=2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_transformations_chained_around_the_wrapper_are_warned_of(jit):
    # Accepted silently, they trained on another gradient: clipping chained
    # before the wrapper clips each microbatch (a window of (3, 0) with 1 token
    # and (0.1, 0) with 9 tokens moved the param by 0.19, not by the window
    # mean's 0.39, whose norm is below the threshold), and weight decay chained
    # after it moved the params on every microbatch, between windows too.
    def run(tx):
        state = mm.TrainState.create(apply_fn=None, params=jnp.ones(2), tx=tx)
        step = (
            jax.jit(type(state).apply_gradients) if jit else type(state).apply_gradients
        )
        for g, n in [(jnp.array([3.0, 0.0]), 1), (jnp.array([0.1, 0.0]), 9)]:
            state = step(state, grads=g, count=jnp.int32(n))
        return state.params

    wrapper = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    clip = optax.clip_by_global_norm(1.0)
    with pytest.warns(
        UserWarning,
        match=r"^`tx` chains clip_by_global_norm before MaskedMultiSteps: they see "
        r"each microbatch's gradient.*inside the wrapper",
    ):
        wrong = run(optax.chain(clip, wrapper))
    right = run(mm.MaskedMultiSteps(optax.chain(clip, optax.sgd(1.0)), 2))
    # With a deferred reduction it sees every device's gradient, stacked.
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    deferred = mm.MaskedMultiSteps(optax.sgd(1.0), 2, reduction=mm.deferred(mesh))
    with pytest.warns(UserWarning, match=r"they see each microbatch's gradients of "):
        mm.TrainState.create(
            apply_fn=None, params=jnp.ones(2), tx=optax.chain(clip, deferred)
        )
    np.testing.assert_allclose(1 - wrong, [0.19, 0.0], rtol=1e-5)
    np.testing.assert_allclose(1 - right, [0.39, 0.0], rtol=1e-5)
    decay = optax.add_decayed_weights(0.5)
    with pytest.warns(
        UserWarning,
        match=r"^`tx` chains add_decayed_weights after MaskedMultiSteps: they run "
        r"on every microbatch, on zero updates between windows",
    ):
        mm.TrainState.create(
            apply_fn=None, params=jnp.ones(2), tx=optax.chain(wrapper, decay)
        )
    with pytest.warns(UserWarning, match=r"chains clip before .*; and scale_by_adam"):
        mm.TrainState.create(
            apply_fn=None,
            params=jnp.ones(2),
            tx=optax.chain(optax.chain(optax.clip(1.0)), wrapper, optax.adam(0.1)),
        )
    # The same chains written with optax.named_chain, or with the wrapper in a
    # group of optax.partition (freezing other params): no word was said.
    labels = {"t": "t", "f": "f"}
    frozen = optax.set_to_zero()
    for tx, where in [
        (optax.named_chain(("clip", clip), ("acc", wrapper)), "before"),
        (
            optax.partition({"t": optax.chain(clip, wrapper), "f": frozen}, labels),
            "before",
        ),
        (
            optax.chain(clip, optax.partition({"t": wrapper, "f": frozen}, labels)),
            "before",
        ),
        (optax.named_chain(("acc", wrapper), ("decay", decay)), "after"),
    ]:
        params = {"t": jnp.ones(2), "f": jnp.ones(2)}
        with pytest.warns(
            UserWarning, match=rf"^`tx` chains \w+ {where} MaskedMultiSteps"
        ):
            mm.TrainState.create(apply_fn=None, params=params, tx=tx)
    # Linear, stateless neighbours (and zeros for NaNs before it) are harmless;
    # so are other groups' transformations beside the wrapper's.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for tx in [
            optax.chain(optax.scale(2.0), optax.zero_nans(), wrapper, optax.scale(-1)),
            optax.chain(optax.identity(), wrapper.gradient_transformation()),
            optax.chain(wrapper),
            mm.MaskedMultiSteps(optax.chain(clip, decay, optax.sgd(1.0)), 2),
        ]:
            mm.TrainState.create(apply_fn=None, params=jnp.ones(2), tx=tx)
        tx = optax.partition({"t": wrapper, "f": optax.chain(clip, decay)}, labels)
        mm.TrainState.create(apply_fn=None, params=params, tx=tx)
        # (A partition or mask after it may act on other params only.)
        grouped = optax.partition({"t": wrapper, "f": optax.adam(0.1)}, labels)
        for then in (
            optax.partition({"t": optax.identity(), "f": decay}, labels),
            optax.masked(decay, {"t": False, "f": True}),
        ):
            tx = optax.chain(grouped, then)
            mm.TrainState.create(apply_fn=None, params=params, tx=tx)
    # Of two wrappers in two groups, the one with clipping around it.
    tx = optax.partition({"t": wrapper, "f": optax.chain(clip, wrapper)}, labels)
    with pytest.warns(UserWarning, match=r"^`tx` chains clip_by_global_norm before"):
        mm.TrainState.create(apply_fn=None, params=params, tx=tx)


def test_two_wrappers_in_series_are_refused():
    # Accepted, they trained on the wrong gradient: after windows of (1, n=3),
    # (5, n=1) the param was -1.0, not -2.0 (the second wrapper averaged the
    # first's in-window zero updates as microbatches).
    tx = optax.chain(
        mm.MaskedMultiSteps(optax.sgd(1.0), 2), mm.MaskedMultiSteps(optax.identity(), 2)
    )
    with pytest.raises(TypeError, match=r"two MaskedMultiSteps one after .*\[0\]"):
        mm.TrainState.create(apply_fn=None, params=jnp.zeros(1), tx=tx)
    inner = optax.chain(optax.scale(1.0), mm.MaskedMultiSteps(optax.sgd(1.0), 2))
    with pytest.raises(TypeError, match=r"inner_states\['x'\].*one wrapper"):
        mm.TrainState.create(
            apply_fn=None,
            params={"a": jnp.zeros(1), "b": jnp.zeros(1)},
            tx=optax.multi_transform(
                {
                    "x": optax.chain(inner, mm.MaskedMultiSteps(optax.sgd(1.0), 2)),
                    "y": optax.sgd(1.0),
                },
                {"a": "x", "b": "y"},
            ),
        )


def test_two_wrappers_on_disjoint_masked_halves_are_not_in_series():
    # Each param passes through one wrapper (complementary optax.masked halves,
    # chained): the refusal said the second would average the first's zeros.
    params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
    half = lambda k, mask: optax.masked(mm.MaskedMultiSteps(optax.sgd(1.0), k), mask)
    tx = optax.chain(half(2, {"a": True, "b": False}), half(3, {"a": False, "b": True}))
    state = mm.TrainState.create(apply_fn=None, params=params, tx=tx)
    for n, g in ((1, 1.0), (3, 5.0), (1, 2.0)):
        grads = jax.tree.map(lambda p, g=g: jnp.full_like(p, g), params)
        state = state.apply_gradients(grads=grads, count=n)
    # "a": one window of (1, n=1), (5, n=3); "b": one of all three.
    np.testing.assert_allclose(state.params["a"], -(1 + 15) / 4)
    np.testing.assert_allclose(state.params["b"], -(1 + 15 + 2) / 5)
    # Halves that overlap ("b" through both) are in series, and so is a
    # wrapper of another tree of the same params (optax.flatten's vector).
    series = [
        optax.chain(half(2, {"a": True, "b": True}), half(3, {"a": False, "b": True})),
        optax.chain(
            mm.MaskedMultiSteps(optax.sgd(1.0), 2),
            optax.flatten(mm.MaskedMultiSteps(optax.sgd(1.0), 2)),
        ),
    ]
    for tx in series:
        with pytest.raises(TypeError, match=r"two MaskedMultiSteps one after"):
            mm.TrainState.create(apply_fn=None, params=params, tx=tx)


def test_a_new_tx_in_apply_gradients_is_refused():
    # flax's stepped with the old tx, then paired the new one with its state.
    with pytest.raises(TypeError, match=r"got `tx=`.*state.replace\(tx=new_tx"):
        _state().apply_gradients(grads={"w": jnp.ones(2)}, count=1, tx=optax.adam(1e-3))


def test_two_wrapped_branches_say_which_part_of_the_state_to_read():
    params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
    tx = optax.multi_transform(
        {
            "x": mm.MaskedMultiSteps(optax.adam(0.1), 2).gradient_transformation(),
            "y": mm.MaskedMultiSteps(optax.sgd(0.1), 2).gradient_transformation(),
        },
        {"a": "x", "b": "y"},
    )
    state = mm.TrainState.create(apply_fn=None, params=params, tx=tx)
    state = state.apply_gradients(grads=jax.tree.map(jnp.ones_like, params), count=1)
    # (A property takes no argument: "pass the one you mean" did not apply.)
    with pytest.raises(
        ValueError,
        match=r"TrainState.gradient_step reads the one MaskedMultiSteps state in "
        r"`opt_state`, which holds 2 \(at `state.opt_state.inner_states\['x'\]"
        r"\.inner_state`, .*\): read the one you mean, e\.g\. `mm.find_state\("
        r"state.opt_state.inner_states\['x'\].inner_state\).gradient_step`",
    ):
        _ = state.gradient_step
    hint = r"found 2 in a TrainState \(at `state.opt_state.inner_states\['x'\]"
    with pytest.raises(ValueError, match=hint):
        mm.has_updated(state)
    assert int(mm.find_state(state.opt_state.inner_states["x"].inner_state).mini_step)
    # The hint's path works.
    assert int(mm.find_state(state.opt_state.inner_states["x"]).mini_step) == 1


def test_fields_are_replaced_and_extra_args_reach_the_optimizer():
    state = _state(mm.MaskedMultiSteps(_Scaled(), 2))
    for g, n in [(1.0, 3), (5.0, 1)]:
        state = state.apply_gradients(
            grads={"w": jnp.full(2, g)},
            count=jnp.int32(n),
            extra_args={"scale": jnp.float32(0.5)},
            batch_stats={"n": int(state.batch_stats["n"]) + 1},
        )
    np.testing.assert_allclose(state.params["w"], -0.5 * 2.0)
    assert state.batch_stats == {"n": 2} and int(state.step) == 2


def test_count_and_value_inside_extra_args_are_refused():
    with pytest.raises(TypeError, match="Pass count to apply_gradients directly"):
        _state().apply_gradients(
            grads={"w": jnp.ones(2)}, count=jnp.int32(1), extra_args={"count": 2}
        )


def test_extra_args_that_are_not_a_mapping_are_named():
    # dict([1]) failed inside: "cannot convert dictionary update sequence".
    with pytest.raises(TypeError, match="`extra_args` must be a mapping.*got list"):
        _state().apply_gradients(
            grads={"w": jnp.ones(2)}, count=jnp.int32(1), extra_args=[1]
        )


def test_without_flax_the_import_error_says_how_to_install_it(monkeypatch):
    # Make flax unimportable for the lazy import of `masked_multistep.TrainState`.
    for name in [m for m in sys.modules if m == "flax" or m.startswith("flax.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "flax", None)
    monkeypatch.delitem(sys.modules, "masked_multistep._train_state")
    monkeypatch.delattr(mm, "TrainState", raising=False)
    expected = (
        "masked_multistep.TrainState needs flax, which is not installed: "
        "`pip install flax`, or from a checkout of masked_multistep "
        '`pip install ".[flax]"` (`make test` installs it too).'
    )
    with pytest.raises(ImportError) as info:
        importlib.import_module("masked_multistep._train_state")
    assert str(info.value) == expected
    with pytest.raises(ImportError) as info:
        mm.TrainState  # noqa: B018
    assert str(info.value) == expected


def test_create_names_missing_params_and_fields_it_lacks():
    # flax's create failed on params=None with "argument of type 'NoneType' is
    # not iterable", and took an unknown field with a bare TypeError.
    with pytest.raises(TypeError, match=r"`params` must be .*, got None"):
        mm.TrainState.create(apply_fn=None, params=None, tx=optax.sgd(1.0))
    with pytest.raises(
        TypeError,
        match=r"^`tx` must be an optax GradientTransformation, got NoneType: build "
        r"one, e.g. mm.MaskedMultiSteps\(optax.adam",
    ):
        mm.TrainState.create(apply_fn=None, params=jnp.zeros(2), tx=None)
    with pytest.raises(TypeError, match=r"got NoneType: build one, e.g. optax.adam"):
        mm.MaskedMultiSteps(None, 2)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"TrainState\.create got unexpected keyword argument\(s\) "
        r"'batch_stats'.*`class State\(mm\.TrainState\): batch_stats: Any",
    ):
        mm.TrainState.create(
            apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.sgd(1.0), batch_stats={}
        )


@pytest.mark.parametrize(
    ("count", "error", "match"),
    [
        ("abc", TypeError, r"`count` must be a real scalar, got 'abc'"),
        (-1, ValueError, r"`count` must be non-negative, got -1"),
        (float("nan"), ValueError, r"`count` must be a finite"),
        (True, TypeError, r"`count` must be a number of tokens, got a bool"),
        (jnp.ones(2), ValueError, r"`count` must be a scalar"),
    ],
)
def test_a_plain_optimizers_count_is_checked_as_the_wrappers(count, error, match):
    """No wrapper reads the count of a plain optimizer, but it is still checked:
    a loss, a mask or a flag passed as the count is a mistake wherever it goes."""
    with pytest.warns(UserWarning, match="`tx` holds no mm.MaskedMultiSteps"):
        state = mm.TrainState.create(
            apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.sgd(1.0)
        )
    with pytest.raises(error, match=match):
        state.apply_gradients(grads={"w": jnp.ones(2)}, count=count)
    # A valid one, concrete or traced, changes nothing of the plain step.
    step = jax.jit(lambda s, n: s.apply_gradients(grads={"w": jnp.ones(2)}, count=n))
    for n in (3, jnp.float32(-1.0)):  # traced: not checked, as the wrapper's
        assert float(step(state, n).params["w"][0]) == -1.0


def test_positional_or_missing_gradients_say_how_to_call():
    # Python's own "takes 1 positional argument but 3 were given" before.
    state = _state()
    with pytest.raises(
        TypeError,
        match=r"^_StateWithStats.apply_gradients takes keyword arguments only, as "
        r"flax's does, got 2 positional: call `state.apply_gradients\(grads=grads, "
        r"count=n\)`",
    ):
        state.apply_gradients(jax.tree.map(jnp.ones_like, state.params), 3)
    with pytest.raises(TypeError, match=r"needs the microbatch's gradients.*\)`$"):
        state.apply_gradients(count=3)
    # A misspelt keyword is named, with the fix (the missing gradients were
    # reported first, without it).
    with pytest.raises(
        TypeError,
        match=r"^_StateWithStats.apply_gradients got unexpected keyword "
        r"argument\(s\) 'grad': .* Did you mean 'grads'\?",
    ):
        state.apply_gradients(grad=state.params, count=3)


def test_a_tx_replaced_without_its_state_is_named():
    # optax's own "The number of updates and states has to be the same in
    # chain!" said nothing of the state left over from the old `tx`.
    state = mm.TrainState.create(
        apply_fn=None,
        params={"w": jnp.zeros(2)},
        tx=mm.MaskedMultiSteps(optax.sgd(1.0), 2),
    )
    state = state.replace(tx=optax.sgd(0.1))
    with pytest.raises(ValueError) as info:
        state.apply_gradients(grads={"w": jnp.ones(2)}, count=2)
    assert any(
        "`opt_state` is not the state `tx.init` builds" in note
        for note in getattr(info.value, "__notes__", [])
    )


def test_create_continues_a_converted_run_compiled_once():
    # From flax's own TrainState with optax.MultiSteps, mid-window: `create`
    # takes the run's `step` and the converted `opt_state` (it refused them:
    # "got multiple values for keyword argument 'step'"), runs its checks on
    # them, and places `step` as apply_gradients returns it, so the converted
    # run's jitted step compiles once (a Python or host step compiled twice).
    from flax.training import train_state

    params = {"w": jnp.zeros(2)}
    old = train_state.TrainState.create(
        apply_fn=None, params=params, tx=optax.MultiSteps(optax.sgd(1.0), 4)
    )
    old = old.apply_gradients(grads={"w": jnp.ones(2)})  # one microbatch of 16 tokens
    old = old.replace(step=int(old.step))  # as restored into flax's template
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 4)
    converted = mm.from_optax_multisteps(old.opt_state, tx, old.params, acc_count=16)
    state = _StateWithStats.create(
        apply_fn=None,
        params=old.params,
        tx=tx,
        step=old.step,
        opt_state=converted,
        batch_stats={"n": 0},
    )
    traces = []

    @jax.jit
    def step(state, g, n):
        traces.append(1)
        return state.apply_gradients(grads={"w": g}, count=n)

    for g, n in [(3.0, 8), (0.5, 16), (2.0, 24)]:  # closes the window at 64 tokens
        state = step(state, jnp.full(2, g), jnp.float32(n))
    assert len(traces) == 1
    assert int(state.step) == 4 and int(state.gradient_step) == 1
    mean = (16 * 1.0 + 8 * 3.0 + 16 * 0.5 + 24 * 2.0) / 64
    np.testing.assert_allclose(state.params["w"], -mean, rtol=1e-6)
    # The checks run on what is given.
    with pytest.raises(
        ValueError, match=r"^`opt_state` must be the state `tx.init\(params\)` builds"
    ):
        mm.TrainState.create(
            apply_fn=None, params=params, tx=tx, opt_state=optax.sgd(1.0).init(params)
        )
    with pytest.raises(
        ValueError,
        match=r"^`opt_state.acc_grads\['w'\]` has shape \(2,\) where "
        r"`tx.init\(params\)` builds \(3,\): a state of other params",
    ):
        mm.TrainState.create(
            apply_fn=None, params={"w": jnp.zeros(3)}, tx=tx, opt_state=converted
        )
    with pytest.raises(
        ValueError,
        match=r"it builds MaskedMultiStepsState, got MaskedMultiStepsState \(the "
        r"first leaf apart: `opt_state.acc_grads\['v'\]`, where `init` builds "
        r"`opt_state.acc_grads\['w'\]`\)",
    ):
        mm.TrainState.create(
            apply_fn=None, params=params, tx=tx, opt_state=tx.init({"v": jnp.zeros(2)})
        )
    for step, error, match in [
        (3.7, TypeError, r"`step` must be an integer, the microbatches applied"),
        (True, TypeError, r"`step` must be an integer"),
        # (A string and a key were numpy's and jax's errors, unnamed.)
        ("5", TypeError, r"`step` must be an integer"),
        (jax.random.key(0), TypeError, r"`step` must be an integer"),
        (np.array([1]), ValueError, r"`step` must be a scalar, got shape \(1,\)"),
        (-3, ValueError, r"`step` must be in \[0, 2\*\*31 - 1\]"),
    ]:
        with pytest.raises(error, match=match):
            mm.TrainState.create(
                apply_fn=None, params=params, tx=tx, step=step, opt_state=converted
            )
    with pytest.raises(TypeError, match="optax.MultiSteps"):
        mm.TrainState.create(
            apply_fn=None,
            params=params,
            tx=optax.MultiSteps(optax.sgd(1.0), 4),
            opt_state=old.opt_state,
        )
    with pytest.warns(UserWarning, match="clip_by_global_norm"):
        mm.TrainState.create(
            apply_fn=None,
            params=params,
            tx=optax.chain(optax.clip_by_global_norm(1.0), tx),
            step=1,
            opt_state=(optax.EmptyState(), converted),
        )


def test_create_places_a_step_from_other_devices_with_the_params():
    # A run continued on other devices: a step held on one device (or another
    # mesh) beside params on a mesh made the first jitted step fail
    # ("incompatible devices for jitted computation").
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params = jax.device_put({"w": jnp.zeros(8)}, NamedSharding(mesh, P()))
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    for step in [
        jax.device_put(jnp.int32(5), jax.devices()[0]),
        jax.device_put(jnp.int32(5), NamedSharding(jax.make_mesh((4,), ("d",)), P())),
    ]:
        state = mm.TrainState.create(
            apply_fn=None, params=params, tx=tx, step=step, opt_state=tx.init(params)
        )
        state = jax.jit(lambda s: s.apply_gradients(grads=s.params, count=2))(state)
        assert int(state.step) == 6
        assert state.step.sharding.is_equivalent_to(NamedSharding(mesh, P()), 0)


def test_a_run_continued_on_scalar_params_and_a_subclass_named_in_errors():
    # `create(opt_state=...)` tested `OVERWRITE_WITH_GRADIENT in params` on
    # any params: "argument of type 'numpy.float32' is not iterable".
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    for params in (np.float32(0.0), 0.0):
        state = mm.TrainState.create(
            apply_fn=None, params=params, tx=tx, opt_state=tx.init(params), step=4
        )
        state = state.apply_gradients(grads=jnp.float32(1.0), count=1)
        state = state.apply_gradients(grads=jnp.float32(3.0), count=1)
        assert float(state.params) == -2.0 and int(state.step) == 6

    class State(mm.TrainState):
        extra: int = 0

    state = State.create(apply_fn=None, params=jnp.zeros(2), tx=tx)
    with pytest.raises(TypeError, match=r"^State\.apply_gradients needs the .* count"):
        state.apply_gradients(grads=jnp.ones(2))


def test_params_of_a_pytree_class_of_its_own_are_taken():
    # flax's `create` tests `OVERWRITE_WITH_GRADIENT in params` on any params:
    # an Equinox module's (a pytree class without `in`) failed there with
    # "argument of type 'MLP' is not iterable", though `tx.init` takes them.
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Params:
        w: jax.Array

    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    state = mm.TrainState.create(apply_fn=None, params=Params(jnp.zeros(2)), tx=tx)
    for g in (1.0, 3.0):
        state = state.apply_gradients(grads=Params(jnp.full(2, g)), count=1)
    np.testing.assert_array_equal(state.params.w, [-2.0, -2.0])
