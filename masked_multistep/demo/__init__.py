"""A runnable demonstration: ``python -m masked_multistep.demo``.

Trains a tiny causal language model on a synthetic corpus of variable-length,
padded and masked sequences three times from the same initialisation and data:
on the full batch (the reference), with ``optax.MultiSteps`` over ``k``
microbatches, and with :class:`masked_multistep.MaskedMultiSteps` over the same
``k`` microbatches. It prints how far each run's accumulated gradient is from
the full-batch gradient, and writes a plot and a JSON of the numbers.

Modules: ``data`` (the synthetic corpus), ``model`` (the language model),
``train`` (the three runs), ``report`` (table, plot, JSON) and ``cli`` (the
command line). Needs the ``demo`` extra (flax, matplotlib, tqdm): ``make demo``
or ``pip install -e ".[demo]"`` from a checkout.
"""

from masked_multistep.demo.cli import main

__all__ = ["main"]
