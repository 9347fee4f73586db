"""A conditional that updates its state in place on every backend.

``MaskedMultiSteps`` runs the inner optimizer only when a window closes: a
conditional whose other branch passes the optimizer state, the accumulator and
the parameters through untouched. XLA:CPU keeps those buffers in place (the
pass-through branch moves no bytes), but XLA:GPU's default copy insertion (its
``xla_gpu_copy_insertion_use_region_analysis`` is off) copies every
pass-through buffer in that branch and copies the conditional's outputs again
into the step's donated outputs: for adam, 20 parameter-sized copies on every
microbatch, more memory traffic than the gradient itself on an optimizer-bound
step, and three parameter-sized temporaries. A ``while_loop`` that runs its
body at most once has no such copies (a loop's state is updated in place), so
that is what GPUs (CUDA, ROCm) get; CPUs and TPUs, whose conditionals keep
their buffers in place (read from compiled programs, a TPU v5e's too), keep the
plain ``lax.cond``. Both forms compute the same values.

The choice is made when the program is lowered for its platform
(``lax.platform_dependent``), so a program compiled ahead of time for a GPU gets
the loop too. A ``while_loop`` cannot be differentiated in reverse mode, so
derivatives go through the ``lax.cond`` form (a ``custom_jvp`` whose rule is the
conditional's own).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

__all__ = ["in_place_cond"]

S = TypeVar("S")


def in_place_cond(
    pred: jax.Array,
    true_fn: Callable[..., tuple[S, Any]],
    false_fn: Callable[..., Any],
    state: S,
    *operands: Any,
) -> tuple[S, Any]:
    """``true_fn(state, *operands)`` if ``pred``, else ``(state, false_fn(state,
    *operands))``: ``state`` updated in place by the taken branch, passed
    through by the other.

    ``true_fn`` returns ``(new_state, extra)`` with ``new_state`` of ``state``'s
    structure, shapes and dtypes; ``false_fn`` returns only an ``extra`` of the
    same structure as ``true_fn``'s (it cannot change ``state``).

    Example:
      >>> import jax.numpy as jnp
      >>> step = lambda s, g: (s - g, jnp.bool_(True))
      >>> hold = lambda s, g: jnp.bool_(False)
      >>> in_place_cond(jnp.bool_(True), step, hold, jnp.ones(2), jnp.ones(2))
      (Array([0., 0.], dtype=float32), Array(True, dtype=bool))
      >>> in_place_cond(jnp.bool_(False), step, hold, jnp.ones(2), jnp.ones(2))
      (Array([1., 1.], dtype=float32), Array(False, dtype=bool))
    """
    pred = jnp.asarray(pred, jnp.bool_)
    args = (state, *operands)
    # Closures (an inner optimizer built around traced values) become explicit
    # arguments, so that the custom rule differentiates with respect to them.
    true_c, true_consts = jax.closure_convert(true_fn, *args)
    false_c, false_consts = jax.closure_convert(false_fn, *args)
    return _cond(
        true_c, false_c, len(true_consts), pred, true_consts + false_consts, args
    )


def _as_cond(true_c, false_c, n_true, pred, consts, args):
    t, f = consts[:n_true], consts[n_true:]
    return jax.lax.cond(
        pred,
        lambda a: true_c(*a, *t),
        lambda a: (a[0], false_c(*a, *f)),
        args,
    )


def _as_loop(true_c, false_c, n_true, pred, consts, args):
    t, f = consts[:n_true], consts[n_true:]
    state, *operands = args

    def body(carry):
        _, state, _ = carry
        new_state, extra = true_c(state, *operands, *t)
        return jnp.zeros([], jnp.bool_), new_state, extra

    init = (pred, state, false_c(*args, *f))
    _, state, extra = jax.lax.while_loop(lambda c: c[0], body, init)
    return state, extra


# The form each platform's program gets: the loop where a conditional copies
# the buffers it passes through (XLA:GPU), the conditional everywhere else.
_FORMS = {"cuda": _as_loop, "rocm": _as_loop, "default": _as_cond}


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _cond(true_c, false_c, n_true, pred, consts, args):
    forms = {
        platform: functools.partial(form, true_c, false_c, n_true)
        for platform, form in _FORMS.items()
    }
    return jax.lax.platform_dependent(pred, consts, args, **forms)


@_cond.defjvp
def _cond_jvp(true_c, false_c, n_true, primals, tangents):
    # Derivatives of the conditional itself (a while loop has none in reverse
    # mode); the values are the same in both forms.
    form = functools.partial(_as_cond, true_c, false_c, n_true)
    return jax.jvp(form, primals, tangents)
