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
