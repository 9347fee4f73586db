"""The public API's types: what a type checker sees, and what runs.

This file is type-checked by ``make typecheck`` (pyright, tools/typecheck.py)
as well as run by pytest: each test is code a user writes with annotations,
and ``typing.assert_type`` pins what the checker infers (at run time it only
returns its argument).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap
from typing import assert_type

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import masked_multistep as mm
from masked_multistep._train_state import TrainState

TYPECHECK = pathlib.Path(__file__).resolve().parent.parent / "tools" / "typecheck.py"


def test_all_is_constant_and_every_name_resolves():
    assert mm.__all__ == [
        "MaskedMultiSteps",
        "MaskedMultiStepsState",
        "TrainState",
        "masked_mean",
        "microbatched_value_and_grad",
        "running_mean_update",
        "weighted_mean_across",
    ]
    for name in mm.__all__:
        assert getattr(mm, name) is not None, name


def test_train_state_is_the_real_class_for_checkers_and_at_run_time():
    # A checker that saw the lazy `__getattr__` would infer `Any` here, and
    # `assert_type` would fail the type check.
    assert_type(mm.TrainState, type[TrainState])
    assert mm.TrainState is TrainState
    state = mm.TrainState.create(
        apply_fn=None,
        params={"w": jnp.zeros(())},
        tx=mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2),
    )
    assert_type(state, TrainState)
    state = state.apply_gradients(grads={"w": jnp.ones(())}, count=jnp.array(3))
    assert_type(state, TrainState)
    assert int(state.step) == 1


def test_masked_multisteps_is_accepted_where_a_gradient_transformation_is():
    tx = mm.MaskedMultiSteps(optax.adam(1e-2), every_k_schedule=2)
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    chained = optax.chain(optax.clip_by_global_norm(1.0), tx.gradient_transformation())
    as_gt: optax.GradientTransformation = tx.gradient_transformation()
    state = chained.init({"w": jnp.zeros(2)})
    _, state = chained.update({"w": jnp.ones(2)}, state, count=jnp.array(1))
    assert isinstance(optimizer.opt_state, mm.MaskedMultiStepsState)
    assert isinstance(as_gt.init({"w": jnp.zeros(2)}), mm.MaskedMultiStepsState)


def test_typed_loss_fn_for_microbatched_value_and_grad():
    # A `loss_fn` annotated with a narrower params type than `optax.Params`:
    # a callback parameter typed `optax.Params` would reject it (callables are
    # contravariant in their arguments).
    def loss_fn(
        params: dict[str, jax.Array], batch: dict[str, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        return mm.masked_mean(batch["x"] * params["w"], batch["mask"])

    grad_fn = mm.microbatched_value_and_grad(loss_fn, 2)
    batch = {"x": jnp.arange(4.0), "mask": jnp.array([True, True, False, True])}
    (loss, count), grads = grad_fn({"w": jnp.ones(())}, batch)
    assert int(count) == 3
    assert float(loss) == pytest.approx((0.0 + 1.0 + 3.0) / 3)
    assert float(grads["w"]) == pytest.approx((0.0 + 1.0 + 3.0) / 3)


@pytest.mark.slow
def test_typecheck_reports_errors_in_readme_blocks_at_readme_lines(tmp_path):
    # The checker can fail: a README with a type error in its second block.
    readme = tmp_path / "README.md"
    readme.write_text(
        textwrap.dedent(
            """\
            # title

            ```python
            x: int = 1
            ```

            text

            ```python
            import masked_multistep as mm
            tx = mm.MaskedMultiSteps("adam", 2)
            ```
            """
        )
    )
    result = subprocess.run(
        [
            sys.executable,
            str(TYPECHECK),
            "--readme",
            str(readme),
            "masked_multistep/_masked_mean.py",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "README.md:11:" in result.stdout, result.stdout
    assert "(2 README blocks), 1 errors" in result.stdout, result.stdout
