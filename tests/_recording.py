"""An inner transformation for tests that need to see a window's ``value``."""

import jax.numpy as jnp
import optax


def records_value() -> optax.GradientTransformationExtraArgs:
    """Passes the updates through and keeps the ``value=`` it was handed (the
    window's token-weighted loss) as its state; requires ``value=``, like
    ``optax.contrib.reduce_on_plateau``. Chain it after the optimizer and read
    ``inner_opt_state[-1]``."""

    def init(params):
        del params
        return jnp.zeros([], jnp.float32)

    def update(updates, state, params=None, *, value):
        del state, params
        return updates, jnp.asarray(value, jnp.float32)

    return optax.GradientTransformationExtraArgs(init, update)
