"""The package version, in one place: setup.cfg reads it (``attr:``) and
``masked_multistep.__version__`` re-exports it.

A plain literal, so that setuptools reads it without importing the package
(and so jax). See CHANGELOG.md.
"""

__version__ = "0.2.0.dev0"
