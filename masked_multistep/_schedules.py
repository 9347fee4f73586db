"""Learning-rate schedules written in tokens, for windows of varying size."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from masked_multistep._checks import (
    check_real,
    check_takes_one,
    host_int_to_float,
    refuse_narrow_float,
    short_repr,
)

__all__ = ["tokens_schedule"]


def tokens_schedule(
    schedule: Callable[[jax.Array], jax.typing.ArrayLike],
    tokens_per_step: float | np.floating | np.integer,
) -> Callable[[jax.typing.ArrayLike], jax.Array]:
    """A schedule written in tokens seen, as a schedule of the optimizer step.

    The inner optimizer's schedules advance once per window. With windows of a
    fixed number of tokens (or a token budget, which each window meets or
    overshoots by less than one microbatch) the tokens seen before step ``t``
    are about ``t · tokens_per_step``, so a schedule written in tokens (a
    warmup over the first 10⁶ tokens, a decay over 10⁹) becomes::

        step_schedule(t) = schedule(t · tokens_per_step)

    The product is formed in float32. It is an approximation where windows
    vary in size: for a fixed ``k`` or a constant budget pass the mean tokens
    per window (measured on a short run as
    ``float(stats.tokens_seen) / int(stats.windows)``; a token budget plus
    ``E[n²] / (2 E[n])`` for microbatch counts ``n`` estimates it). Where the
    windows' size changes over the run (a budget warmup, the norm test) no one
    figure holds, and the schedule runs ahead of or behind the data: to follow
    the exact tokens seen, wrap the inner optimizer in
    ``optax.inject_hyperparams`` (with a constant) and set its learning rate
    from ``mm.window_stats(state).tokens_seen`` before each step,
    ``optax.tree.set(state, learning_rate=...)`` (the README's "Windows by
    tokens" shows how).

    Args:
      schedule: a function of the tokens seen, e.g. an optax schedule whose
        ``*_steps`` arguments are token counts (beyond 2**31 − 1 written as
        floats, ``3e9``: optax takes a Python int of them as an int32).
      tokens_per_step: tokens per optimizer step (per window), finite and > 0.

    Returns:
      A schedule of the optimizer step, for the inner optimizer (an
      ``optax.Schedule``).

    Raises:
      TypeError: if ``schedule`` is not callable or ``tokens_per_step`` not a
        real number.
      ValueError: if ``tokens_per_step`` is not finite and > 0, or beyond what
        float32 holds (below its smallest normal number, above its largest).

    Examples:
      A linear warmup over the first 4,096 tokens, with 1,024 tokens per
      window, reaches its peak at the fourth step:

      >>> import optax
      >>> import masked_multistep as mm
      >>> warmup = optax.linear_schedule(0.0, 1e-3, transition_steps=4096)
      >>> lr = mm.tokens_schedule(warmup, tokens_per_step=1024)
      >>> print(round(float(lr(2)), 6), round(float(lr(4)), 6))
      0.0005 0.001
    """
    if not callable(schedule):
        raise TypeError(f"`schedule` must be callable, got {schedule!r}")
    check_takes_one(schedule, "`schedule`", "the tokens seen")
    dtype = getattr(tokens_per_step, "dtype", None)
    if dtype is not None:  # jnp.bfloat16(3001) is already 3008
        refuse_narrow_float(dtype, "`tokens_per_step`")
    rate = float(check_real(tokens_per_step, "`tokens_per_step`"))
    f32 = np.finfo(np.float32)
    if not float(f32.tiny) <= rate <= float(f32.max):
        raise ValueError(
            "`tokens_per_step` must be a positive number float32 holds (the "
            f"schedule's arithmetic), got {tokens_per_step!r}"
        )

    def step_schedule(step):
        # A host integer by value (jax wraps a numpy int64 into int32 without
        # x64, and a Python int of 2**31 or more is its OverflowError).
        try:
            x = jnp.asarray(host_int_to_float(step))
        except (TypeError, ValueError) as err:
            x = err
        if isinstance(x, Exception) or not (
            jnp.issubdtype(x.dtype, jnp.integer)
            or jnp.issubdtype(x.dtype, jnp.floating)
        ):
            raise TypeError(
                "the schedule's `step` must be a real number (the optimizer "
                f"step), got {short_repr(step)} of type {type(step).__name__}"
            ) from (x if isinstance(x, Exception) else None)
        return jnp.asarray(schedule(x.astype(jnp.float32) * rate))

    return step_schedule
