"""mm.masked_mean: zero-safe, NaN-proof, count dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import masked_multistep as mm


def test_bool_mask_counts_tokens_and_ignores_masked_nan():
    values = jnp.array([[1.0, 2.0, jnp.nan], [4.0, jnp.inf, 6.0]])
    mask = jnp.array([[True, True, False], [True, False, False]])
    mean, count = mm.masked_mean(values, mask)
    assert count.dtype == jnp.int32 and count.shape == ()
    assert int(count) == 3
    np.testing.assert_allclose(mean, 7.0 / 3, rtol=1e-6)


def test_all_masked_gives_zero_not_nan_and_a_finite_gradient():
    values = jnp.array([jnp.nan, 1.0])
    mean, count = mm.masked_mean(values, jnp.zeros(2, bool))
    assert float(mean) == 0.0 and int(count) == 0
    grad = jax.grad(lambda v: mm.masked_mean(v * 2, jnp.zeros(2, bool))[0])(values)
    np.testing.assert_array_equal(grad, 0.0)


def test_gradient_of_masked_mean_is_the_token_mean():
    v = jnp.arange(4.0)
    mask = jnp.array([1, 0, 1, 1])
    grad = jax.grad(lambda v: mm.masked_mean(v, mask)[0])(v)
    np.testing.assert_allclose(grad, np.array([1, 0, 1, 1]) / 3)


def test_float_mask_holds_weights():
    mean, count = mm.masked_mean(jnp.array([1.0, 3.0]), jnp.array([0.25, 0.75]))
    assert count.dtype == jnp.float32
    np.testing.assert_allclose(count, 1.0)
    np.testing.assert_allclose(mean, 2.5)


def test_the_derivative_with_respect_to_a_zero_weight_is_the_smooth_ones():
    # A learned soft mask (a gated weight at exactly 0): d mean / d w_j is
    # (v_j - mean) / sum(w). Zeroing the entry under the weight made it
    # -mean / sum(w), here -1 instead of 0.
    values = jnp.array([1.0, 2.0, 3.0, jnp.nan])
    weights = jnp.array([1.0, 0.0, 1.0, 0.0])
    grad = jax.grad(lambda w: mm.masked_mean(values, w)[0])(weights)
    finite = values[:3]
    smooth = jax.grad(lambda w: jnp.sum(w * finite) / jnp.sum(w))(weights[:3])
    np.testing.assert_allclose(grad[:3], smooth)  # [-0.5, 0, 0.5]
    assert float(grad[1]) == 0.0
    # A masked-out NaN still takes no part (as a 0 would): no NaN derivative.
    assert bool(jnp.all(jnp.isfinite(grad)))
    assert float(mm.masked_mean(values, weights)[0]) == 2.0


def test_a_concrete_negative_weight_is_refused():
    # [-1, 1] summed to an empty microbatch: (0, 0), its tokens dropped.
    with pytest.raises(ValueError, match=r"`mask` holds negative weights .* -1.0"):
        mm.masked_mean(jnp.array([1.0, 2.0]), jnp.array([-1.0, 1.0]))
    with pytest.raises(ValueError, match="negative weights"):
        mm.masked_mean(np.ones(2), np.array([0.5, -0.5]))


def test_a_traced_negative_weight_makes_the_count_invalid():
    # Under jit [-1, 1, 1] summed to one token with mean -8 (taken as valid).
    values, mask = jnp.array([9.0, 1.0, 0.0]), jnp.array([-1.0, 1.0, 1.0])
    _, count = jax.jit(mm.masked_mean)(values, mask)
    assert np.isnan(count)
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    params = jnp.zeros(())
    state = tx.init(params)

    @jax.jit
    def step(params, state, mask):
        (loss, n), g = jax.value_and_grad(
            lambda w: mm.masked_mean(w + values, mask), has_aux=True
        )(params)
        return tx.apply_gradients(g, state, params, count=n, value=loss)

    params, state = step(params, state, mask)
    assert int(state.num_invalid_counts) == 1 and float(state.acc_count) == 0
    # Non-negative weights are untouched by the check.
    mean, count = jax.jit(mm.masked_mean)(values, jnp.array([0.0, 0.5, 1.5]))
    assert float(count) == 2.0 and float(mean) == 0.25


def test_complex_values_under_weights_have_a_real_count():
    # The count was complex64, which MaskedMultiSteps.update refuses.
    mean, count = mm.masked_mean(jnp.array([1 + 1j, 3 + 0j]), jnp.array([0.25, 0.75]))
    assert count.dtype == jnp.float32 and float(count) == 1.0
    np.testing.assert_allclose(mean, 2.5 + 0.25j)


def test_64_bit_integers_are_read_by_value_without_x64():
    # jnp.asarray wraps them to 32 bits: the mask entry 2**32 was unset (mean
    # 4.0 of 1 token), the values negative (-1.5e8).
    values = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    mean, count = mm.masked_mean(values, np.array([2**32, 0, 0, 1], np.int64))
    assert int(count) == 2 and float(mean) == 2.5
    big = np.array([3_000_000_000, 1_000_000_000], np.uint64)
    mean, count = mm.masked_mean(big, np.array([True, True]))
    assert float(mean) == 2e9 and int(count) == 2
    assert float(mm.masked_mean(3_000_000_000, True)[0]) == 3e9  # OverflowError
    with pytest.raises(TypeError, match=r"`values` must be an array, got 10+ of"):
        mm.masked_mean(10**30, True)
    with pytest.raises(TypeError, match="`values` has dtype int64 .* swapped"):
        mm.masked_mean(np.arange(2), np.array([0.5, 0.5]))
    # Lists of Python ints too (the entry 2**32 was refused as "not an array").
    mean, count = mm.masked_mean(values[:2], [2**32, 0])
    assert int(count) == 1 and float(mean) == 1.0
    # Lists (of traced values too) still go to jnp.asarray.
    step = jax.jit(lambda a, b: mm.masked_mean([a, b], [True, False]))
    assert float(step(1.0, 2.0)[0]) == 1.0


def test_mask_broadcasts_and_low_precision_is_promoted():
    values = jnp.ones((2, 3), jnp.bfloat16)
    mean, count = mm.masked_mean(values, jnp.array([[True, False, True]]))
    assert mean.dtype == jnp.float32 and int(count) == 4


def test_mask_that_does_not_broadcast_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"`mask` of shape \(2, 4\) does not broadcast"
    ):
        mm.masked_mean(jnp.ones((2, 3)), jnp.ones((2, 4), bool))
    with pytest.raises(
        ValueError, match=r"`mask` of shape \(2, 3, 1\) does not broadcast"
    ):
        mm.masked_mean(jnp.ones((2, 3)), jnp.ones((2, 3, 1), bool))


def test_a_mask_of_lower_rank_is_refused_not_aligned_with_the_last_axes():
    # One entry per sequence on (sequences, positions) values: numpy's rule
    # would apply it along positions, silently when the two sizes are equal.
    values = jnp.arange(16.0).reshape(4, 4)
    per_sequence = jnp.array([True, True, False, False])
    with pytest.raises(ValueError, match=r"mask\[:, None\].*mask\[None\]"):
        mm.masked_mean(values, per_sequence)
    mean, count = mm.masked_mean(values, per_sequence[:, None])
    assert float(mean) == 3.5 and int(count) == 8
    # A scalar mask, and size-1 axes of the same rank, still broadcast; every
    # broadcast entry counts.
    assert int(mm.masked_mean(values, True)[1]) == 16
    assert int(mm.masked_mean(jnp.ones((2, 5, 7)), jnp.ones((2, 5, 1), bool))[1]) == 70


def test_works_under_jit():
    mean, count = jax.jit(mm.masked_mean)(jnp.arange(3.0), jnp.array([0, 1, 1]))
    assert float(mean) == 1.5 and int(count) == 2


@pytest.mark.parametrize("mask_dtype", [jnp.bool_, jnp.int32])
def test_swapped_values_and_mask_are_refused(mask_dtype):
    loss = jnp.array([2.0, 3.0, 0.5])
    mask = jnp.array([1, 0, 1], mask_dtype)
    # Swapped, the mask would be averaged with the losses as weights (0.45, and
    # a "count" of 5.5 tokens).
    with pytest.raises(TypeError, match=r"were they swapped\? .*masked_mean\(per_tok"):
        mm.masked_mean(mask, loss)
    mean, count = mm.masked_mean(loss, mask)
    assert float(mean) == 1.25 and int(count) == 2


def test_values_that_are_not_numbers_are_refused_by_name():
    # A PRNG key failed in jax's "Cannot interpret 'key<fry>' as a data type".
    with pytest.raises(
        TypeError, match=r"`values` must be numeric .*got dtype key<fry>"
    ):
        mm.masked_mean(jax.random.key(0), True)


def test_booleans_average_under_a_boolean_mask_and_as_floats_under_weights():
    hit = jnp.array([True, False, True, True])
    mean, count = mm.masked_mean(hit, jnp.array([True, True, True, False]))
    assert abs(float(mean) - 2 / 3) < 1e-7 and int(count) == 3
    weights = jnp.array([0.5, 0.25, 0.25, 0.0])
    mean, count = mm.masked_mean(hit.astype(jnp.float32), weights)
    assert float(mean) == 0.75 and float(count) == 1.0


def test_a_concrete_non_finite_weight_is_refused():
    # A concrete NaN or inf weight is refused, not turned into a NaN or inf
    # count (the microbatch would be dropped later, silently).
    for bad in (np.nan, np.inf):
        with pytest.raises(ValueError, match=r"1 non-finite weight"):
            mm.masked_mean(jnp.array([1.0, 2.0]), jnp.array([1.0, bad]))


def test_an_integer_mask_counts_each_non_zero_entry_as_one_token():
    # Every non-zero entry of an integer mask is one token (not 2 for a 2,
    # nor -1 for a -1).
    mean, count = mm.masked_mean(jnp.array([1.0, 2.0, 6.0]), jnp.array([2, 0, -1]))
    assert count.dtype == jnp.int32 and int(count) == 2
    np.testing.assert_allclose(mean, 3.5)


def test_weighted_mean_across_keeps_float64_under_x64():
    # The weights nᵈ / N of float64 leaves are float64 (1/3 and 2/3 rounded
    # to float32 would put the mean 3e-8 off).
    with jax.enable_x64(True):
        values = jnp.array([1.0, 4.0], jnp.float64)
        counts = jnp.array([1, 2], jnp.int32)
        mean, _ = jax.vmap(
            lambda g, n: mm.weighted_mean_across(g, n, "shards"), axis_name="shards"
        )(values, counts)
        assert mean.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(mean), 3.0, rtol=1e-14)


def test_a_float_mask_a_jitted_function_closes_over_is_checked_on_the_host():
    # Concrete, but jax's operations on it inside the trace are not: the
    # check reads it on the host instead of failing to concretize.
    values = jnp.array([1.0, 2.0, 6.0])
    weights = jnp.array([1.0, 0.5, 0.0])
    mean, count = jax.jit(lambda: mm.masked_mean(values, weights))()
    np.testing.assert_allclose(mean, 2 / 1.5)
    assert float(count) == 1.5
    negative = jnp.array([1.0, -1.0, 0.0])
    with pytest.raises(ValueError, match=r"negative weights .* -1.0"):
        jax.jit(lambda: mm.masked_mean(values, negative))()
    # A numpy mask too (`jnp.asarray` makes it a tracer inside the trace: it
    # gave (nan, nan) without an error), and a list of Python numbers.
    for host in (np.array([1.0, -1.0, 0.0]), [1.0, -1.0, 0.0]):
        with pytest.raises(ValueError, match=r"negative weights .* -1.0"):
            jax.jit(lambda x, m=host: mm.masked_mean(x, m))(values)
    # A list that holds a traced weight is traced: the count says it.
    _, count = jax.jit(lambda x, w: mm.masked_mean(x, [w, 1.0, 0.0]))(values, -1.0)
    assert np.isnan(count)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_weights_the_count_dtype_cannot_hold_are_named(jit):
    values = jnp.array([1.0, 2.0])

    def mean(mask):
        if jit:
            return jax.jit(lambda x: mm.masked_mean(x, mask))(values)
        return mm.masked_mean(values, mask)

    # Below float32's smallest normal: XLA flushes them to 0, and the
    # microbatch counted as empty, (0, 0), without an error.
    for tiny in (np.array([1e-50, 1e-50]), np.array([1e-40, 1.0], np.float32)):
        with pytest.raises(ValueError, match=r"below the smallest normal float32"):
            mean(tiny)
    # A finite float64 weight beyond float32: it was named "non-finite".
    with pytest.raises(ValueError, match=r"weights sum to 1e\+39, beyond float32"):
        mean(np.array([1e39, 0.0]))
    # The smallest normal itself is a weight like any other.
    smallest = float(np.finfo(np.float32).smallest_normal)
    _, count = mean(np.array([smallest, 0.0], np.float32))
    assert float(count) == smallest
    # Under x64, float64 values: a float32 mask's subnormal weights were
    # checked against float64's smallest normal, then flushed as XLA widened
    # them, (0, 0); a float64 mask keeps them, and float16 ones widen exactly.
    with jax.enable_x64(True):
        wide = jnp.array([1.0, 2.0], jnp.float64)
        with pytest.raises(ValueError, match=r"below the smallest normal float32"):
            mm.masked_mean(wide, np.array([1e-39, 1e-39], np.float32))
        with pytest.raises(ValueError, match=r"below the smallest normal bfloat16"):
            mm.masked_mean(wide, jnp.array([1e-39, 0.0], jnp.bfloat16))
        _, count = mm.masked_mean(wide, np.array([1e-39, 1e-39]))
        assert float(count) == 2e-39
    _, count = mm.masked_mean(values, np.array([1e-6, 1e-6], np.float16))
    assert float(count) == 2 * float(np.float16(1e-6))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_complex_mask_is_refused(jit):
    # It was read as booleans: weights 0.5 and 2 counted one token each, (2, 2)
    # where a weighted mean is (2.6, 2.5); a purely imaginary entry counted one.
    fn = jax.jit(mm.masked_mean) if jit else mm.masked_mean
    with pytest.raises(
        TypeError, match=r"^`mask` must be boolean.*got dtype complex64"
    ):
        fn(jnp.array([1.0, 3.0]), jnp.array([0.5 + 0j, 2.0 + 0j]))
