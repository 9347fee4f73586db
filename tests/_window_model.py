"""The float64 reference arithmetic the window state machines share
(``test_window_rules_machine``, ``test_deferred_windows_machine``): float32
budgets and ranges, the statistics' estimators with error bounds, and the
checks of a library figure against the model's."""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32
EPS = 2.0**-24
F32_MAX = float(np.finfo(np.float32).max)


def round_up_f32(b: float) -> float:
    """A Python budget as the library compares it: rounded up to float32."""
    if math.isinf(b):
        return math.inf
    r = F32(b)
    if float(r) < b:
        r = np.nextafter(r, F32(np.inf))
    return float(r)


def sanitized_budget(value) -> float:
    """A jax array budget made total: NaN and negative count as 0."""
    v = float(np.asarray(value, np.float32))
    if math.isnan(v) or v < 0:
        return 0.0
    return v


def f32_range(x: float) -> float:
    """A float32 sum of squares past float32's range is inf (README: "a
    gradient whose squared norm passes float32's range ... makes the window's
    grad_sq_norm infinite and its estimates NaN")."""
    return math.inf if x > F32_MAX else x


def sq(tree) -> float:
    with np.errstate(all="ignore"):
        return f32_range(
            float(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in tree.values()))
        )


def estimates(last):
    """tr Σ̂, |G|²̂, B_simple of a recorded window, with error bounds."""
    K, N, g2, S = last["K"], float(last["tokens"]), last["g2"], last["S"]
    ok = K >= 2 and N > 0 and math.isfinite(S) and math.isfinite(g2)
    out = dict(ok=ok)
    if ok:
        var = S / (K - 1)
        err_var = last["err_S"] / (K - 1) + 1e-6 * var
        true = g2 - var / N
        err_true = last["err_g2"] + err_var / N + 1e-6 * abs(g2)
        out.update(var=var, err_var=err_var, true=true, err_true=err_true)
    return out


def f(x) -> float:
    return float(np.asarray(x, np.float64))


def assert_near(name, actual, expected, tol):
    actual = f(actual)
    assert math.isfinite(actual) and abs(actual - expected) <= tol, (
        f"{name}: library {actual!r}, model {expected!r} (tolerance {tol:.3g})"
    )


def assert_nan(name, actual):
    assert math.isnan(f(actual)), f"{name}: library {f(actual)!r}, model NaN"


def ratio_check(name, actual, num, err_num, den, err_den):
    """A ratio num / den whose denominator's sign decides NaN (den <= 0)."""
    if abs(den) <= 2 * err_den:  # within rounding of 0: either is right
        return "ambiguous"
    if den < 0:
        assert_nan(name, actual)
        return None
    ref = num / den
    if abs(ref) > F32_MAX * (1 - 1e-5):  # past float32's range: inf
        assert abs(f(actual)) > F32_MAX * (1 - 1e-4), (name, f(actual), ref)
        return None
    tol = 2 * (err_num + abs(ref) * err_den) / (den - err_den) + 1e-5 * abs(ref) + 1e-12
    assert_near(name, actual, ref, tol)
    return None


def check_window_figures(model, stats) -> None:
    """The last window's loss, squared norm, estimators and smoothed noise
    scale (``stats``, a ``WindowStats``) against the model's ``last`` window
    and moving averages (``ema``)."""
    last = model.last
    if last["loss"] is None:
        assert_nan("loss", stats.loss)
    else:
        assert_near("loss", stats.loss, last["loss"], 1e-5 * (1 + last["loss_abs"]))
    g2 = last["g2"]
    if float(last["tokens"]) == 0 or math.isnan(g2):
        assert_nan("grad_sq_norm", stats.grad_sq_norm)
    elif math.isinf(g2):
        assert not math.isfinite(f(stats.grad_sq_norm)), stats.grad_sq_norm
    else:
        assert_near("grad_sq_norm", stats.grad_sq_norm, g2, last["err_g2"] + 1e-6 * g2)
    est = estimates(last)
    if not est["ok"]:
        for name in ("grad_var_trace", "true_grad_sq_norm", "noise_scale"):
            assert_nan(name, getattr(stats, name))
    else:
        assert_near("grad_var_trace", stats.grad_var_trace, est["var"], est["err_var"])
        assert_near(
            "true_grad_sq_norm", stats.true_grad_sq_norm, est["true"], est["err_true"]
        )
        ratio_check(
            "noise_scale",
            stats.noise_scale,
            est["var"],
            est["err_var"],
            est["true"],
            est["err_true"],
        )
    e = model.ema
    if e["weight"] == 0:
        assert_nan("smoothed_noise_scale", stats.smoothed_noise_scale)
    else:
        ratio_check(
            "smoothed_noise_scale",
            stats.smoothed_noise_scale,
            e["var"],
            e["err_var"] + 1e-6 * e["var"],
            e["true"],
            e["err_true"] + 1e-6 * abs(e["true"]),
        )


def rounding_errors(K, N, g2, Q, gmax2) -> tuple[float, float]:
    """Generous bounds on the float32 rounding of ``‖ḡ‖²`` and ``S`` for a
    window of ``K`` microbatches, ``N`` tokens, ``Q = Σ nᵢ‖gᵢ‖²`` and
    ``gmax2`` bounding the squared gradients."""
    scale = 50 * EPS * (K + 2)
    err_g2 = scale * (g2 + 4 * gmax2) + 1e-30
    err_S = scale * (Q + float(N) * (g2 + 4 * gmax2)) + 1e-30
    return err_g2, err_S


def record_window(model, last) -> None:
    """``last`` as ``model``'s last completed window: one more window, and
    its estimators folded into the moving averages (``model.ema``), with the
    wrapper's ``stats_decay`` (``model.spec["decay"]``, 0.9 by default)."""
    model.last = last
    model.windows += 1
    est = estimates(last)
    if est["ok"]:
        beta = float(F32(model.spec.get("decay", 0.9)))
        e = model.ema
        for name in ("var", "true", "err_var", "err_true"):
            e[name] = beta * e[name] + (1 - beta) * est[name]
        e["weight"] = beta * e["weight"] + (1 - beta)
