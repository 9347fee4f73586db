"""The public API's types: what a type checker sees, and what runs.

This file is type-checked by ``make typecheck`` (pyright, tools/typecheck.py)
as well as run by pytest: each test is code a user writes with annotations,
and ``typing.assert_type`` pins what the checker infers (at run time it only
returns its argument). Wrong usage carries a ``# pyright: ignore[rule]``
comment, and an unneeded one is an error in this file (the comment below), so
each such line asserts that the checker does report the error; pytest checks
that the same line fails at run time.
"""

# pyright: reportUnnecessaryTypeIgnoreComment=error

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import textwrap
from typing import Any, assert_type

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import masked_multistep as mm
from masked_multistep._train_state import TrainState

TYPECHECK = pathlib.Path(__file__).resolve().parent.parent / "tools" / "typecheck.py"


def test_all_is_a_literal_list_and_every_name_resolves():
    # A literal list, the same with or without flax (checkers read it as it is
    # written); `TrainState` is in it either way.
    assert {
        "MaskedMultiSteps",
        "MaskedMultiStepsState",
        "TrainState",
        "from_optax_multisteps",
        "masked_mean",
        "microbatched_value_and_grad",
        "running_mean_update",
        "weighted_mean_across",
    } <= set(mm.__all__)
    assert len(set(mm.__all__)) == len(mm.__all__)
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
    as_gt: optax.GradientTransformation = tx
    as_gt_extra: optax.GradientTransformationExtraArgs = tx
    # The wrapper itself inside optax.chain (which forwards `count=` to it),
    # and its bare (init, update) pair.
    for link in (tx, tx.gradient_transformation()):
        chained = optax.chain(optax.clip_by_global_norm(1.0), link)
        state = chained.init({"w": jnp.zeros(2)})
        _, state = chained.update({"w": jnp.ones(2)}, state, count=jnp.array(1))
        # optax types a chain's state as any pytree: it is a tuple of states.
        assert isinstance(state, tuple)
        assert isinstance(state[1], mm.MaskedMultiStepsState)
    assert isinstance(optimizer.opt_state, mm.MaskedMultiStepsState)
    assert isinstance(as_gt.init({"w": jnp.zeros(2)}), mm.MaskedMultiStepsState)
    assert as_gt_extra is tx


def test_init_and_update_are_typed_with_the_wrappers_state():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2)
    params = {"w": jnp.zeros(())}
    state = tx.init(params)
    assert_type(state, mm.MaskedMultiStepsState)
    assert_type(state.gradient_step, jax.Array)
    updates, state = tx.update({"w": jnp.ones(())}, state, params, count=3)
    assert_type(updates, optax.Updates)
    assert_type(state, mm.MaskedMultiStepsState)
    params, state = tx.apply_gradients(
        {"w": jnp.ones(())}, state, params, count=jnp.array(1)
    )
    assert_type(state, mm.MaskedMultiStepsState)
    # The params come back in their own type, so a loop's annotation holds.
    assert_type(params, dict[str, jax.Array])
    assert int(state.gradient_step) == 1 and bool(tx.has_updated(state))
    # The bare pair is typed as optax types any transformation.
    assert_type(tx.gradient_transformation().init(params), optax.OptState)


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
    assert_type(grads, dict[str, jax.Array])  # the params' type
    assert int(count) == 3
    assert float(loss) == pytest.approx((0.0 + 1.0 + 3.0) / 3)
    assert float(grads["w"]) == pytest.approx((0.0 + 1.0 + 3.0) / 3)


def test_window_stats_are_typed():
    def loss_fn(
        params: dict[str, jax.Array], batch: dict[str, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        return mm.masked_mean(batch["x"] * params["w"], batch["mask"])

    grad_fn = mm.microbatched_value_and_grad(loss_fn, 2, with_stats=True)
    batch = {"x": jnp.arange(4.0), "mask": jnp.array([True, True, False, True])}
    (_, count), grads, stats = grad_fn({"w": jnp.ones(())}, batch)
    assert_type(grads, dict[str, jax.Array])
    assert_type(stats, mm.WindowStats[jax.Array])
    assert int(stats.tokens) == int(count) == 3
    # Each leaf's figures are shaped like the gradients.
    leaf_fn = mm.microbatched_value_and_grad(
        loss_fn, 2, with_stats=True, per_leaf_stats=True
    )
    _, _, leaf_stats = leaf_fn({"w": jnp.ones(())}, batch)
    assert_type(leaf_stats, mm.WindowStats[Any])
    assert set(leaf_stats.noise_scale) == {"w"}

    tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=1, per_leaf_stats=True)
    opt_state = optax.chain(optax.identity(), tx).init({"w": jnp.zeros(())})
    assert_type(mm.window_stats(opt_state), mm.WindowStats[jax.Array])
    # Each leaf's figures are shaped like the params, each group's by label.
    assert_type(mm.window_stats(opt_state, per_leaf=True), mm.WindowStats[Any])
    assert_type(
        mm.window_stats(opt_state, groups="all"),
        mm.WindowStats[dict[str, jax.Array]],
    )
    assert_type(mm.find_state(opt_state), mm.MaskedMultiStepsState)
    assert_type(mm.has_updated(opt_state), jax.Array)


def test_flags_known_at_run_time_and_numpy_batches_type_check():
    """A flag in a plain ``bool`` variable (a config's) picks no Literal
    overload: the result is the union of what each value gives. A batch of
    numpy arrays is taken where ``loss_fn`` annotates the jax arrays it
    receives. ``mm.TokenTotal`` takes its fields by keyword (under mypy too)."""

    def loss_fn(
        params: dict[str, jax.Array], batch: dict[str, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        return mm.masked_mean(batch["x"] * params["w"], batch["mask"])

    log_stats, per_layer = bool(np.int8(1)), bool(np.int8(0))
    grad_fn = mm.microbatched_value_and_grad(loss_fn, 2, with_stats=log_stats)
    batch: dict[str, np.ndarray] = {
        "x": np.arange(4.0, dtype=np.float32),
        "mask": np.ones(4, bool),
    }
    out = grad_fn({"w": jnp.ones(())}, batch)
    assert len(out) == 3
    assert_type(
        mm.microbatched_value_and_grad(
            loss_fn, 2, with_stats=True, per_leaf_stats=per_layer
        ),
        mm.GradFn[dict[str, jax.Array], Any]
        | mm.GradFnWithStats[dict[str, jax.Array], Any]
        | mm.GradFnWithLeafStats[dict[str, jax.Array], Any],
    )
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 1, window_stats=True)
    state = tx.init({"w": jnp.zeros(())})
    assert_type(mm.window_stats(state, per_leaf=per_layer), mm.WindowStats[Any])
    new = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    moved = mm.from_other_settings(state, new.init({"w": jnp.zeros(())}))
    assert_type(moved, mm.MaskedMultiStepsState)
    seen = mm.TokenTotal(hi=jnp.float32(2**24), lo=jnp.float32(1))
    assert float(seen.value()) == 2**24 + 1


def test_flags_given_as_false_or_numpy_bools_pick_their_overloads():
    """``per_leaf_stats=False`` beside no statistics matched no overload,
    ``with_stats=False, per_leaf_stats=False`` the run-time one (a union that
    a 2-tuple cannot unpack), and a ``np.bool_`` flag none; and the returned
    functions' types are public, for a factory's annotation."""

    def loss_fn(
        params: dict[str, jax.Array], batch: dict[str, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        return mm.masked_mean(batch["x"] * params["w"], batch["mask"])

    def make(k: int) -> mm.GradFn[dict[str, jax.Array], dict[str, jax.Array]]:
        return mm.microbatched_value_and_grad(loss_fn, k, per_leaf_stats=False)

    batch = {"x": jnp.arange(4.0), "mask": jnp.ones(4, bool)}
    (_, count), grads = make(2)({"w": jnp.ones(())}, batch)
    assert int(count) == 4 and grads["w"].shape == ()
    plain = mm.microbatched_value_and_grad(
        loss_fn, 2, with_stats=False, per_leaf_stats=False
    )
    assert_type(plain, mm.GradFn[dict[str, jax.Array], Any])
    (_, count), _ = plain({"w": jnp.ones(())}, batch)
    assert int(count) == 4
    either = mm.microbatched_value_and_grad(loss_fn, 2, with_stats=np.bool_(True))
    assert len(either({"w": jnp.ones(())}, batch)) == 3


def test_gradients_with_respect_to_a_filter_are_typed_as_a_state():
    """With ``wrt=``, the gradients are an ``nnx.State`` of the selected
    variables, not the module: typed ``Any``, not the module's class."""

    def loss_fn(model: nnx.LoRA, batch: dict[str, jax.Array]) -> Any:
        return mm.masked_mean(jnp.sum(model(batch["x"]), -1), batch["mask"])

    base = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    model = nnx.LoRA(2, 1, 2, base_module=base, rngs=nnx.Rngs(1))
    batch = {"x": jnp.ones((4, 2)), "mask": jnp.ones(4, bool)}
    grad_fn = mm.microbatched_value_and_grad(loss_fn, 2, wrt=nnx.LoRAParam)
    _, grads = grad_fn(model, batch)
    assert_type(grads, Any)
    state: nnx.State = grads
    assert isinstance(state, nnx.State) and len(nnx.to_flat_state(state)) == 2
    _, whole = mm.microbatched_value_and_grad(loss_fn, 2)(model, batch)
    assert_type(whole, nnx.LoRA)  # a module of parameters, passed whole
    # With statistics, three values, the statistics typed as without wrt.
    stats_fn = mm.microbatched_value_and_grad(
        loss_fn, 2, with_stats=True, wrt=nnx.LoRAParam
    )
    _, _, stats = stats_fn(model, batch)
    assert_type(stats, mm.WindowStats[jax.Array])
    with pytest.raises(ValueError, match="too many values to unpack"):
        (_, _), _ = stats_fn(model, batch)  # pyright: ignore[reportAssignmentType]


def test_a_misspelt_public_name_is_reported_by_the_checker():
    with pytest.raises(AttributeError, match="window_statss"):
        mm.window_statss  # pyright: ignore[reportAttributeAccessIssue]  # noqa: B018


def test_data_parallel_value_and_grad_is_typed_like_microbatched_value_and_grad():
    def loss_fn(
        params: dict[str, jax.Array], batch: dict[str, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        return mm.masked_mean(batch["x"] * params["w"], batch["mask"])

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    batch = {"x": jnp.arange(16.0), "mask": jnp.arange(16) % 3 != 0}
    params = {"w": jnp.ones(())}
    grad_fn = mm.data_parallel_value_and_grad(loss_fn, mesh, "data")
    (_, count), grads = grad_fn(params, batch)
    assert_type(grads, dict[str, jax.Array])  # the params' type
    stats_fn = mm.data_parallel_value_and_grad(loss_fn, mesh, "data", with_stats=True)
    (_, count), grads, stats = stats_fn(params, batch)
    assert_type(grads, dict[str, jax.Array])
    assert_type(stats, mm.WindowStats[jax.Array])
    assert int(stats.tokens) == int(count) == 10
    # Per device: the same typed `loss_fn`; each gradient leaf gains the
    # device axis, the pytree keeps the params' type.
    per_device = mm.per_device_value_and_grad(loss_fn, mesh, "data")
    (_, counts), grads = per_device(params, batch)
    assert_type(grads, dict[str, jax.Array])
    assert grads["w"].shape == (8,) and int(counts.sum()) == 10


def test_window_rules_are_typed():
    # Every form of the window arguments type-checks; a string budget does not.
    adam = optax.adam(1e-3)
    rules = [
        mm.MaskedMultiSteps(adam, tokens_per_window=4096),
        mm.MaskedMultiSteps(adam, 16, tokens_per_window=lambda seen: 1024 + seen / 8),
        mm.MaskedMultiSteps(
            adam,
            tokens_per_window=mm.token_budget(
                lambda step: jnp.where(step < 10, 1024, 4096), by="gradient_step"
            ),
        ),
        mm.MaskedMultiSteps(adam, 32, norm_test=0.5),
        mm.MaskedMultiSteps(adam, norm_test=mm.norm_test(0.5, max_tokens=65536)),
    ]
    for tx in rules:
        assert_type(tx.init({"w": jnp.zeros(())}), mm.MaskedMultiStepsState)
    assert_type(mm.token_budget(4096), mm.WindowPolicy)
    lr = mm.tokens_schedule(optax.linear_schedule(0.0, 1.0, 4096), 1024)
    assert float(lr(jnp.asarray(2))) == 0.5
    # What it is for: an optax learning rate (a `Schedule`).
    schedule: optax.Schedule = lr
    mm.MaskedMultiSteps(optax.adamw(learning_rate=lr), 4).init({"w": jnp.zeros(())})
    del schedule
    with pytest.raises(TypeError, match="tokens_per_window"):
        mm.MaskedMultiSteps(adam, tokens_per_window="4096")  # pyright: ignore[reportArgumentType]
    # optax.MultiSteps' later arguments by position: keyword-only here.
    with pytest.raises(TypeError, match="by position and the rest by keyword"):
        mm.MaskedMultiSteps(adam, 4, True)  # pyright: ignore[reportArgumentType]


def test_numpy_scalars_type_check_where_numbers_are_taken():
    # Settings read from a config with numpy, or taken from an array: what the
    # checks accept at run time, the annotations accept too.
    k, budget, theta = np.int64(4), np.float64(4096.0), np.float32(0.5)
    adam = optax.adam(1e-3)
    txs = [
        mm.MaskedMultiSteps(adam, k, window_stats=np.bool_(True)),
        mm.MaskedMultiSteps(adam, k, stats_decay=np.float32(0.9), window_stats=True),
        mm.MaskedMultiSteps(adam, tokens_per_window=budget),
        mm.MaskedMultiSteps(adam, tokens_per_window=np.int64(4096)),
        mm.MaskedMultiSteps(adam, k, norm_test=theta),
        mm.MaskedMultiSteps(
            adam,
            norm_test=mm.norm_test(
                theta,
                min_tokens=np.int64(16),
                min_microbatches=np.int32(2),
                max_tokens=budget,
                max_microbatches=k,
            ),
        ),
        mm.MaskedMultiSteps(
            adam, tokens_per_window=mm.token_budget(budget, max_microbatches=k)
        ),
    ]
    for tx in txs:
        assert_type(tx.init({"w": jnp.zeros(())}), mm.MaskedMultiStepsState)
    lr = mm.tokens_schedule(optax.linear_schedule(0.0, 1.0, 4096), np.int64(1024))
    assert float(lr(jnp.asarray(2))) == 0.5

    def loss(params: jax.Array, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jnp.mean(params * batch), jnp.asarray(batch.size)

    grad_fn = mm.microbatched_value_and_grad(loss, k, has_aux=np.bool_(False))
    (_, count), grads = grad_fn(jnp.ones(()), jnp.ones(8))
    assert int(count) == 8 and grads.shape == ()


def test_typed_loss_fn_with_rng_for_microbatched_value_and_grad():
    # `loss_fn` takes the per-microbatch key as a third argument; the returned
    # function takes `rng=` and still types the gradients like the params.
    def loss_fn(
        params: dict[str, jax.Array], batch: dict[str, jax.Array], rng: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        keep = jax.random.bernoulli(rng, 0.5, batch["x"].shape)
        return mm.masked_mean(batch["x"] * params["w"] * keep, batch["mask"])

    grad_fn = mm.microbatched_value_and_grad(loss_fn, 2)
    batch = {"x": jnp.arange(4.0), "mask": jnp.array([True, True, False, True])}
    key = jax.random.key(0)
    (_, count), grads = grad_fn({"w": jnp.ones(())}, batch, rng=key)
    assert_type(grads, dict[str, jax.Array])
    assert int(count) == 3
    assert jnp.array_equal(
        grads["w"], grad_fn({"w": jnp.ones(())}, batch, rng=key)[1]["w"]
    )


def test_wrong_usage_is_reported_by_the_checker_and_fails_at_run_time():
    # Each `# pyright: ignore[...]` must be needed (see the module docstring).
    with pytest.raises(TypeError, match="optax GradientTransformation"):
        mm.MaskedMultiSteps("adam", 2)  # pyright: ignore[reportArgumentType]
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2)
    params = {"w": jnp.zeros(())}
    state = tx.init(params)
    with pytest.raises(AttributeError, match="gradient_steps"):
        state.gradient_steps  # pyright: ignore[reportAttributeAccessIssue]  # noqa: B018
    with pytest.raises(TypeError, match="must be the MaskedMultiStepsState"):
        tx.apply_gradients(
            params,
            params,  # pyright: ignore[reportArgumentType]
            params,
            count=1,
        )

    def loss_fn(
        params: dict[str, jax.Array], batch: dict[str, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        return mm.masked_mean(batch["x"] * params["w"], batch["mask"])

    grad_fn = mm.microbatched_value_and_grad(loss_fn, 2)
    batch = {"x": jnp.arange(4.0), "mask": jnp.ones(4, bool)}
    with pytest.raises(TypeError, match="string indexing"):
        grad_fn(jnp.ones(()), batch)  # pyright: ignore[reportArgumentType]
    # A misspelt keyword, and no token count.
    with pytest.raises(TypeError, match="'window_stat': did you mean 'window_stats'"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, window_stat=True)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="count"):
        tx.apply_gradients(params, state, params)  # pyright: ignore[reportCallIssue]
    with pytest.raises(TypeError, match="needs the microbatch's token count"):
        tx.update(params, state, params, count=None)  # pyright: ignore[reportArgumentType]
    train_state = mm.TrainState.create(apply_fn=None, params=params, tx=tx)
    with pytest.raises(TypeError, match="count"):
        train_state.apply_gradients(grads=params)  # pyright: ignore[reportCallIssue]
    with pytest.raises(ValueError, match="`by` must be one of"):
        mm.token_budget(lambda seen: 10.0, by="tokens")  # pyright: ignore[reportArgumentType]


def test_train_state_subclasses_keep_their_type():
    class WithStep(mm.TrainState):
        microbatches: int = 0

    tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2)
    state = WithStep.create(apply_fn=None, params={"w": jnp.zeros(())}, tx=tx)
    state = assert_type(
        state.apply_gradients(grads={"w": jnp.ones(())}, count=1), WithStep
    )
    assert isinstance(state, WithStep) and state.microbatches == 0


def test_migration_takes_an_optax_state_as_optax_types_it():
    params = {"w": jnp.zeros(())}
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2)

    # flax's TrainState.opt_state is an optax.OptState, not a MultiStepsState.
    def convert(opt_state: optax.OptState) -> mm.MaskedMultiStepsState:
        return mm.from_optax_multisteps(opt_state, tx, params)

    old = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
    assert int(convert(old.init(params)).mini_step) == 0


def test_token_total_value_is_a_float64_scalar_or_array():
    seen = mm.window_stats(
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, window_stats=True).init(jnp.zeros(2))
    ).tokens_seen
    value = seen.value()
    assert_type(value, "np.float64 | np.ndarray")
    assert isinstance(value, np.float64)


def _typecheck_readme(readme: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """tools/typecheck.py on ``readme``'s python blocks (and one small module)."""
    return subprocess.run(
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
        ),
        encoding="utf-8",
    )
    result = _typecheck_readme(readme)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "README.md:11:" in result.stdout, result.stdout
    assert "(2 README blocks), 1 errors" in result.stdout, result.stdout


def _load_typecheck() -> Any:
    spec = importlib.util.spec_from_file_location("typecheck", TYPECHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_typecheck_fails_on_a_readme_without_python_blocks(tmp_path, capsys):
    # A README whose examples moved to another fence (or file) must not pass
    # as "nothing to check".
    readme = tmp_path / "README.md"
    readme.write_text(
        "# title\n\n```bash\npip install masked-multistep\n```\n", encoding="utf-8"
    )
    typecheck = _load_typecheck()
    assert typecheck.main(["--readme", str(readme)]) == 1
    assert "no ```python blocks" in capsys.readouterr().err


@pytest.mark.slow
def test_typecheck_fails_on_a_warning_in_a_readme_block(tmp_path):
    # An unused comparison (a `==` meant as an assert) is a warning in
    # pyright's standard mode; warnings fail the check too, at the README line.
    readme = tmp_path / "README.md"
    readme.write_text(
        textwrap.dedent(
            """\
            # title

            ```python
            x = 1
            ```

            ```python
            y = 2
            y == 3
            ```
            """
        ),
        encoding="utf-8",
    )
    result = _typecheck_readme(readme)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "README.md:9:1: warning:" in result.stdout, result.stdout
    assert "0 errors, 1 warnings" in result.stdout, result.stdout


@pytest.mark.parametrize("exit_code", [0, 3])
def test_typecheck_fails_when_pyright_gives_no_report(
    tmp_path, monkeypatch, capsys, exit_code
):
    # pyright that crashes (prints no JSON report), whatever its exit status:
    # the check fails and shows what it printed.
    fake = tmp_path / "pyright"
    # (In the locale's encoding: the kernel reads the shebang's path as bytes.)
    fake.write_text(
        f"#!{sys.executable}\nimport sys\n"
        f"print('node: crashed')\nsys.exit({exit_code})\n",
        encoding="locale",
    )
    fake.chmod(0o755)
    readme = tmp_path / "README.md"
    readme.write_text("```python\nx = 1\n```\n", encoding="utf-8")
    typecheck = _load_typecheck()
    monkeypatch.setattr(typecheck, "_pyright", lambda: str(fake))
    assert typecheck.main(["--readme", str(readme)]) == (exit_code or 1)
    assert "node: crashed" in capsys.readouterr().err
