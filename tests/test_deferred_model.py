"""The deferred reduction against a float64 model, on 8 CPU devices.

Hypothesis draws sequences of microbatches, each with one count, one gradient
and (sometimes) one loss value per device: counts that are zero, fractional,
negative or NaN (invalid, only possible under ``jit``), gradients that are NaN
where a device has no tokens and sometimes where it has. Both variants of
``reduction=mm.deferred(...)`` run them under ``jit`` with ``sgd(1.0)`` (the
update is minus the window's mean) and an inner step that records the
window's ``value``, and are compared after every microbatch with a plain-Python
model of their documented semantics:

* agreeing at the window's end (a window of ``k``, no skip function): every
  microbatch counts toward its window; an invalid count drops that device's
  share only, and is tallied in ``num_invalid_counts`` when the window closes;
* agreeing on every microbatch (``should_skip_update_fn`` given): an invalid
  count on any device skips the whole microbatch, tallied at once; a microbatch
  whose gradients are not finite where there are tokens is skipped.

In both a window applies ``-Σ nᵢᵈ gᵢᵈ / Σ nᵢᵈ`` over the shares it holds if it
has tokens and that mean is finite, counts a non-finite mean in
``num_nonfinite_windows``, and applies nothing without tokens; the recorded
``value`` is the token-weighted mean of the values passed. The recording step
needs ``value=``: a window in which none was passed is held and counted as
non-finite.
With window statistics on, every closed window's tokens, ``K`` (the shares
with tokens), ``‖ḡ‖²`` and ``tr Σ̂`` match the model's, each share a small
batch of its own.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _recording import records_value
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm

NDEV, WIDTH, K = 8, 3, 3
# Calls without `value=` to an inner step that needs it are part of the
# model (a window without one is held); the wrapper warns about each.
pytestmark = pytest.mark.filterwarnings("ignore:The inner optimizer needs `value=`")


# About one count in sixteen is invalid, so that most microbatches have none:
# with the skip function, one invalid count on any of the 8 devices skips the
# whole microbatch, and at one in two windows would almost never close.
_count = st.sampled_from(
    [0.0, 1.0, 2.0, 5.0, 0.5, 40.0] * 5 + [-1.0, math.nan]  # the last two invalid
)
_microbatch = st.fixed_dictionaries(
    {
        "counts": st.lists(_count, min_size=NDEV, max_size=NDEV),
        "seed": st.integers(0, 2**16),
        "nan_with_tokens": st.booleans(),
        "value": st.sampled_from(["none", "scalar", "per_device"]),
    }
)


class Model:
    """The documented semantics, in float64."""

    def __init__(self, synced: bool):
        self.synced = synced
        self.gradient_step = self.invalid = self.nonfinite = 0
        self.last_value = 0.0
        self.closed = None  # the statistics of a window closed by the last step
        self._reset()

    def _reset(self):
        self.shares = []  # (n, g) of every share the window holds
        self.values = []  # (n, v) of the values passed
        self.pending_invalid = 0
        self.mini_step = 0

    def step(self, counts, grads, value):
        """One microbatch; returns the expected update (``None``: zeros)."""
        self.closed = None
        bad = [not (n >= 0) for n in counts]  # negative or NaN
        if self.synced:
            if any(bad):
                self.invalid += 1
                return None
            if any(
                n > 0 and not np.isfinite(g).all()
                for n, g in zip(counts, grads, strict=True)
            ):
                return None  # skip_not_finite: as if it never happened
        else:
            self.pending_invalid += sum(bad)
        taken = [0.0 if b else float(n) for n, b in zip(counts, bad, strict=True)]
        self.shares += [(n, g) for n, g in zip(taken, grads, strict=True) if n > 0]
        if value is not None:
            per_device = np.broadcast_to(value, (NDEV,))
            self.values += [
                (n, v) for n, v in zip(taken, per_device, strict=True) if n > 0
            ]
        self.mini_step += 1
        if self.mini_step < K:
            return None
        update = None
        total = sum(n for n, _ in self.shares)
        vtotal = sum(n for n, _ in self.values)
        value = sum(n * v for n, v in self.values) / vtotal if vtotal else math.nan
        if total > 0:
            mean = sum(n * g for n, g in self.shares) / total
            # The recording inner step needs value=: a window without one is
            # held like a non-finite mean.
            if np.isfinite(mean).all() and math.isfinite(value):
                update = -mean
                self.gradient_step += 1
                self.last_value = value
            else:
                self.nonfinite += 1
        k = len(self.shares)
        g2 = float(mean @ mean) if total > 0 else math.nan
        s = sum(n * float(g @ g) for n, g in self.shares) - total * g2
        var = s / (k - 1) if k >= 2 and total > 0 else math.nan
        self.closed = {"tokens": total, "microbatches": k, "g2": g2, "var": var}
        self.invalid += self.pending_invalid
        self._reset()
        return update


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((NDEV,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.mark.parametrize("synced", [False, True], ids=["per-window", "synced"])
def test_deferred_matches_the_model(mesh, synced):
    skip = optax.skip_not_finite if synced else None
    tx = mm.MaskedMultiSteps(
        optax.chain(optax.sgd(1.0), records_value()),
        K,
        reduction=mm.deferred(mesh, "data"),
        should_skip_update_fn=skip,
        window_stats=True,
    )
    params = jnp.zeros(WIDTH, jnp.float32)
    data = NamedSharding(mesh, P("data"))

    @jax.jit
    def step(state, grads, counts, value):
        return tx.update(grads, state, params, count=counts, value=value)

    @jax.jit
    def step_no_value(state, grads, counts):
        return tx.update(grads, state, params, count=counts)

    reached = {"updates": 0, "statistics": 0, "invalid": 0, "nonfinite": 0}

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(st.lists(_microbatch, min_size=K, max_size=3 * K + 1))
    def run(microbatches):
        model = Model(synced)
        state = tx.init(params)
        for mb in microbatches:
            rng = np.random.default_rng(mb["seed"])
            counts = np.asarray(mb["counts"], np.float32)
            grads = rng.normal(size=(NDEV, WIDTH))
            grads[~(counts > 0)] = np.nan  # an empty or invalid share: 0/0
            if mb["nan_with_tokens"] and rng.uniform() < 0.3:
                grads[rng.integers(NDEV)] = np.nan
            grads = grads.astype(np.float32)
            value = {
                "none": None,
                "scalar": np.float32(rng.normal()),
                "per_device": rng.normal(size=NDEV).astype(np.float32),
            }[mb["value"]]
            want = model.step(
                [float(n) for n in counts], grads.astype(np.float64), value
            )
            g = jax.device_put(grads, data)
            c = jax.device_put(counts, data)
            if value is None:
                updates, state = step_no_value(state, g, c)
            else:
                updates, state = step(state, g, c, value)
            if want is None:
                assert not np.asarray(updates).any()
            else:
                np.testing.assert_allclose(updates, want, rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(
                    state.inner_opt_state[1], model.last_value, rtol=1e-5, atol=1e-6
                )
            assert bool(state.updated) == (want is not None)
            reached["updates"] += want is not None
            assert int(state.gradient_step) == model.gradient_step
            assert int(state.num_invalid_counts) == model.invalid
            assert int(state.num_nonfinite_windows) == model.nonfinite
            assert int(state.mini_step) == model.mini_step
            if model.closed is not None:
                reached["statistics"] += model.closed["microbatches"] >= 2
                got = mm.window_stats(state)
                assert int(got.microbatches) == model.closed["microbatches"]
                np.testing.assert_allclose(got.tokens, model.closed["tokens"])
                np.testing.assert_allclose(
                    got.grad_sq_norm, model.closed["g2"], rtol=1e-5, atol=1e-6
                )
                np.testing.assert_allclose(
                    got.grad_var_trace, model.closed["var"], rtol=1e-4, atol=1e-5
                )
        reached["invalid"] += model.invalid > 0
        reached["nonfinite"] += model.nonfinite > 0

    run()
    # The draws reach what is compared: updates, windows with a variance
    # estimate (K >= 2), runs with invalid counts and with non-finite windows.
    # (Drawn one in two, invalid counts once left the synced variant with no
    # update at all.)
    assert reached["updates"] >= 20 and reached["statistics"] >= 20, reached
    assert reached["invalid"] >= 5 and reached["nonfinite"] >= 1, reached
