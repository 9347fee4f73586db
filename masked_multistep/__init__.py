"""masked_multistep: token-weighted gradient accumulation for optax.

``optax.MultiSteps`` averages microbatch mean gradients with equal weight; with
padding and loss masks that is not the gradient of the full batch's token-mean
loss. :class:`MaskedMultiSteps` weights each microbatch by its token count and
runs the inner optimizer once per window on exactly the full-batch gradient.
"""

from masked_multistep._masked_mean import masked_mean
from masked_multistep._multisteps import MaskedMultiSteps, MaskedMultiStepsState
from masked_multistep._running_mean import running_mean_update

__version__ = "0.1.0"

__all__ = [
    "MaskedMultiSteps",
    "MaskedMultiStepsState",
    "masked_mean",
    "running_mean_update",
]
