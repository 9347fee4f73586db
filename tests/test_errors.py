"""Bad input: clear errors where values are known, total arithmetic under jit."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import masked_multistep as mm
from tests._helpers import assert_bit_identical

PARAMS = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
GRADS = jax.tree.map(jnp.ones_like, PARAMS)


@pytest.fixture
def tx():
    return mm.MaskedMultiSteps(optax.sgd(1.0), 2)


@pytest.mark.parametrize("k", [0, -3, np.int64(0), jnp.array(0)], ids=repr)
def test_k_below_one_is_a_value_error(k):
    with pytest.raises(ValueError, match=r"`every_k_schedule` must be >= 1, got -?\d"):
        mm.MaskedMultiSteps(optax.sgd(1.0), k)


@pytest.mark.parametrize("k", [2.0, True, "3", jnp.array(2.0)], ids=repr)
def test_k_of_the_wrong_type_is_a_type_error(k):
    with pytest.raises(TypeError, match="`every_k_schedule` must be an integer"):
        mm.MaskedMultiSteps(optax.sgd(1.0), k)


def test_no_window_rule_is_a_type_error_naming_the_three():
    with pytest.raises(
        TypeError, match="`every_k_schedule`.*`tokens_per_window`.*`norm_test`"
    ):
        mm.MaskedMultiSteps(optax.sgd(1.0), None)


def test_bad_constructor_arguments():
    with pytest.raises(
        TypeError, match="`opt` must be an optax GradientTransformation"
    ):
        mm.MaskedMultiSteps(lambda g: g, 2)
    # The window's length and the optimizer swapped.
    with pytest.raises(
        TypeError,
        match=r"^`opt` must be an optax GradientTransformation, got int \(4\), and "
        r"`every_k_schedule` got one: the optimizer goes first",
    ):
        mm.MaskedMultiSteps(4, optax.sgd(1.0))  # type: ignore[arg-type]
    # The factory in place of the optimizer it builds.
    with pytest.raises(TypeError, match=r"got function 'adam': call it to build"):
        mm.MaskedMultiSteps(optax.adam, 2)
    with pytest.raises(ValueError, match="`accumulator_dtype` must be a floating"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, accumulator_dtype=jnp.int32)
    with pytest.raises(TypeError, match="`accumulator_dtype` must be .* 'flaot32'"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, accumulator_dtype="flaot32")
    with pytest.raises(ValueError, match="`count_dtype` must be one of"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, count_dtype=jnp.int8)
    # jnp.dtype(None) is float64: it named a dtype nobody passed.
    with pytest.raises(TypeError, match="`count_dtype` must be a dtype, got None"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, count_dtype=None)


def test_a_complex_gradient_for_a_real_parameter_is_refused():
    # The accumulator follows the params: a complex gradient would lose its
    # imaginary part (jax only warns, hidden by default).
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 1)
    p = {"w": jnp.zeros(2)}
    with pytest.raises(TypeError, match=r"\['w'\] is complex \(complex64\).*float32"):
        tx.update({"w": jnp.ones(2, jnp.complex64)}, tx.init(p), p, count=1)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_])
def test_an_integer_gradient_is_refused(dtype):
    # The window's mean reaches the inner optimizer in the gradients' dtype: an
    # integer one truncated it, (1·1 + 3·3) / 4 = 2.5 became 2, silently.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    p = {"w": jnp.zeros(2)}
    with pytest.raises(
        TypeError,
        match=rf"\['w'\] has dtype {jnp.dtype(dtype)}.*"
        "floating point",
    ):
        tx.update({"w": jnp.ones(2, dtype)}, tx.init(p), p, count=1)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int16, jnp.uint32])
def test_count_dtypes_that_cannot_hold_counts_are_refused(dtype):
    # A float16 total rounds 2049 to 2048; bfloat16 rounds 257 to 256.
    with pytest.raises(
        ValueError, match=f"`count_dtype` must be one of.*got {jnp.dtype(dtype)}"
    ):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, count_dtype=dtype)


def test_64_bit_count_dtypes_need_x64():
    with pytest.raises(ValueError, match="jax_enable_x64"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, count_dtype=jnp.float64)
    # Python's own types are 64-bit dtypes: the error says so.
    for python_type, dtype in ((int, "int64"), (float, "float64")):
        with pytest.raises(
            ValueError,
            match=rf"^`count_dtype={dtype}` needs .*\(`{python_type.__name__}` is "
            rf"{dtype}\)$",
        ):
            mm.MaskedMultiSteps(optax.sgd(1.0), 2, count_dtype=python_type)
    with pytest.raises(ValueError, match=r"float32\) \(`float` is float64\)$"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, accumulator_dtype=float)


def test_k_too_large_for_the_state_is_refused_in_the_constructor():
    with pytest.raises(ValueError, match=r"at most 2\*\*31 - 1.*got 2147483648"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2**31)
    mm.MaskedMultiSteps(optax.sgd(1.0), 2**31 - 1)


def test_optax_multisteps_keywords_are_explained():
    with pytest.raises(TypeError, match="'use_grad_mean'.*always keeps a running"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, use_grad_mean=True)
    # optax.MultiSteps takes them by position too: Python's error named
    # neither argument (and counted `cls`: "5 were given" for 4).
    with pytest.raises(
        TypeError,
        match=r"by position and the rest by keyword, got 2 more positional arguments "
        r"\(as optax.MultiSteps would read them: use_grad_mean=True, "
        r"should_skip_update_fn=<function skip_not_finite>\).*multiply its learning",
    ):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, True, optax.skip_not_finite)
    with pytest.raises(TypeError, match="unexpected keyword argument 'lr'\\.$"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, lr=0.1)
    with pytest.raises(TypeError, match="'window_stat': did you mean 'window_stats'"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, window_stat=True)
    # The catch-all is not a suggestion.
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'unknown'\.$"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, unknown=1)


def test_microbatching_keywords_of_other_apis_are_explained():
    # They got Python's bare "unexpected keyword argument".
    loss = lambda w, mb: mm.masked_mean(w * mb, jnp.ones_like(mb, bool))  # noqa: E731
    with pytest.raises(TypeError, match=r"'argnums': gradients are taken .* first"):
        mm.microbatched_value_and_grad(loss, 2, argnums=1)
    with pytest.raises(TypeError, match=r"'has_axu': did you mean 'has_aux'"):
        mm.microbatched_value_and_grad(loss, 2, has_axu=True)
    with pytest.raises(TypeError, match=r"'rng': pass the key to the returned"):
        mm.microbatched_value_and_grad(loss, 2, rng=jax.random.key(0))
    mesh = jax.make_mesh((1,), ("data",))
    with pytest.raises(TypeError, match=r"'k': the microbatches per device are"):
        mm.data_parallel_value_and_grad(loss, mesh, k=2)
    with pytest.raises(TypeError, match=r"'accumulation_steps': the microbatches per"):
        mm.per_device_value_and_grad(loss, mesh, accumulation_steps=2)
    # `k=` alone was Python's "missing 1 required positional argument".
    with pytest.raises(TypeError, match=r"'k': the number of microbatches is"):
        mm.microbatched_value_and_grad(loss, k=2)  # pyright: ignore
    with pytest.raises(TypeError, match=r"needs the number of microbatches"):
        mm.microbatched_value_and_grad(loss)  # pyright: ignore
    with pytest.raises(TypeError, match=r"'with_stats': each device's gradient"):
        mm.per_device_value_and_grad(loss, mesh, with_stats=True)  # pyright: ignore


@pytest.mark.parametrize("keyword", ["k", "num_microbatches", "accumulation_steps"])
def test_other_names_of_the_window_size_point_to_every_k_schedule(keyword):
    with pytest.raises(TypeError, match=f"'{keyword}': the microbatches per window"):
        mm.MaskedMultiSteps(optax.sgd(1.0), **{keyword: 4})


def test_a_window_policy_given_to_the_other_keyword_is_refused():
    budget = mm.token_budget(100)
    with pytest.raises(
        ValueError,
        match=r"`norm_test` got mm.token_budget\(100\).*"
        "pass it as `tokens_per_window=`",
    ):
        mm.MaskedMultiSteps(optax.sgd(1.0), norm_test=budget)
    test = mm.norm_test(0.5, max_tokens=100)
    with pytest.raises(
        ValueError,
        match=r"`tokens_per_window` got mm.norm_test.*"
        "pass it as `norm_test=`",
    ):
        mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=test)
    # Each where it belongs.
    mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=budget, norm_test=test)


@pytest.mark.parametrize(
    "policy, keyword",
    [
        (mm.token_budget(4096), "tokens_per_window"),
        (mm.token_budget(lambda step: 4096.0, by="gradient_step"), "tokens_per_window"),
        (mm.norm_test(0.5, max_microbatches=8), "norm_test"),
    ],
    ids=["budget", "schedule", "norm_test"],
)
def test_a_window_policy_as_the_window_size_names_its_keyword(policy, keyword):
    # The second positional argument is every_k_schedule, the number of
    # microbatches: MaskedMultiSteps(opt, mm.token_budget(4096)) reads naturally.
    with pytest.raises(
        TypeError,
        match=rf"`every_k_schedule` got mm\.\w+\(.*a window policy: pass it as "
        rf"`{keyword}=`",
    ):
        mm.MaskedMultiSteps(optax.sgd(1.0), policy)


def test_inject_hyperparams_around_the_wrapper_says_where_it_goes():
    # optax binds the catch-all as `unknown={}`; the wrapper would be rebuilt
    # on every call with traced settings.
    tx = optax.inject_hyperparams(mm.MaskedMultiSteps, static_args="every_k_schedule")(
        optax.sgd(1.0), every_k_schedule=2
    )
    with pytest.raises(TypeError, match=r"optax.inject_hyperparams\(optax.adam\)"):
        tx.init(jnp.zeros(2))


def test_a_misspelt_count_or_value_is_named_not_forwarded():
    # Extra keywords go to the inner optimizer, which drops what it does not
    # take: a misspelt `value=` would vanish (reduce_on_plateau would get the
    # window's NaN loss) and a misspelt `count=` be reported as missing.
    inner = optax.chain(
        optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=0, factor=0.5)
    )
    tx = mm.MaskedMultiSteps(inner, 1)
    state = tx.init(PARAMS)
    for kwargs, name in [
        ({"count": 3, "valeu": 5.0}, "value"),
        ({"cout": 3}, "count"),
        ({"counts": 3}, "count"),
    ]:
        misspelt = next(k for k in kwargs if k not in ("count", "value"))
        match = rf"{misspelt!r}: did you mean {name!r}"
        with pytest.raises(TypeError, match=match):
            tx.update(GRADS, state, PARAMS, **kwargs)
        with pytest.raises(TypeError, match=match):
            tx.apply_gradients(GRADS, state, PARAMS, **kwargs)
    # Other extra arguments still reach the inner optimizer.
    _, state = tx.update(GRADS, state, PARAMS, count=3, value=jnp.float32(5.0))
    assert float(state.inner_opt_state[1].best_value) == 5.0
    train_state = mm.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    with pytest.raises(TypeError, match=r"'cout'.*Did you mean 'count'"):
        train_state.apply_gradients(grads=GRADS, cout=3)


def test_the_loss_under_its_own_name_is_sent_to_value():
    # `loss=` went to the inner optimizer, which dropped it: the window's loss
    # was NaN, and reduce_on_plateau inside never applied a window.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    state = tx.init(PARAMS)
    names = ("loss", "mean_loss", "val", "vals", "loss_val", "mb_loss", "metric")
    for name in names + ("meanLoss", "lossValue", "MbLoss"):
        with pytest.raises(TypeError, match=rf"{name!r}: .* goes in `value=`"):
            tx.update(GRADS, state, PARAMS, count=3, **{name: jnp.float32(0.7)})
    train_state = mm.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    with pytest.raises(TypeError, match=r"'loss'.*Did you mean 'value'"):
        train_state.apply_gradients(grads=GRADS, count=3, loss=0.7)
    with pytest.raises(TypeError, match=r"'loss': .* goes in `value=`"):
        train_state.apply_gradients(grads=GRADS, count=3, extra_args={"loss": 0.7})


def test_names_with_words_of_their_own_go_to_the_inner_optimizer():
    # Guesses are names made of a guess's words alone: `loss_scale=` or
    # `end_value=` may be an inner optimizer's own, and reach it.
    seen = {}

    def update(updates, state, params=None, **extra_args):
        seen.update(extra_args)
        return updates, state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    tx = mm.MaskedMultiSteps(inner, 1)
    extra = {"loss_scale": 2.0, "end_value": 3.0, "last_lr": 4.0, "value_fn": 5.0}
    extra |= {"val_loss": 6.0, "eval_loss": 7.0, "validation_loss": 8.0}
    extra |= {"update_scale": 9.0, "objective_fn": 10.0}
    extra |= {"lossScale": 11.0, "valLoss": 12.0, "evalLoss": 13.0}
    tx.update(GRADS, tx.init(PARAMS), PARAMS, count=3, **extra)
    assert seen == extra


def test_a_guessed_name_that_an_inner_transformation_names_reaches_it():
    # `metric=` guesses at `value=`, but a transformation of the user's that
    # takes it by name gets it (inside a chain too).
    seen = {}

    def update(updates, state, params=None, *, metric, **extra_args):
        seen["metric"] = metric
        return updates, state

    own = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    for inner in (own, optax.chain(optax.sgd(1.0), own)):
        tx = mm.MaskedMultiSteps(inner, 1)
        tx.update(GRADS, tx.init(PARAMS), PARAMS, count=3, metric=jnp.float32(2.0))
        assert float(seen.pop("metric")) == 2.0
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 1)
    with pytest.raises(TypeError, match=r"'metric': .* goes in `value=`"):
        tx.update(GRADS, tx.init(PARAMS), PARAMS, count=3, metric=jnp.float32(2.0))


def test_an_integer_array_value_is_taken_for_a_swapped_count():
    # `(count, loss), g = ...` unpacked the wrong way round: microbatches were
    # weighed by their loss, silently.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    state = tx.init(PARAMS)
    with pytest.raises(
        TypeError, match=r"`value` has the integer dtype int32: .*count"
    ):
        tx.update(GRADS, state, PARAMS, count=jnp.float32(0.7), value=jnp.int32(8))
    _, state = tx.update(GRADS, state, PARAMS, count=3, value=2)  # a Python int


@pytest.mark.parametrize(
    "value",
    [1e39, pytest.param(-(2**200), id="-2**200"), np.float64(6e38)],
)
def test_a_finite_host_value_beyond_float32_is_a_value_error(value):
    # It became inf with only numpy's overflow warning: a window whose inner
    # optimizer reads the loss was dropped as non-finite.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=r"`value` is beyond float32's range"):
        tx.update(GRADS, state, PARAMS, count=3, value=value)
    # Infinite and NaN losses stay what they are (the window's loss says so).
    for loss in (np.inf, np.float64("nan"), np.float32(3e38)):
        _, after = tx.update(GRADS, state, PARAMS, count=3, value=loss)
        np.testing.assert_array_equal(after.acc_value, np.float32(loss))


def test_float0_gradients_and_non_array_params_are_named():
    # float0 (jax.grad of an integer param, allow_int=True) was explained as an
    # integer gradient; a string params leaf was read as a dtype name ("int8":
    # a float32 accumulator) or failed without its path ("relu").
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    params = {"w": jnp.zeros(2), "step": jnp.int32(0)}
    grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2), allow_int=True)(params)
    with pytest.raises(TypeError, match=r"\['step'\] is float0 .* float zeros"):
        tx.update(grads, tx.init(params), params, count=3)
    # As params: jax's "dtype=dtype([('float0', 'V')]) is not a valid dtype
    # for JAX type promotion", naming neither `params` nor the leaf.
    with pytest.raises(TypeError, match=r"got a float0 array .* at params\['step'\]"):
        tx.init(grads)
    for leaf in ("relu", "int8"):
        with pytest.raises(TypeError, match=rf"got str '{leaf}' at params\['act'\]"):
            tx.init({"w": jnp.zeros(2), "act": leaf})
    # A function leaf (an equinox module's activation) is named by its type,
    # not by an address cut in half.
    for act, shown in [(jax.nn.relu, "custom_jvp object>"), (jax.nn.gelu, "gelu>")]:
        with pytest.raises(TypeError) as err:
            tx.init({"w": jnp.zeros(2), "act": act})
        assert f"{shown} at params['act']" in str(err.value)
        assert " at 0x" not in str(err.value)
    # Python numbers are params like arrays, complex ones too.
    state = tx.init({"c": 1 + 2j, "f": 1.0})
    assert state.acc_grads["c"].dtype == jnp.complex64


def test_should_skip_update_fn_must_be_callable():
    with pytest.raises(TypeError, match="`should_skip_update_fn` must be None or a"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=3)


def test_python_number_params_are_params():
    # As for optax's own optimizers: a Python float is a float32 scalar param.
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 2)
    state = tx.init({"w": 1.0})
    assert state.acc_grads["w"].dtype == jnp.float32
    _, state = tx.update({"w": jnp.float32(2.0)}, state, {"w": 1.0}, count=3)
    assert float(state.acc_grads["w"]) == 2.0


def test_missing_count_says_how_to_pass_it(tx):
    with pytest.raises(TypeError, match=r"count=n"):
        tx.update(GRADS, tx.init(PARAMS), PARAMS)
    with pytest.raises(TypeError, match=r"token count as a keyword: .*count=n"):
        tx.update(GRADS, tx.init(PARAMS), PARAMS, 3)
    with pytest.raises(
        TypeError,
        match=r"apply_gradients takes the token count as a keyword: "
        r"tx\.apply_gradients\(grads, state, params, count=n\)",
    ):
        tx.apply_gradients(GRADS, tx.init(PARAMS), PARAMS, 3)
    # `help(tx.update)` shows the count.
    assert "count" in inspect.signature(tx.update).parameters
    assert "count: the number of real tokens" in (tx.update.__doc__ or "")
    # And on the class (it showed the tuple field's "Alias for field number 1").
    assert "count: the number of real tokens" in (
        mm.MaskedMultiSteps.update.__doc__ or ""
    )
    assert "initial state" in (mm.MaskedMultiSteps.init.__doc__ or "")
    with pytest.raises(TypeError, match=r"(?s)count=n.*masked_multistep.TrainState"):
        jax.jit(tx.update)(GRADS, tx.init(PARAMS), PARAMS)
    # A count under a name too far from `count` to be taken for a misspelling
    # (`cnt`: NNX's `optimizer.update(model, grads, cnt=n)`) is named.
    with pytest.raises(TypeError, match=r"(?s)count=n.*no `count`, .* 'cnt'\.$"):
        tx.update(GRADS, tx.init(PARAMS), PARAMS, cnt=3, value=1.0)


@pytest.mark.parametrize(
    "count,error,match",
    [
        (jnp.ones(2, jnp.int32), ValueError, r"scalar .*, got shape \(2,\)"),
        (np.ones((1, 1), np.int32), ValueError, r"scalar .*, got shape \(1, 1\)"),
        (jnp.array(True), TypeError, r"integer or floating scalar, got dtype bool"),
        (True, TypeError, r"number of tokens, got a bool \(True\)"),
        (np.bool_(True), TypeError, r"bool"),
        ("12", TypeError, "real scalar, got '12' of type str"),
        (
            jnp.array(1 + 2j),
            TypeError,
            r"integer or floating scalar, got dtype complex64",
        ),
    ],
    ids=repr,
)
def test_bad_count_types_fail_at_trace_time(tx, count, error, match):
    state = tx.init(PARAMS)
    with pytest.raises(error, match=match):
        tx.update(GRADS, state, PARAMS, count=count)
    if hasattr(count, "dtype"):
        with pytest.raises(error, match=match):
            jax.jit(tx.update)(GRADS, state, PARAMS, count=count)


def test_fractional_count_with_an_integer_count_dtype_is_clear():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, count_dtype=jnp.int32)
    state = tx.init(PARAMS)
    with pytest.raises(TypeError, match="has dtype float32, but this MaskedMultiSteps"):
        jax.jit(tx.update)(GRADS, state, PARAMS, count=jnp.float32(3.0))
    with pytest.raises(ValueError, match=r"fractional \(2.5\)"):
        tx.update(GRADS, state, PARAMS, count=2.5)


@pytest.mark.parametrize(
    "count,count_dtype,match",
    [
        (-1, jnp.float32, "non-negative, got -1"),
        (jnp.int32(-5), jnp.float32, "non-negative, got -5"),
        (np.int8(-5), jnp.float32, "non-negative, got -5"),
        (float("nan"), jnp.float32, "finite non-negative number, got nan"),
        (float("inf"), jnp.float32, "finite non-negative number, got inf"),
        (np.float64(np.inf), jnp.float32, "finite non-negative number, got inf"),
        (2**31, jnp.int32, r"at most 2147483647 for count_dtype int32"),
        (np.int64(2**32 + 5), jnp.int32, r"at most 2147483647.*got 4294967301"),
        (np.uint64(2**63), jnp.int32, r"at most 2147483647"),
        (10**40, jnp.float32, "too large for count_dtype float32"),
    ],
    ids=repr,
)
def test_concrete_bad_count_values_raise(count, count_dtype, match):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, count_dtype=count_dtype)
    with pytest.raises(ValueError, match=match):
        tx.update(GRADS, tx.init(PARAMS), PARAMS, count=count)


@pytest.mark.parametrize("count", [2 * 10**308, 10**400], ids=["2e308", "1e400"])
def test_a_python_int_beyond_float64_is_a_value_error(count):
    # float64's range ends near 1.8e308: such an int was an OverflowError from
    # the conversion (a smaller bound was checked), not an error naming `count`.
    with jax.enable_x64(True):
        tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, count_dtype=jnp.float64)
        params = {"w": jnp.zeros(2)}
        with pytest.raises(
            ValueError, match=r"`count` is too large for count_dtype float64, got \d"
        ):
            tx.update(params, tx.init(params), params, count=count)
    grad_fn = mm.microbatched_value_and_grad(lambda w, mb: (jnp.mean(w * mb), count), 1)
    with pytest.raises(
        ValueError,
        match="count returned by `loss_fn` is too large for float32, the weights'",
    ):
        grad_fn(jnp.float32(1.0), jnp.ones((2, 3)))


@pytest.mark.parametrize(
    "count_dtype,bad",
    [
        (jnp.int32, jnp.int32(-3)),
        (jnp.float32, jnp.float32(-0.5)),
        (jnp.float32, jnp.float32(jnp.nan)),
        (jnp.float32, jnp.float32(jnp.inf)),
    ],
    ids=repr,
)
def test_bad_count_under_jit_is_a_counted_skip(count_dtype, bad):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, count_dtype=count_dtype)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    _, state = update(GRADS, state, PARAMS, count=jnp.asarray(2, count_dtype))
    updates, after = update(
        jax.tree.map(lambda g: g * 100, GRADS), state, PARAMS, count=bad
    )
    assert int(after.num_invalid_counts) == 1
    for field in ("acc_grads", "acc_count", "mini_step", "gradient_step"):
        jax.tree.map(
            np.testing.assert_array_equal, getattr(after, field), getattr(state, field)
        )
    assert not bool(tx.has_updated(after))
    for u in jax.tree.leaves(updates):
        np.testing.assert_array_equal(u, 0)


def test_window_total_overflow_is_a_counted_skip():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, count_dtype=jnp.int32)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    _, state = update(GRADS, state, PARAMS, count=jnp.int32(2**31 - 10))
    # The window is full: it closes on the microbatch it cannot take (skipped
    # and counted), with the tokens it holds.
    updates, after = update(GRADS, state, PARAMS, count=jnp.int32(11))
    assert int(after.num_invalid_counts) == 1
    assert bool(tx.has_updated(after)) and int(after.gradient_step) == 1
    assert int(after.acc_count) == 0 and int(after.mini_step) == 0
    jax.tree.map(lambda u, g: np.testing.assert_allclose(u, -g), updates, GRADS)
    _, after = update(GRADS, after, PARAMS, count=jnp.int32(9))
    assert int(after.acc_count) == 9 and int(after.mini_step) == 1


def test_a_token_budget_out_of_an_int32_totals_reach_does_not_stall():
    # Two microbatches bring the window to 2**31 - 2, one short of the budget;
    # a third cannot fit int32. The full window closes on it instead of
    # skipping every microbatch from then on.
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), tokens_per_window=2**31 - 1, count_dtype=jnp.int32
    )
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    steps = []
    for i in range(6):
        grads = {k: jnp.full_like(g, float(i)) for k, g in GRADS.items()}
        updates, state = update(grads, state, PARAMS, count=jnp.int32(2**30 - 1))
        steps.append(int(state.gradient_step))
        if bool(tx.has_updated(state)):  # the mean of the two that fit
            for u in jax.tree.leaves(updates):
                np.testing.assert_allclose(u, -(i - 1.5))
    assert steps == [0, 0, 1, 1, 1, 2]
    assert int(state.num_invalid_counts) == 2


def test_mismatched_trees_are_clear(tx):
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match="tree structure does not match"):
        tx.update({"w": GRADS["w"]}, state, PARAMS, count=1)
    with pytest.raises(ValueError, match=r"\['b'\] has shape \(4,\).*expects \(3,\)"):
        tx.update({"w": GRADS["w"], "b": jnp.ones(4)}, state, PARAMS, count=1)
    # `jax.grad(..., has_aux=True)`'s pair as the gradients.
    with pytest.raises(
        ValueError, match=r"Its \[0\] has the state's structure: pass that alone"
    ):
        tx.update((GRADS, jnp.int32(3)), state, PARAMS, count=1)


def test_a_batch_of_states_outside_vmap_says_so(tx):
    # An ensemble's states (`jax.vmap(tx.init)`) stepped without vmap: it
    # blamed `total`, a name the caller never passed.
    members = jax.tree.map(lambda x: jnp.stack([x] * 4), PARAMS)
    states = jax.vmap(tx.init)(members)
    for step in (tx.update, jax.jit(tx.apply_gradients)):
        with pytest.raises(
            ValueError,
            match=r"`state` is a batch of states \(its acc_count has shape \(4,\).*"
            r"under `jax.vmap`",
        ):
            step(members, states, members, count=1)


def test_an_abstract_count_is_named(tx):
    with pytest.raises(
        TypeError, match=r"`count` must be a number of tokens, got a jax"
    ):
        tx.update(GRADS, tx.init(PARAMS), PARAMS, count=jax.ShapeDtypeStruct((), int))


@pytest.mark.parametrize(
    "should_skip, error, got",
    [
        (jnp.zeros(2, bool), ValueError, r"dtype bool and shape \(2,\)"),
        (jnp.int32(0), TypeError, r"dtype int32 and shape \(\)"),
        (jnp.zeros(2), TypeError, r"dtype float32 and shape \(2,\)"),
        (None, TypeError, "NoneType None$"),
        ("yes", TypeError, "str 'yes'$"),
    ],
    ids=["shape", "int", "float vector", "None", "str"],
)
def test_bad_skip_function_output_is_clear(should_skip, error, got):
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), 2, should_skip_update_fn=lambda u, s, p: (should_skip, ())
    )
    with pytest.raises(
        error, match=f"`should_skip_update_fn` must return a boolean scalar, got {got}"
    ):
        tx.update(GRADS, tx.init(PARAMS), PARAMS, count=1)


def test_the_wrapper_itself_goes_into_optax_chain_and_gets_count():
    # The wrapper object (not only `.gradient_transformation()`) is a gradient
    # transformation: the chain forwards `count=` to it.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    chained = optax.chain(optax.scale(2.0), tx)
    state = chained.init(PARAMS)
    updates = None
    for g, n in [(1.0, 1), (4.0, 3)]:
        grads = jax.tree.map(lambda p, g=g: jnp.full_like(p, g), PARAMS)
        updates, state = chained.update(grads, state, PARAMS, count=jnp.int32(n))
    assert updates is not None
    # scale(2) then the token-weighted mean: 2 * (1·1 + 3·4) / 4 = 6.5.
    np.testing.assert_allclose(updates["w"], -6.5)
    with pytest.raises(TypeError, match=r"count=n"):
        chained.update(GRADS, state, PARAMS)


def test_flax_stock_train_state_points_to_mm_train_state():
    from flax.training import train_state

    state = train_state.TrainState.create(
        apply_fn=None, params=PARAMS, tx=mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    )
    with pytest.raises(TypeError, match=r"masked_multistep\.TrainState"):
        state.apply_gradients(grads=GRADS)


@pytest.mark.parametrize("method", ["update", "apply_gradients"])
def test_a_state_of_fields_by_name_or_swapped_with_params_says_so(tx, method):
    # A checkpoint restored without a target comes back as a dict of the
    # state's fields; the error says to restore against `tx.init(params)`.
    step = getattr(tx, method)
    state = tx.init(PARAMS)
    with pytest.raises(TypeError, match=r"got dict: .*without a template.*tx\.init"):
        step(GRADS, state._asdict(), PARAMS, count=1)
    # The state and the params passed in each other's place.
    with pytest.raises(TypeError, match=r"got dict: `params` is .* swapped"):
        step(GRADS, PARAMS, state, count=1)
    # The state and the grads; the state as the params too (a long structure
    # dump named neither).
    with pytest.raises(TypeError, match=r"got dict: `grads` is .* swapped"):
        step(state, GRADS, PARAMS, count=1)
    with pytest.raises(
        TypeError,
        match=r"`params` must be the model's parameters, "
        r"got MaskedMultiStepsState",
    ):
        step(GRADS, state, state, count=1)
    # Anything else is named, without a guess.
    with pytest.raises(TypeError, match=r"returned, got dict$"):
        step(GRADS, {"w": 1}, PARAMS, count=1)


def test_a_state_from_another_optimizer_or_settings_is_refused():
    params, grads = {"w": jnp.zeros(2)}, {"w": jnp.ones(2)}
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 2)
    with_stats = mm.MaskedMultiSteps(optax.adam(0.1), 2, window_stats=True)
    # A budget that follows the tokens seen keeps them in its state.
    by_tokens = mm.MaskedMultiSteps(optax.adam(0.1), tokens_per_window=lambda n: 8.0)
    for update in (tx.update, jax.jit(tx.update)):
        old = optax.MultiSteps(optax.adam(0.1), 2).init(params)
        with pytest.raises(TypeError, match="optax.MultiStepsState: convert it once"):
            update(grads, old, params, count=3)
        with pytest.raises(
            TypeError, match="must be the MaskedMultiStepsState .*tuple"
        ):
            update(grads, optax.adam(0.1).init(params), params, count=3)
        # The statistics (or a window rule's state) are not silently dropped.
        for other in (with_stats, by_tokens):
            with pytest.raises(
                ValueError, match="built by a MaskedMultiSteps with other"
            ):
                update(grads, other.init(params), params, count=3)
    with pytest.raises(
        ValueError,
        match=r"built by a MaskedMultiSteps with other.*to carry a running state "
        r"over to new settings, `mm.from_other_settings\(state, tx.init\(params\)\)`",
    ):
        with_stats.update(grads, tx.init(params), params, count=3)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("window_stats", [False, True])
def test_a_state_cast_whole_is_refused_naming_a_counter(jit, window_stats):
    # Under jit, jax's "cond branches must have equal output types" at an
    # internal path; outside it, accepted, and the counters came back of
    # mixed dtypes (gradient_step float32 for good, mini_step int32).
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 3, window_stats=window_stats)
    params, grads = {"w": jnp.ones(3)}, {"w": jnp.ones(3)}
    update = jax.jit(tx.update) if jit else tx.update
    cast = jax.tree.map(lambda x: x.astype(jnp.float32), tx.init(params))
    with pytest.raises(
        ValueError,
        match=r"^`state.mini_step` is float32, but this wrapper's `init` builds "
        r"int32 .* casts its counters too",
    ):
        update(grads, cast, params, count=jnp.int32(1))
    # The statistics' counters are checked too.
    if window_stats:
        state = tx.init(params)
        tallies = state.stats.tallies.astype(jnp.float32)
        state = state._replace(stats=state.stats._replace(tallies=tallies))
        with pytest.raises(ValueError, match=r"^`state.stats.tallies` is float32"):
            update(grads, state, params, count=jnp.int32(1))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_state_with_other_dtypes_or_skip_function_is_refused(jit):
    """A restore against another wrapper's state keeps that state's dtypes
    (flax.serialization.from_bytes does): its tokens would be counted, or its
    mean kept, in the other precision. A skip function's state is checked too."""
    params, grads = {"w": jnp.zeros(2)}, {"w": jnp.ones(2)}

    def refused(new, old, match):
        update = jax.jit(new.update) if jit else new.update
        with pytest.raises(ValueError, match=match):
            update(grads, old.init(params), params, count=jnp.int32(3))

    wrapper = functools.partial(mm.MaskedMultiSteps, optax.sgd(1.0), 2)
    bf16, ints = wrapper(accumulator_dtype=jnp.bfloat16), wrapper(count_dtype=jnp.int32)
    refused(wrapper(), bf16, r"accumulates \['w'\] in bfloat16.*at least float32")
    refused(bf16, wrapper(), r"accumulates \['w'\] in float32.*is bfloat16")
    refused(
        ints,
        wrapper(),
        "counts tokens in float32.*count_dtype is int32.*mm.from_other_settings",
    )
    refused(wrapper(), ints, "counts tokens in int32.*count_dtype is float32")
    skips = wrapper(should_skip_update_fn=optax.skip_not_finite)
    refused(
        skips,
        wrapper(),
        "`state.skip_state` is not what `should_skip_update_fn`.* than this one, "
        r"MaskedMultiSteps\(.*should_skip_update_fn=skip_not_finite\)",
    )
    refused(wrapper(), skips, "`state.skip_state` is not what `should_skip_update_fn`")
    # The message shows this wrapper's skip function, by name (a partial's too).
    large = functools.partial(optax.skip_large_updates, max_squared_norm=1.0)
    assert "should_skip_update_fn" not in repr(wrapper())
    assert repr(wrapper(should_skip_update_fn=large)).endswith(
        "should_skip_update_fn=skip_large_updates)"
    )
    # Complex leaves keep a complex accumulator, whatever accumulator_dtype is.
    z = {"w": jnp.zeros(2, jnp.complex64)}
    _, state = bf16.update(z, bf16.init(z), z, count=jnp.int32(3))
    assert state.acc_grads["w"].dtype == jnp.complex64


def test_a_missing_count_names_the_nnx_call(tx):
    with pytest.raises(TypeError, match=r"optimizer\.update\(model, grads, count=n\)"):
        tx.update(GRADS, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize(
    "inner",
    [
        lambda: optax.MultiSteps(optax.sgd(1.0), 2),
        lambda: mm.MaskedMultiSteps(optax.sgd(1.0), 2),
        lambda: optax.chain(optax.identity(), optax.MultiSteps(optax.sgd(1.0), 2)),
        lambda: optax.chain(optax.scale(1.0), mm.MaskedMultiSteps(optax.sgd(1.0), 2)),
        # optax.apply_every sums k windows with equal weight, and applies them.
        lambda: optax.chain(optax.sgd(1.0), optax.apply_every(2)),
    ],
    ids=[
        "optax.MultiSteps",
        "MaskedMultiSteps",
        "chained",
        "chained mm",
        "apply_every",
    ],
)
def test_an_accumulator_inside_the_wrapper_is_refused(inner):
    # Nested, the outer wrapper would weigh the inner one's windows equally,
    # over k_outer * k_inner microbatches (silently, through a chain).
    # Switching by wrapping an existing optax.MultiSteps: the error names the
    # optimizer inside it.
    tx = mm.MaskedMultiSteps(inner(), 2)
    with pytest.raises(
        TypeError,
        match=r"`opt` .*holds an accumulator .*k_outer \* k_inner.*"
        r"MaskedMultiSteps\(old\.inner_opt, k\)",
    ):
        tx.init(PARAMS)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_inner_state_that_changes_structure_on_update_is_named(jit):
    # optax.monitor's state is {} after init and holds its measurements after
    # update: a state the wrapper cannot carry through a window unchanged.
    inner = optax.chain(
        optax.sgd(1.0), optax.monitor({"norm": lambda u: optax.tree.norm(u)})
    )
    tx = mm.MaskedMultiSteps(inner, 1)
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(
        ValueError,
        match=r"^The inner optimizer's state changes structure on `update` \(at "
        r"\[1\]\.measurements\['norm'\]\)",
    ):
        update(GRADS, tx.init(PARAMS), PARAMS, count=1)


def test_the_wrapper_survives_tree_map():
    # A wrapper held in a pytree (a config, an equinox module) is flattened
    # and rebuilt by jax; as a NamedTuple it would be rebuilt as
    # MaskedMultiSteps(init, update) and fail.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    assert jax.tree.map(lambda f: f, tx) is tx
    leaves, treedef = jax.tree.flatten({"tx": tx})
    assert leaves == [tx.init, tx.update]
    assert jax.tree.unflatten(treedef, leaves)["tx"] is tx
    # Other functions in its place make the plain (init, update) pair.
    blank = jax.tree.map(lambda f: None, tx, is_leaf=callable)
    assert type(blank) is optax.GradientTransformationExtraArgs
    assert blank == (None, None)


def test_a_traced_window_size_is_named():
    # optax.inject_hyperparams makes numeric arguments traced under jit; k
    # sizes the state machine and must stay a Python number (static_args).
    tx = optax.inject_hyperparams(lambda k: mm.MaskedMultiSteps(optax.sgd(0.1), k))(k=2)
    with pytest.raises(
        TypeError,
        match=r"`every_k_schedule` must be a concrete .*"
        r"static_args.*not a traced value",
    ):
        jax.jit(tx.init)(PARAMS)
    static = optax.inject_hyperparams(
        lambda k: mm.MaskedMultiSteps(optax.sgd(0.1), k), static_args=("k",)
    )(k=2)
    jax.jit(static.init)(PARAMS)


def test_apply_gradients_checks_the_params():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 1)
    state = tx.init({"w": jnp.zeros(3)})
    grads = {"w": jnp.ones(3)}
    # None was returned as the new params while the state recorded an update.
    with pytest.raises(TypeError, match="`params` must be the parameters.*got None"):
        tx.apply_gradients(grads, state, None, count=3)
    # jax's broadcasting error, naming no argument.
    with pytest.raises(
        ValueError, match=r"params at \['w'\] have shape \(4,\).*\(3,\)"
    ):
        tx.apply_gradients(grads, state, {"w": jnp.zeros(4)}, count=3)
    with pytest.raises(ValueError, match="params' tree structure does not match"):
        tx.apply_gradients(grads, state, {"v": jnp.zeros(3)}, count=3)


def test_a_float64_accumulator_without_x64_is_refused_when_built():
    # It was accepted, init built float32 accumulators, and every update then
    # refused that state as another wrapper's.
    for dtype in (float, jnp.float64, "float64"):
        with pytest.raises(ValueError, match="`accumulator_dtype=float64` needs"):
            mm.MaskedMultiSteps(optax.sgd(1.0), 2, accumulator_dtype=dtype)
    # A dtype object: numpy says np.dtype("float64") == float, and the hint
    # for Python's `float` then crashed on the missing `__name__`.
    for name, dtype in (
        ("accumulator_dtype", "float64"),
        ("count_dtype", "float64"),
        ("count_dtype", "int64"),
    ):
        with pytest.raises(ValueError, match=rf"^`{name}={dtype}` needs ") as err:
            mm.MaskedMultiSteps(optax.sgd(1.0), 2, **{name: np.dtype(dtype)})
        assert "is float64)" not in str(err.value)  # not Python's `float`


def test_a_longdouble_accumulator_dtype_is_refused_when_built():
    # Accepted, then `init` failed in jax's zeros_like, naming no argument.
    with pytest.raises(ValueError, match=r"`accumulator_dtype` must be .* 16 to 64"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, accumulator_dtype=np.longdouble)


def test_non_numeric_arguments_are_named():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 1)
    state = tx.init({"w": jnp.zeros(3)})
    grads = {"w": jnp.ones(3)}
    for value in ("abc", {"a": 1.0}):
        with pytest.raises(TypeError, match="`value` must be a real scalar.*got"):
            tx.update(grads, state, None, count=3, value=value)
    with pytest.raises(TypeError, match="`mask` must be an array, got None"):
        mm.masked_mean(jnp.ones(3), None)
    with pytest.raises(TypeError, match="`values` must be an array, got 'x'"):
        mm.masked_mean("x", jnp.ones(3, bool))
    # An int beyond any float: an OverflowError that named nothing.
    with pytest.raises(
        ValueError, match="`budget` must be .* an integer of 401 digits"
    ):
        mm.token_budget(10**400)
    with pytest.raises(ValueError, match="`tokens_per_window` must be finite"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, tokens_per_window=10**400)


def test_has_updated_on_a_nested_state_points_to_mm_has_updated():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 1)
    chain = optax.chain(optax.scale(1.0), tx)
    state = chain.init(jnp.zeros(3))
    with pytest.raises(
        TypeError, match=r"got tuple: .* use mm.has_updated\(opt_state\)"
    ):
        tx.has_updated(state)
    assert not mm.has_updated(state)


def test_weighted_mean_across_outside_shard_map_says_where_it_runs():
    with pytest.raises(
        NameError, match="unbound axis name: data.*inside `jax.shard_map`"
    ):
        mm.weighted_mean_across(jnp.ones(2), 3, "data")


@pytest.mark.parametrize("axis_name", [0, ("i", 1)])
def test_weighted_mean_across_names_an_integer_axis(axis_name):
    # jax's collectives read it as a positional axis: "axis 0 is out of bounds
    # for array of dimension 0".
    mean = lambda g, c: mm.weighted_mean_across(g, c, axis_name)  # noqa: E731
    with pytest.raises(TypeError, match=r"`axis_name` must name a mesh .*integer"):
        jax.vmap(mean, axis_name="i")(jnp.ones((2, 2)), jnp.ones(2))


@pytest.mark.parametrize("check_vma", [True, False])
def test_weighted_mean_across_on_a_misspelt_axis_names_the_bound_ones(check_vma):
    mesh = jax.make_mesh(
        (2,), ("data",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
    )
    mean = jax.shard_map(
        lambda x: mm.weighted_mean_across(x, jnp.sum(x), "batch")[0],
        mesh=mesh,
        in_specs=jax.P("data"),
        out_specs=jax.P(),
        check_vma=check_vma,
    )
    with pytest.raises(
        NameError,
        match=r"`axis_name` 'batch' is not bound here: the `shard_map` this runs "
        r"in maps over \('data',\)",
    ):
        mean(jnp.arange(4.0))


def test_find_state_on_an_optax_multisteps_state_points_to_the_conversion():
    state = optax.MultiSteps(optax.sgd(1.0), 2).init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"optax.MultiStepsState; convert it with"):
        mm.find_state(state)


def test_an_array_number_of_another_shape_is_a_value_error():
    with pytest.raises(ValueError, match=r"`tokens_per_step` must be a scalar, got "):
        mm.tokens_schedule(optax.constant_schedule(1.0), np.array([1024]))


def test_a_policy_sees_a_full_windows_own_microbatches_when_it_closes():
    # The microbatch that does not fit closes the window but is not one of its
    # microbatches: `update` sees the window as it closes, without it.
    policy = mm.WindowPolicy(
        init=lambda: jnp.int32(-1),
        closes=lambda state, scalars: scalars.microbatches >= 4,
        update=lambda state, scalars, closed: jnp.where(
            closed, scalars.microbatches, state
        ),
    )
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), tokens_per_window=policy, count_dtype=jnp.int32
    )
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    for _ in range(2):  # the second count does not fit the int32 total
        _, state = update(GRADS, state, PARAMS, count=jnp.int32(2**30))
    assert bool(tx.has_updated(state)) and int(state.num_invalid_counts) == 1
    assert int(state.policy_state) == 1


def test_a_complex_accumulator_dtype_is_a_value_error():
    # The accumulator holds real gradients' running mean: a complex one is a
    # dtype setting that cannot serve, refused when the wrapper is built.
    with pytest.raises(
        ValueError,
        match="`accumulator_dtype` must be a floating dtype or None, got complex64",
    ):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, accumulator_dtype=jnp.complex64)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_complex_gradient_for_a_real_parameter_is_named_as_the_gradient(jit):
    # The error names the gradient and the accumulator it cannot go into, not
    # `value` (the keyword of the microbatch's loss).
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    p = {"w": jnp.zeros(2)}
    grads = {"w": jnp.ones(2, jnp.complex64)}
    match = (
        r"^The gradient at \['w'\] is complex \(complex64\), but the state's "
        r"accumulator is float32"
    )
    for step in (tx.update, tx.apply_gradients):
        run = jax.jit(step) if jit else step
        with pytest.raises(TypeError, match=match):
            run(grads, tx.init(p), p, count=1)


@pytest.mark.parametrize(
    "param, grad", [((3,), ()), ((1, 3), (3,))], ids=["scalar", "leading-1"]
)
def test_a_shape_one_axis_short_on_a_plain_wrapper_is_not_blamed_on_devices(
    param, grad
):
    # Without a deferred reduction the state keeps one running mean for all
    # devices: a gradient one axis short is only the wrong shape.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    p = {"w": jnp.zeros(param)}
    with pytest.raises(ValueError) as err:
        tx.update({"w": jnp.ones(grad)}, tx.init(p), p, count=1)
    assert str(err.value) == (
        f"The gradient at ['w'] has shape {grad}, but the state expects {param}"
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_update_checks_the_params_it_is_given(jit):
    # `update` passed the params to the inner optimizer unchecked: a shape that
    # broadcast gave updates computed against the wrong params, silently.
    tx = mm.MaskedMultiSteps(optax.adamw(0.1), 1)
    state = tx.init({"w": jnp.zeros(3)})
    grads = {"w": jnp.ones(3)}
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(ValueError, match=r"params at \['w'\] have shape \(1,\)"):
        update(grads, state, {"w": jnp.zeros(1)}, count=3)
    with pytest.raises(ValueError, match="params' tree structure does not match"):
        update(grads, state, {"v": jnp.zeros(3)}, count=3)
    with pytest.raises(TypeError, match=r"params at \['w'\] must be an array"):
        tx.update(grads, state, {"w": "x"}, count=3)
    # None stays the inner optimizer's business (sgd, adam read no params).
    sgd = mm.MaskedMultiSteps(optax.sgd(1.0), 1)
    updates, _ = sgd.update(grads, sgd.init({"w": jnp.zeros(3)}), None, count=3)
    np.testing.assert_array_equal(updates["w"], -np.ones(3))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("init_first", [False, True])
def test_a_state_of_another_inner_optimizer_is_named(jit, init_first):
    # It failed inside optax: "'EmptyState' object has no attribute 'mu'".
    # (Whether or not the wrapper's own `init` ran on such params first, and
    # recorded its state's structure.)
    params, grads = {"w": jnp.zeros(2)}, {"w": jnp.ones(2)}
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 2)
    if init_first:
        tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    cases = [
        (
            optax.sgd(0.1),
            r"it is \(EmptyState, EmptyState\), .* builds "
            r"\(ScaleByAdamState, EmptyState\)",
        ),
        (
            optax.chain(optax.clip(1.0), optax.adam(0.1)),
            r"it is \(EmptyState, \(ScaleByAdamState, EmptyState\)\)",
        ),
    ]
    for other, match in cases:
        state = mm.MaskedMultiSteps(other, 2).init(params)
        with pytest.raises(
            ValueError, match="`state.inner_opt_state` was not built.*" + match
        ):
            update(grads, state, params, count=3)
    # One whose update ignores the state's surplus took it silently: plain sgd
    # given momentum sgd's state ran without its momentum, and returned a
    # state that no longer matched its own `init`.
    sgd = mm.MaskedMultiSteps(optax.sgd(0.1), 2)
    if init_first:
        sgd.init(params)
    momentum = mm.MaskedMultiSteps(optax.sgd(0.5, momentum=0.9), 2).init(params)
    with pytest.raises(
        ValueError,
        match=r"`state.inner_opt_state` was not built.*it is \(TraceState, "
        r"EmptyState\), .* builds \(EmptyState, EmptyState\)",
    ):
        (jax.jit(sgd.update) if jit else sgd.update)(grads, momentum, params, count=3)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("init_first", [False, True])
@pytest.mark.parametrize("with_params", [True, False])
def test_an_inner_state_built_from_the_params_dtypes_is_its_own(
    jit, init_first, with_params
):
    # An inner optimizer whose state's structure depends on the params' dtypes
    # (here: adam on the bfloat16 leaves only) was checked against the state
    # `init` builds for the window's mean, whose accumulators are float32:
    # its own state was refused as another optimizer's. (Without params, the
    # gradients, in the params' dtypes, stand in for them.)
    params = {"w": jnp.zeros(2), "b": jnp.zeros(2, jnp.bfloat16)}
    grads = jax.tree.map(jnp.ones_like, params)
    by_dtype = lambda p: jax.tree.map(lambda x: x.dtype == jnp.bfloat16, p)
    inner = optax.masked(optax.adam(0.1), by_dtype)
    state = mm.MaskedMultiSteps(inner, 1).init(params)
    tx = mm.MaskedMultiSteps(inner, 1)
    if init_first:
        tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    updates, state = update(grads, state, params if with_params else None, count=3)
    assert int(state.gradient_step) == 1
    want, _ = inner.update(grads, inner.init(params), params)
    jax.tree.map(np.testing.assert_allclose, updates, want)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("init_first", [False, True])
def test_an_inner_state_built_from_the_params_dtypes_is_its_own_when_deferred(
    jit, init_first
):
    # The same under a deferred reduction without params: the gradients have
    # a device axis, so they could not stand in for the params, and the
    # window's float32 mean did (and refused the state); now the mean's
    # shapes do, in the gradients' dtypes.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params = {"w": jnp.zeros(2), "b": jnp.zeros(2, jnp.bfloat16)}
    grads = jax.tree.map(lambda p: jnp.ones((8, *p.shape), p.dtype), params)
    by_dtype = lambda p: jax.tree.map(lambda x: x.dtype == jnp.bfloat16, p)
    inner = optax.masked(optax.adam(0.1), by_dtype)
    tx = mm.MaskedMultiSteps(inner, 1, reduction=mm.deferred(mesh, "data"))
    state = mm.MaskedMultiSteps(inner, 1, reduction=mm.deferred(mesh, "data")).init(
        params
    )
    if init_first:
        tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    updates, state = update(grads, state, None, count=jnp.full(8, 3.0))
    assert int(state.gradient_step) == 1
    mean = jax.tree.map(lambda g: g[0], grads)
    want, _ = inner.update(mean, inner.init(params), params)
    jax.tree.map(np.testing.assert_allclose, updates, want)
    # Another inner optimizer's state is still refused there.
    other = mm.MaskedMultiSteps(
        optax.adam(0.1), 1, reduction=mm.deferred(mesh, "data")
    ).init(params)
    with pytest.raises(ValueError, match="`state.inner_opt_state` was not built"):
        update(grads, other, None, count=jnp.full(8, 3.0))


def test_a_foreign_inner_state_is_refused_where_init_runs_on_the_mean_only():
    # Without params, the gradients' dtypes stand in first: an inner `init`
    # that cannot run on them (float32 only, here) gave no structure to
    # compare with, and another optimizer's state went through unchecked.
    def float32_only(params):
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
        return optax.sgd(0.1, momentum=0.9).init(params)

    momentum = optax.sgd(0.1, momentum=0.9)
    inner = optax.GradientTransformation(float32_only, momentum.update)
    params = {"w": jnp.zeros(2, jnp.bfloat16)}
    plain = mm.MaskedMultiSteps(optax.sgd(0.1), 1).init(params)
    tx = mm.MaskedMultiSteps(inner, 1)
    grads = {"w": jnp.ones(2, jnp.bfloat16)}
    with pytest.raises(ValueError, match="`state.inner_opt_state` was not built"):
        tx.update(grads, plain, None, count=3)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_an_8_bit_accumulator_dtype_is_refused_when_built(dtype):
    # Accepted, then every update failed in jax's type promotion.
    with pytest.raises(ValueError, match="`accumulator_dtype` must be .* 16 to 64"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, accumulator_dtype=getattr(jnp, dtype))


def test_a_gradient_leaf_that_is_no_array_is_named(tx):
    state = tx.init(PARAMS)
    grads = {**GRADS, "b": "x"}  # jax's "data type 'x' not understood"
    with pytest.raises(TypeError, match=r"gradient at \['b'\] must be an array"):
        tx.update(grads, state, PARAMS, count=3)


def test_noise_scale_estimates_of_other_shapes_is_a_value_error():
    with pytest.raises(
        ValueError,
        match=r"must broadcast together.*`sq_deviation` \(3,\), "
        r"`microbatches` \(2,\)",
    ):
        mm.noise_scale_estimates(jnp.ones(3), jnp.full(2, 4), 100.0, 1.0)
    var, _, _ = mm.noise_scale_estimates(jnp.ones(3), jnp.full(3, 4), 100.0, 1.0)
    assert var.shape == (3,)


def test_masked_mean_with_weights_summing_beyond_float32_is_refused():
    # It returned (nan, inf) with no error, while an inf weight is refused.
    for mask in (jnp.full((2, 3), 1e38), jnp.full((2, 1), 1e38)):
        with pytest.raises(ValueError, match="weights sum to 6e\\+38, beyond float32"):
            mm.masked_mean(jnp.ones((2, 3)), mask)
    mean, count = mm.masked_mean(jnp.ones((2, 3)), jnp.full((2, 3), 1e37))
    assert float(mean) == 1.0 and np.isfinite(count)


def test_a_schedule_that_takes_no_argument_is_named_when_built():
    # It failed at the first update with "<lambda>() takes 0 positional
    # arguments but 1 was given", naming no argument.
    with pytest.raises(
        TypeError,
        match=r"`every_k_schedule` must be a callable of one argument \(the "
        r"gradient step\), got <lambda>\(\)",
    ):
        mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=lambda: 2)
    with pytest.raises(
        TypeError, match=r"`tokens_per_window` must be a callable of one argument"
    ):
        mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=lambda: 8.0)
    with pytest.raises(TypeError, match=r"`budget` must be a callable of one"):
        mm.token_budget(lambda step, other: 8.0, by="gradient_step")
    with pytest.raises(TypeError, match=r"`max_microbatches` must be a callable of"):
        mm.token_budget(100.0, max_microbatches=lambda: 3)
    # Schedules of one argument, with defaults or bound by partial, pass.
    mm.MaskedMultiSteps(
        optax.sgd(1.0), every_k_schedule=optax.linear_schedule(1, 8, 10)
    )
    mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=lambda seen, extra=1: 1e3)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_mask_passed_as_the_count_says_to_sum_it(jit):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    params = {"w": jnp.zeros(2)}
    update = jax.jit(tx.update) if jit else tx.update
    mask = jnp.array([[True, False], [True, True]])
    for count in (mask, mask.sum(-1)):
        with pytest.raises(
            ValueError,
            match=r"^`count` must be a scalar \(a token count\), got shape \(2, ?2?\): "
            r"the microbatch's total, e.g. `mask.sum\(\)`",
        ):
            update(params, tx.init(params), params, count=count)


def test_linen_variables_for_params_are_named():
    # `TrainState.create(params=model.init(...))`, the variables dict, with
    # gradients of variables["params"] (or the other way round).
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    inner = {"kernel": jnp.zeros(2), "bias": jnp.zeros(())}
    variables = {"params": inner}
    with pytest.raises(
        ValueError, match=r"build it for variables\['params'\] \(TrainState.create"
    ):
        tx.update(inner, tx.init(variables), variables, count=1)
    with pytest.raises(ValueError, match=r"These are \{'params': \.\.\.\}.*pass the"):
        tx.update(variables, tx.init(inner), inner, count=1)


def test_states_and_trainstates_where_params_or_a_state_go_are_named():
    # Their leaves are arrays too: the errors that followed spoke of nested
    # accumulators, or of fields restored by name.
    from flax import nnx

    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    params, grads = {"w": jnp.zeros(2)}, {"w": jnp.ones(2)}
    train_state = mm.TrainState.create(apply_fn=None, params=params, tx=tx)
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for wrong, fix in [
        (train_state, r"got TrainState: pass its `.params`"),
        (tx.init(params), r"got MaskedMultiStepsState: pass the model's parameters"),
        (optimizer, r"got Optimizer: pass nnx.state\(model, nnx.Param\)"),
    ]:
        with pytest.raises(TypeError, match=r"^`params` must be the model's .*" + fix):
            tx.init(wrong)
    with pytest.raises(TypeError, match=r"got TrainState: pass its `.params`"):
        mm.TrainState.create(apply_fn=None, params=train_state, tx=tx)
    for wrong, hint in [
        (train_state, r"a TrainState holds it in `.opt_state`"),
        (optimizer, r"call `optimizer.update\(model, grads, count=n\)`"),
        (optax.chain(optax.clip(1.0), tx).init(params), r"among others"),
    ]:
        with pytest.raises(TypeError, match=r"^`state` must be .*" + hint):
            tx.update(grads, wrong, params, count=1)
    for read in (mm.window_stats, mm.has_updated):
        with pytest.raises(ValueError, match=r"that is the optimizer, not its state"):
            read(tx)


def test_conversions_of_a_state_that_needs_none_say_so():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, window_stats=True)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    with pytest.raises(TypeError, match=r"already this library's state, no conv"):
        mm.from_optax_multisteps(state, tx, params)
    with pytest.raises(TypeError, match=r"already a MaskedMultiStepsState of this"):
        mm.from_state_0_1(state, state)
    # A restore target where the restored state goes.
    with pytest.raises(TypeError, match=r"holds jax.ShapeDtypeStructs, a restore t"):
        mm.from_device_count(jax.eval_shape(lambda: state), state)
    # The tokens seen read from a state are taken as they are.
    seen = mm.window_stats(state).tokens_seen
    moved = mm.from_other_settings(state, state, tokens_seen=seen)
    assert int(mm.window_stats(moved).tokens_seen) == 0


def test_factories_and_callables_of_the_wrong_arity_are_named_when_built():
    import functools

    with pytest.raises(TypeError, match=r"got the function mm.token_budget: call it"):
        mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=mm.token_budget)
    with pytest.raises(TypeError, match=r"got the function mm.norm_test: call it"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 4, norm_test=mm.norm_test)
    with pytest.raises(
        TypeError,
        match=r"`should_skip_update_fn` must be a callable of three arguments .*"
        r"got skip_large_updates\(updates, gradient_step, params, max_squared_norm\)"
        r": bind the others",
    ):
        mm.MaskedMultiSteps(
            optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_large_updates
        )
    mm.MaskedMultiSteps(
        optax.sgd(1.0),
        2,
        should_skip_update_fn=functools.partial(
            optax.skip_large_updates, max_squared_norm=1.0
        ),
    )
    with pytest.raises(TypeError, match=r"`schedule` must be a callable of one arg"):
        mm.tokens_schedule(optax.linear_schedule, 100)
    with pytest.raises(TypeError, match=r"`loss_fn` must be a callable of two arg"):
        mm.microbatched_value_and_grad(lambda params: params, 2)
    # A schedule's factory passed as the schedule: it returns a function.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), optax.constant_schedule)
    params = {"w": jnp.zeros(2)}
    with pytest.raises(TypeError, match=r"returned a function .*factory"):
        tx.update(params, tx.init(params), params, count=1)


def test_host_numbers_that_are_no_weights_are_refused_by_the_running_mean():
    mean, value = jnp.zeros(2), jnp.ones(2)
    for total, count in [(1.0, -1.0), (1.0, float("nan")), (-1, 1), (1, np.inf)]:
        with pytest.raises(ValueError, match=r"must be a finite number >= 0"):
            mm.running_mean_update(mean, total, value, count)
    # Arrays stay total: the documented no-op.
    out, total = mm.running_mean_update(mean, jnp.float32(1), value, jnp.float32(-1))
    assert float(total) == 1.0 and not np.any(np.asarray(out))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "field, number",
    [("acc_count", 0.0), ("acc_count", 0), ("acc_value", 0.0), ("value_count", 0)]
    + [("mini_step", 0), ("updated", False), ("num_invalid_counts", 0)],
)
def test_a_state_scalar_reset_to_a_python_number_is_taken_in_its_dtype(
    field, number, jit
):
    # `acc_count=0.0` failed inside the running mean ("'float' object has no
    # attribute 'dtype'"); `acc_count=0` was called a count in int32, also
    # under jit (a weakly typed int32).
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    update = jax.jit(tx.update) if jit else tx.update
    want = update(GRADS, tx.init(PARAMS), PARAMS, count=3)
    got = update(GRADS, tx.init(PARAMS)._replace(**{field: number}), PARAMS, count=3)
    assert_bit_identical(got, want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
    # One its dtype cannot hold is named.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, count_dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"`state.acc_count` does not fit int32"):
        tx.update(GRADS, tx.init(PARAMS)._replace(acc_count=2**40), PARAMS, count=3)


def test_a_leaf_that_is_no_number_in_the_running_mean_is_named():
    # It was jax's "Value 'x' with dtype <U1 is not a valid JAX array type".
    with pytest.raises(TypeError, match=r"`value` at \['a'\] must be an array or"):
        mm.running_mean_update({"a": jnp.zeros(3)}, 0, {"a": "x"}, 2)
    with pytest.raises(TypeError, match=r"`mean` at <root> must be an array or a"):
        mm.running_mean_update(object(), 0, 1.0, 2)


def test_a_string_leaf_in_weighted_mean_across_is_named():
    with pytest.raises(
        TypeError, match=r"`tree` leaves must be floating arrays, got str"
    ):
        jax.vmap(lambda n: mm.weighted_mean_across({"a": "x"}, n, "d"), axis_name="d")(
            jnp.ones(2)
        )


def test_a_transformation_around_the_wrapper_that_drops_count_is_named():
    # optax.contrib.sam refuses `count=` and calls the wrapper without it: the
    # wrapper's error pointed to optax.chain and flax, not to this.
    tx = optax.contrib.sam(optax.sgd(0.1), mm.MaskedMultiSteps(optax.sgd(0.1), 2))
    params = jnp.ones(2)
    state = tx.init(params)
    with pytest.raises(TypeError, match=r"(?s)must forward `count=`.*put sam inside"):
        tx.update(jnp.ones(2), state, params)


@pytest.mark.parametrize(
    "build, what",
    [
        (lambda f: mm.MaskedMultiSteps(optax.sgd(1.0), f), "every_k_schedule"),
        (
            lambda f: mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=f),
            "tokens_per_window",
        ),
        (
            lambda f: mm.MaskedMultiSteps(
                optax.sgd(1.0),
                tokens_per_window=mm.token_budget(f, by="gradient_step"),
            ),
            "budget",
        ),
        (
            lambda f: mm.MaskedMultiSteps(
                optax.sgd(1.0), tokens_per_window=mm.token_budget(9, max_microbatches=f)
            ),
            "max_microbatches",
        ),
    ],
)
def test_a_schedule_branching_in_python_is_named_under_jit(build, what):
    # Eagerly the step is a concrete array and a Python `if` on it runs;
    # under jit jax's TracerBoolConversionError named neither the schedule
    # nor the way out.
    sizes = [2] * 10 + [4] * 10
    schedules = [
        lambda step: 2 if step < 10 else 4,  # a Python `if`
        lambda step: sizes[int(step) % 20],  # a Python int
        lambda step: np.where(step < 10, 2, 4),  # numpy
    ]
    if what != "tokens_per_window":  # (a schedule of the tokens seen: a float)
        schedules.append(lambda step: sizes[step])  # a list index
    for schedule in schedules:
        tx = build(schedule)
        params = {"w": jnp.zeros(3)}
        state = tx.init(params)
        tx.update({"w": jnp.ones(3)}, state, params, count=3)  # eager: runs
        with pytest.raises(
            TypeError,
            match=rf"^`{what}\(\w+\)` failed on a traced value: under jit.*"
            r"jnp.where",
        ):
            jax.jit(tx.update)({"w": jnp.ones(3)}, state, params, count=3)


@pytest.mark.parametrize("method", ["update", "apply_gradients"])
def test_an_abstract_state_is_refused_by_name(method):
    # It failed inside the running mean: "unsupported operand type(s) for +:
    # 'ShapeDtypeStruct' and 'ArrayImpl'".
    params = {"w": jnp.ones(3)}
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2)
    abstract = jax.eval_shape(tx.init, params)
    with pytest.raises(TypeError, match=r"`state` holds jax.ShapeDtypeStructs, an"):
        getattr(tx, method)({"w": jnp.ones(3)}, abstract, params, count=1)


def test_an_abstract_state_is_refused_by_the_readers_too():
    # `mm.has_updated` and `tx.has_updated` failed with "len() of unsized
    # object", `mm.window_stats` with jax's "ShapeDtypeStruct is not a valid
    # JAX type".
    params = {"w": jnp.ones(3)}
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True)
    abstract = jax.eval_shape(tx.init, params)
    for read in (mm.has_updated, mm.window_stats, mm.find_state):
        with pytest.raises(TypeError, match=r"`opt_state` holds jax.ShapeDtypeStructs"):
            read((abstract,))  # as inside a chain's state
    with pytest.raises(TypeError, match=r"`state` holds jax.ShapeDtypeStructs"):
        tx.has_updated(abstract)


@pytest.mark.parametrize("keyword", ["count", "value"])
def test_a_long_argument_is_cut_with_an_ellipsis_in_the_message(keyword):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    params = {"w": jnp.ones(2)}
    arguments = {"count": 1, keyword: "a" * 300}
    with pytest.raises(TypeError, match=rf"`{keyword}` .*'aaa+\.\.\. of type str$"):
        tx.update(params, tx.init(params), params, **arguments)


@pytest.mark.parametrize("wide", [np.longdouble, np.float64], ids=lambda t: t.__name__)
def test_a_nan_count_of_a_wide_float_is_refused_everywhere(wide):
    # np.longdouble's `.tolist()` is no Python float: a NaN passed every check
    # and closed the window on the next microbatch.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 3)
    with pytest.raises(ValueError, match=r"`count` must be a finite .* got nan"):
        tx.update(GRADS, tx.init(PARAMS), PARAMS, count=wide("nan"))
    _, state = tx.update(GRADS, tx.init(PARAMS), PARAMS, count=wide(3))
    assert float(state.acc_count) == 3.0
    if np.finfo(wide).max > np.finfo(np.float64).max:
        with pytest.raises(ValueError, match=r"too large for count_dtype .* 1e\+400"):
            tx.update(GRADS, tx.init(PARAMS), PARAMS, count=wide("1e400"))
        with pytest.raises(ValueError, match=r"must be non-negative, got -1e\+400"):
            tx.update(GRADS, tx.init(PARAMS), PARAMS, count=wide("-1e400"))

    def loss_fn(params, batch):
        return jnp.mean(batch["x"] * params["b"][0]), wide("nan")

    grad_fn = mm.microbatched_value_and_grad(loss_fn, 2)
    with pytest.raises(ValueError, match=r"count returned by `loss_fn` .* got nan"):
        grad_fn(PARAMS, {"x": jnp.ones((4, 3))})
    mesh = jax.make_mesh(
        (2,),
        ("data",),
        axis_types=(jax.sharding.AxisType.Explicit,),
        devices=jax.devices()[:2],
    )
    deferred = mm.MaskedMultiSteps(optax.sgd(1.0), 3, reduction=mm.deferred(mesh))
    stacked = jax.tree.map(lambda g: jnp.stack([g, g]), GRADS)
    with pytest.raises(ValueError, match=r"\[1\] must be a finite .* got nan"):
        deferred.update(
            stacked, deferred.init(PARAMS), PARAMS, count=np.array([1, np.nan], wide)
        )


def test_a_masked_array_is_refused_as_a_count_or_value(tx):
    hidden = np.ma.masked_array(7, mask=True)  # no value: its data, 7, hidden
    with pytest.raises(TypeError, match=r"`count` is a numpy masked array .* 1 entr"):
        tx.update(GRADS, tx.init(PARAMS), PARAMS, count=hidden)
    with pytest.raises(TypeError, match=r"`value` is a numpy masked array"):
        tx.update(GRADS, tx.init(PARAMS), PARAMS, count=1, value=hidden)


def test_a_fraction_or_longdouble_value_is_read_by_value(tx):
    import fractions

    state = tx.init(PARAMS)
    for value in (fractions.Fraction(1, 2), np.longdouble(0.5)):
        _, got = tx.update(GRADS, state, PARAMS, count=1, value=value)
        _, want = tx.update(GRADS, state, PARAMS, count=1, value=0.5)
        assert_bit_identical(got, want)


def test_a_figure_on_other_devices_than_the_state_is_named(tx):
    # Outside jit jax's error named an `add` inside the step, not the argument.
    first, other = jax.devices()[:2]
    params = jax.device_put(PARAMS, first)
    state = jax.device_put(tx.init(params), first)
    elsewhere = lambda x: jax.device_put(x, other)  # noqa: E731
    cases = {
        "count": dict(count=elsewhere(jnp.int32(3))),
        "value": dict(count=3, value=elsewhere(jnp.float32(1.0))),
        "close_window": dict(count=3, close_window=elsewhere(jnp.bool_(True))),
    }
    for name, kwargs in cases.items():
        with pytest.raises(ValueError, match=rf"`{name}` is on device {other.id}, "):
            tx.update(GRADS, state, params, **kwargs)
    grads = dict(GRADS, b=elsewhere(GRADS["b"]))
    with pytest.raises(ValueError, match=r"`grads\['b'\]` is on device"):
        tx.apply_gradients(grads, state, params, count=3)
    # A state whose token total is uncommitted but whose accumulator is
    # committed (updated with gradients committed elsewhere) is placed by it.
    loose = tx.init(PARAMS)
    _, loose = tx.update(jax.device_put(GRADS, other), loose, PARAMS, count=2)
    assert not loose.acc_count.committed
    with pytest.raises(ValueError, match=rf"`grads\['b'\]` is on device {first.id}"):
        tx.update(jax.device_put(GRADS, first), loose, PARAMS, count=2)
    # On the state's device, or uncommitted, they are taken.
    tx.update(GRADS, state, params, count=jax.device_put(jnp.int32(3), first))
    tx.update(GRADS, state, params, count=jnp.int32(3))
