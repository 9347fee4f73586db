"""masked_multistep: token-weighted gradient accumulation for optax.

``optax.MultiSteps`` averages microbatch mean gradients with equal weight; with
padding and loss masks that is not the gradient of the full batch's token-mean
loss. :class:`MaskedMultiSteps` weights each microbatch by its token count and
runs the inner optimizer once per window on exactly the full-batch gradient.
"""

from masked_multistep._collectives import weighted_mean_across
from masked_multistep._inspect import find_state, has_updated, window_stats
from masked_multistep._masked_mean import masked_mean
from masked_multistep._microbatch import microbatched_value_and_grad
from masked_multistep._multisteps import MaskedMultiSteps, MaskedMultiStepsState
from masked_multistep._running_mean import running_mean_update
from masked_multistep._stats import TokenTotal, WindowStats, noise_scale_estimates

__version__ = "0.1.0"

__all__ = [
    "MaskedMultiSteps",
    "MaskedMultiStepsState",
    "TokenTotal",
    "WindowStats",
    "find_state",
    "has_updated",
    "masked_mean",
    "noise_scale_estimates",
    "microbatched_value_and_grad",
    "running_mean_update",
    "weighted_mean_across",
    "window_stats",
]

# flax is optional: `TrainState` is imported on first access, so that importing
# the package neither needs flax nor pays for importing it.
from importlib.util import find_spec as _find_spec  # noqa: E402

if _find_spec("flax") is not None:
    __all__ += ["TrainState"]


def __getattr__(name: str):
    if name == "TrainState":
        from masked_multistep._train_state import TrainState

        globals()["TrainState"] = TrainState
        return TrainState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
