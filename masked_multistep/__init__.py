"""masked_multistep: token-weighted gradient accumulation for optax.

``optax.MultiSteps`` averages microbatch mean gradients with equal weight; with
padding and loss masks that is not the gradient of the full batch's token-mean
loss. :class:`MaskedMultiSteps` weights each microbatch by its token count and
runs the inner optimizer once per window on exactly the full-batch gradient::

    tx = mm.MaskedMultiSteps(optax.adamw(1e-3), every_k_schedule=4)
    (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
    updates, opt_state = tx.update(grads, opt_state, params, count=count)

where ``loss_fn`` returns ``mm.masked_mean(per_token_loss, mask)``.

The public names, by what they are for:

Accumulate across steps
    ``MaskedMultiSteps``, ``MaskedMultiStepsState``, ``masked_mean``, and
    ``TrainState`` (Flax linen's, with ``apply_gradients(grads=, count=)``;
    needs flax). NNX's ``nnx.Optimizer`` takes ``MaskedMultiSteps`` as it is.
Microbatch inside one jitted step; data parallel
    ``microbatched_value_and_grad``, ``per_device_value_and_grad``,
    ``data_parallel_value_and_grad``, ``deferred`` (one gradient reduction per
    window), ``weighted_mean_across``; ``GradFn``, ``GradFnWithStats`` and
    ``GradFnWithLeafStats``, the types of the functions the first three return.
Window statistics and inspection
    ``window_stats``, ``has_updated``, ``find_state``, ``WindowStats``,
    ``TokenTotal``, ``noise_scale_estimates``.
Windows by tokens
    ``token_budget``, ``norm_test``, ``tokens_schedule``, ``WindowPolicy``,
    ``WindowScalars``.
Migration and checkpoints
    ``from_optax_multisteps``, ``from_state_0_1``, ``state_0_1_target``,
    ``STATE_0_1_FIELDS``; ``device_count_target``, ``from_device_count`` (a
    deferred state onto another number of devices); ``from_other_settings``
    (a running state onto a wrapper with another window rule or statistics).
Building block
    ``running_mean_update``: the token-weighted running mean itself.

The README is the guide; every name's docstring has its contract and examples.
"""

import importlib.util as _importlib_util
import typing as _typing

from masked_multistep._checkpoint import (
    STATE_0_1_FIELDS,
    from_state_0_1,
    state_0_1_target,
)
from masked_multistep._collectives import weighted_mean_across
from masked_multistep._deferred import deferred
from masked_multistep._device_count import device_count_target, from_device_count
from masked_multistep._inspect import find_state, has_updated, window_stats
from masked_multistep._masked_mean import masked_mean
from masked_multistep._microbatch import (
    GradFn,
    GradFnWithLeafStats,
    GradFnWithStats,
    microbatched_value_and_grad,
)
from masked_multistep._migrate import from_optax_multisteps
from masked_multistep._multisteps import MaskedMultiSteps
from masked_multistep._per_device import (
    data_parallel_value_and_grad,
    per_device_value_and_grad,
)
from masked_multistep._running_mean import running_mean_update
from masked_multistep._schedules import tokens_schedule
from masked_multistep._settings import from_other_settings
from masked_multistep._state import MaskedMultiStepsState
from masked_multistep._stats import noise_scale_estimates
from masked_multistep._stats_state import WindowStats
from masked_multistep._token_total import TokenTotal
from masked_multistep._version import __version__ as __version__
from masked_multistep._windows import (
    WindowPolicy,
    WindowScalars,
    norm_test,
    token_budget,
)

if _typing.TYPE_CHECKING:
    # Type checkers see the real class; at run time it is imported on first
    # access (`__getattr__` below), so that `import masked_multistep` neither
    # needs flax, an optional dependency, nor pays for importing it.
    from masked_multistep._train_state import TrainState as TrainState


# `TrainState` (flax's) is listed where flax is installed, so that
# `from masked_multistep import *` works without it too; without flax, accessing
# `mm.TrainState` raises an ImportError that says what to install.
__all__ = [
    "GradFn",
    "GradFnWithLeafStats",
    "GradFnWithStats",
    "MaskedMultiSteps",
    "MaskedMultiStepsState",
    "STATE_0_1_FIELDS",
    "TokenTotal",
    "WindowPolicy",
    "WindowScalars",
    "WindowStats",
    "data_parallel_value_and_grad",
    "deferred",
    "device_count_target",
    "find_state",
    "from_device_count",
    "from_optax_multisteps",
    "from_other_settings",
    "from_state_0_1",
    "has_updated",
    "masked_mean",
    "microbatched_value_and_grad",
    "noise_scale_estimates",
    "norm_test",
    "per_device_value_and_grad",
    "running_mean_update",
    "state_0_1_target",
    "token_budget",
    "tokens_schedule",
    "weighted_mean_across",
    "window_stats",
]
if _importlib_util.find_spec("flax") is not None:
    __all__.append("TrainState")


if not _typing.TYPE_CHECKING:
    # Hidden from type checkers, which see `TrainState` imported above: a
    # module-level `__getattr__` would make every misspelt `mm.` name pass.

    def __getattr__(name: str):
        if name == "TrainState":
            # Without flax this raises an ImportError that says what to install.
            from masked_multistep._train_state import TrainState

            globals()["TrainState"] = TrainState
            return TrainState
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
