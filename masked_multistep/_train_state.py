"""`TrainState`: flax linen's ``TrainState`` that passes token counts to ``tx``.

This module needs flax, an optional dependency (``pip install ".[flax]"`` from
a checkout, or ``pip install flax``). The package imports it lazily, on first access of
``masked_multistep.TrainState``, so ``import masked_multistep`` neither needs flax
nor pays for importing it.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Self, cast

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import optax

from masked_multistep import _inner
from masked_multistep._checks import (
    OWN_KEYWORDS,
    close_flag,
    first_three,
    guessed_keyword,
    in_series,
    instances_in,
    refuse_state_as_params,
    to_count,
)
from masked_multistep._inspect import (
    find_boxed,
    has_deferred_reduction,
    state_paths,
    unboxed,
)
from masked_multistep._multisteps import MaskedMultiSteps
from masked_multistep._reduction import Local
from masked_multistep._state import MaskedMultiStepsState, states_in

try:
    from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
    from flax.training import train_state as _flax_train_state
except ImportError as err:
    raise ImportError(
        "masked_multistep.TrainState needs flax, which is not installed: "
        "`pip install flax`, or from a checkout of masked_multistep "
        '`pip install ".[flax]"` (`make test` installs it too).'
    ) from err

__all__ = ["TrainState"]


_OPTAX_MULTISTEPS = (
    "`tx` accumulates with optax.MultiSteps, which ignores `count` (it averages "
    "the microbatches' mean gradients with equal weights): use "
    "mm.MaskedMultiSteps(inner, k) (a running state converts with "
    "mm.from_optax_multisteps)."
)


def _refuse_unknown_fields(
    cls: type, method: str, kwargs: Mapping[str, Any], keywords: list[str], more: str
) -> None:
    """A ``TypeError`` for keywords in ``kwargs`` that are not fields of
    ``cls`` (``keywords``: the method's own, offered as fixes too): a
    misspelling gets its likely fix; another name, how to add a field."""
    field_names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in kwargs if k not in field_names]
    if not unknown:
        return
    meant = guessed_keyword(unknown[0])
    if meant in keywords:
        close = [meant]
    else:
        close = difflib.get_close_matches(
            unknown[0], [*keywords, *field_names], n=1, cutoff=0.8
        )
    hint = (
        f" Did you mean {close[0]!r}?"
        if close
        else " A field of your own needs a subclass, e.g. `class "
        f"State(mm.TrainState): {unknown[0]}: Any = None`."
    )
    raise TypeError(
        f"{cls.__name__}.{method} got unexpected keyword argument(s) "
        f"{', '.join(map(repr, unknown))}: not a field of {cls.__name__} "
        f"(fields: {', '.join(field_names)}).{hint}{more}"
    )


class TrainState(_flax_train_state.TrainState):
    """``flax.training.train_state.TrainState`` for token-weighted accumulation.

    A drop-in subclass: same fields (``step``, ``apply_fn``, ``params``, ``tx``,
    ``opt_state``) and the same :meth:`create`. Only :meth:`apply_gradients`
    differs: it takes the microbatch's token ``count`` (and optionally its mean
    loss ``value``) and hands them to the optimizer. flax's own
    ``apply_gradients`` calls ``tx.update(grads, opt_state, params)`` with no
    extra arguments, so a :class:`MaskedMultiSteps` inside it cannot weight the
    microbatches.

    ``tx`` may be

    * a :class:`MaskedMultiSteps`: its fused ``apply_gradients`` is used, so on
      microbatches that do not end a window the params pass through untouched
      (no tree of zero updates is added to them);
    * any optax transformation, e.g. ``optax.chain(..., mm.MaskedMultiSteps(...))``
      (the wrapper in the chain as it is): ``tx.update(grads,
      opt_state, params, count=count, value=value, ...)`` followed by
      ``optax.apply_updates``. Transformations that take no extra arguments
      ignore them, as inside ``optax.chain``; a ``tx`` with no wrapper in it
      at all accumulates nothing, and :meth:`create` warns.

    ``step`` keeps flax's meaning: it counts calls of :meth:`apply_gradients`,
    i.e. *microbatches*. The number of optimizer updates applied is
    :attr:`gradient_step`.

    Examples:
      A window of two microbatches with 3 and 1 tokens; the params move once, by
      the token-weighted mean gradient ``(3·1 + 1·5) / 4 = 2``:

      >>> import jax.numpy as jnp
      >>> import optax
      >>> import masked_multistep as mm
      >>> state = mm.TrainState.create(
      ...     apply_fn=None, params={"w": jnp.zeros(())},
      ...     tx=mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2))
      >>> for g, n in [(1.0, 3), (5.0, 1)]:
      ...     state = state.apply_gradients(grads={"w": jnp.array(g)},
      ...                                   count=jnp.array(n))
      >>> print(state.params["w"], state.step, state.gradient_step)
      -2.0 2 1
    """

    @classmethod
    def create(
        cls,
        *,
        apply_fn: Any,
        params: Any,
        tx: optax.GradientTransformation,
        step: jax.typing.ArrayLike | None = None,
        opt_state: optax.OptState | None = None,
        **kwargs: Any,
    ) -> Self:
        """flax's ``TrainState.create``, which may also continue a run: ``step``
        and ``opt_state`` (e.g. from :func:`from_optax_multisteps` or
        :func:`from_other_settings`) in place of 0 and ``tx.init(params)``,
        with the checks below run on them and ``step`` placed as
        :meth:`apply_gradients` returns it, from the host or any device (a
        converted run's first step compiles once). ``step`` must be a whole
        number in int32's range (else a ``TypeError`` or ``ValueError``
        naming it); ``opt_state`` must have the structure and leaf shapes of
        the state ``tx.init(params)`` would build (checked abstractly: no
        second state is built; else a ``ValueError`` naming the first leaf
        apart), and is taken as it is laid out (restore it onto
        ``tx.init``'s layout, as orbax does against that template). A ``tx``
        that is no optimizer (None,
        or a class) is a ``TypeError`` that says to build the optimizer (its
        ``init`` would fail with an error of Python's own), and so is a ``tx``
        that accumulates with ``optax.MultiSteps`` (which would ignore every
        ``count``) or holds two :class:`MaskedMultiSteps` in series (one after
        the other in a chain; in different branches of
        ``optax.multi_transform`` they are fine). So are ``params=None`` or a
        state in their place (a ``TrainState``, the wrapper's state), and a
        keyword that is no field of the class (with the field's likely
        spelling, or how to add a field in a subclass).

        A ``UserWarning`` names the transformations chained before or after
        the wrapper (in ``optax.chain`` or ``optax.named_chain``, or around
        it in its ``optax.partition`` group), but for linear, stateless ones
        (and ``zero_nans`` before it): they run on every microbatch, not once
        per window on its mean (clipping there clips each microbatch)."""
        if isinstance(tx, type):
            raise TypeError(
                f"`tx` must be an optimizer, got the class {tx.__name__}: build "
                "one, e.g. mm.MaskedMultiSteps(optax.adam(1e-3), every_k_schedule=4)"
            )
        _inner.check_opt(tx, "tx")
        if params is None:
            raise TypeError(
                "`params` must be the model's parameters (a pytree of arrays), got None"
            )
        refuse_state_as_params(params)
        _refuse_unknown_fields(cls, "create", kwargs, [], "")
        # What the optimizer steps: flax's fp8 params hold them under "params".
        # (flax's own `create` tests `in params` on any params: "argument of
        # type 'MLP' is not iterable" for an Equinox module's, or a scalar.)
        with_opt = (
            params["params"]
            if isinstance(params, Mapping) and OVERWRITE_WITH_GRADIENT in params
            else params
        )
        if opt_state is None:
            opt_state = tx.init(with_opt)
        else:
            # Checked against what `tx.init` would build (abstractly: a run
            # continued at scale has no memory for a second state).
            _check_opt_state(opt_state, jax.eval_shape(tx.init, with_opt))
        state = cls(
            step=0,
            apply_fn=apply_fn,
            params=cast(Any, params),
            tx=tx,
            opt_state=opt_state,
            **kwargs,
        )
        # `step` placed where `apply_gradients` returns it (replicated on the
        # params' mesh, or on their one device), as `tx.init` places its own
        # scalars: flax's Python int 0 (or a restored run's step, on the host
        # or on other devices) would make the first step's inputs differ from
        # every later step's, and a jitted step compile twice (or fail).
        step = jnp.asarray(0 if step is None else _checked_step(step), jnp.int32)
        state = state.replace(step=Local().place(step, params))
        if states_in(state.opt_state, optax.MultiStepsState):
            raise TypeError(_OPTAX_MULTISTEPS)
        found = instances_in(state.opt_state, MaskedMultiStepsState)
        pair = in_series(found)
        if pair is not None:
            raise TypeError(
                f"`tx` holds two MaskedMultiSteps one after the other (their "
                f"states at opt_state{pair[0]} and opt_state{pair[1]}): the "
                "second would average the first's in-window zero updates as "
                "microbatches. Use one wrapper, with every transformation that "
                "should run once per window inside it: "
                "mm.MaskedMultiSteps(optax.chain(...), k)"
            )
        if not found:
            # Plain optax: `count` and `close_window` would go nowhere, and
            # every microbatch would step the params on its own.
            warnings.warn(
                "`tx` holds no mm.MaskedMultiSteps: "
                "apply_gradients then ignores `count` and `close_window` and "
                "updates the params on every call, accumulating nothing. To "
                "accumulate microbatches across calls, wrap the optimizer: "
                "mm.MaskedMultiSteps(optimizer, k). Where each call's gradient "
                "already covers a whole window (mm.microbatched_value_and_grad), "
                "use flax's own TrainState, or mm.MaskedMultiSteps(optimizer, 1) "
                "to keep gradient_step",
                UserWarning,
                stacklevel=2,
            )
        _warn_chained_around(
            tx, deferred=any(has_deferred_reduction(x) for _, x in found)
        )
        return cast(Self, state)

    def _apply_gradients(
        self,
        *args: Any,
        grads: optax.Updates | None = None,
        count: jax.typing.ArrayLike | None = None,
        value: jax.typing.ArrayLike | None = None,
        close_window: jax.typing.ArrayLike | None = None,
        extra_args: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Self:
        """Folds in one microbatch's gradients; updates the params at a window's end.

        Args:
          grads: the microbatch's *mean* gradients, with the structure of
            ``params`` (as in flax, ``{"params": ..., OVERWRITE_WITH_GRADIENT:
            ...}`` for fp8 params is supported: those variables take the
            microbatch's value, as in flax, on every microbatch, one without
            tokens included; hold them with ``jnp.where(count > 0, new, old)``
            if an empty microbatch's must not count).
          count: the number of real tokens behind ``grads`` (a scalar; pass a
            ``jax.Array``, e.g. the count from :func:`masked_mean`, to a jitted
            step). Required.
          value: optionally the microbatch's mean loss; token-averaged by
            :class:`MaskedMultiSteps` and passed to its inner optimizer as
            ``value=`` at the end of the window.
          close_window: ``True`` to end the window with this microbatch
            whatever its rule says (the last microbatch of the data), as
            :meth:`MaskedMultiSteps.update` takes it.
          extra_args: further keyword arguments for the optimizer's update
            (e.g. ``{"scale": s}`` for an inner optimizer that takes
            ``scale=``); a :class:`MaskedMultiSteps` hands them to its inner
            optimizer at the end of the window, as the closing call passes
            them, except a line search's ``grad=``, which becomes the window's
            mean gradient (and ``value=`` the window's loss).
          **kwargs: fields of this dataclass, ``replace``-d as in flax (e.g.
            ``batch_stats=`` on a subclass).

        Returns:
          The new state, with ``step`` incremented by one.

        Raises:
          TypeError: if ``grads`` or ``count`` is missing, an argument is
            passed by position, a keyword is neither a field nor
            one of the above (a misspelt field would otherwise vanish), or is
            ``step``, ``params`` or ``opt_state``, which this method sets; if
            ``tx`` accumulates with ``optax.MultiSteps``, which would ignore
            ``count``; and as :meth:`MaskedMultiSteps.update` raises for
            ``count``, ``value`` and the gradients.
          ValueError: as :meth:`MaskedMultiSteps.update`.

        Examples:
          Two microbatches of 3 and 1 tokens, mean gradients 1 and 5: the window's
          update is sgd's on their token mean, ``(3·1 + 1·5) / 4 = 2``:

          >>> import jax.numpy as jnp, optax
          >>> import masked_multistep as mm
          >>> state = mm.TrainState.create(
          ...     apply_fn=None, params=jnp.zeros(()),
          ...     tx=mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2))
          >>> for g, n in [(1.0, 3), (5.0, 1)]:
          ...     state = state.apply_gradients(grads=jnp.array(g), count=jnp.array(n))
          >>> print(state.params, int(state.step), int(state.gradient_step))
          -2.0 2 1
        """
        if args:
            # Python's own "takes 1 positional argument but 3 were given".
            raise TypeError(
                f"{type(self).__name__}.apply_gradients takes keyword arguments "
                f"only, as flax's does, got {len(args)} positional: call "
                "`state.apply_gradients(grads=grads, count=n)`"
            )
        own = [k for k in ("step", "params", "opt_state") if k in kwargs]
        if own:
            raise TypeError(
                f"{type(self).__name__}.apply_gradients got "
                f"{', '.join(f'`{k}=`' for k in own)}, set by apply_gradients "
                "itself: to give a field a value of your own, call "
                f"`state.replace({own[0]}=...)`."
            )
        if "tx" in kwargs:
            # flax's would apply this step with the old `tx`, then pair the new
            # one with the old one's state (the next step fails in optax).
            raise TypeError(
                f"{type(self).__name__}.apply_gradients got `tx=`: a new "
                "optimizer needs its own state. Replace both, "
                "`state.replace(tx=new_tx, opt_state=new_tx.init(state.params))`, "
                "or build the state again with create"
            )
        _refuse_unknown_fields(
            type(self),
            "apply_gradients",
            kwargs,
            ["grads", *OWN_KEYWORDS, "extra_args"],
            " Arguments for the optimizer go in `extra_args={...}`.",
        )
        # (After the keywords' checks: a misspelt `grad=` is named there.)
        if grads is None:
            raise TypeError(
                f"{type(self).__name__}.apply_gradients needs the microbatch's "
                "gradients: call `state.apply_gradients(grads=grads, count=n)`"
            )
        if count is None:
            raise TypeError(
                f"{type(self).__name__}.apply_gradients needs the microbatch's "
                "token count: call `state.apply_gradients(grads=grads, count=n)`, got "
                "count=None."
            )
        if not states_in(self.opt_state, MaskedMultiStepsState):
            # No wrapper reads it (a plain optimizer): still a number of
            # tokens, checked as the wrapper checks it (a loss or a mask
            # passed as the count is a mistake wherever it goes).
            to_count(count, jnp.dtype(jnp.float32))
        if extra_args is not None and not isinstance(extra_args, Mapping):
            raise TypeError(
                "`extra_args` must be a mapping of keyword arguments for the "
                f"optimizer's update, got {type(extra_args).__name__}"
            )
        extra_args = dict(extra_args or {})
        clash = [k for k in OWN_KEYWORDS if k in extra_args]
        if clash:
            raise TypeError(
                f"Pass {', '.join(clash)} to apply_gradients directly, not in "
                "`extra_args`."
            )
        replace = kwargs
        extra_args["count"] = count
        if value is not None:
            extra_args["value"] = value
        if close_window is not None:
            # Checked here too: a plain optimizer (no wrapper) would drop it.
            close_flag(close_window)
            extra_args["close_window"] = close_window

        # The gradients of fp8 params, `{"params": ..., OVERWRITE_WITH_GRADIENT: ...}`.
        owg: Mapping[Any, Any] | None = (
            grads
            if isinstance(grads, Mapping) and OVERWRITE_WITH_GRADIENT in grads
            else None
        )
        grads_with_opt = grads if owg is None else owg["params"]
        params_with_opt = self.params if owg is None else self.params["params"]

        if isinstance(self.tx, MaskedMultiSteps):
            # flax types `opt_state` as any pytree; a MaskedMultiSteps' is its state.
            opt_state = cast(MaskedMultiStepsState, self.opt_state)
            new_params_with_opt, new_opt_state = self.tx.apply_gradients(
                grads_with_opt, opt_state, params_with_opt, **extra_args
            )
        else:
            if states_in(self.opt_state, optax.MultiStepsState):
                # with_extra_args_support would drop the count silently.
                raise TypeError(_OPTAX_MULTISTEPS)
            tx = optax.with_extra_args_support(self.tx)
            try:
                updates, new_opt_state = tx.update(
                    grads_with_opt, self.opt_state, params_with_opt, **extra_args
                )
            except (ValueError, TypeError, AttributeError) as err:
                _note_other_state(err, self.tx, self.opt_state, params_with_opt)
                raise
            new_params_with_opt = optax.apply_updates(params_with_opt, updates)

        if owg is not None:
            # As in flax: fp8 "overwrite with gradient" variables take the
            # gradient itself as their new value.
            new_params = {
                "params": new_params_with_opt,
                OVERWRITE_WITH_GRADIENT: owg[OVERWRITE_WITH_GRADIENT],
            }
        else:
            new_params = new_params_with_opt
        _check_same_shapes(new_params, self.params)
        return self.replace(
            step=self.step + 1,
            params=new_params,
            opt_state=new_opt_state,
            **replace,
        )

    if not TYPE_CHECKING:
        apply_gradients = _apply_gradients
        _apply_gradients.__name__ = "apply_gradients"
        _apply_gradients.__qualname__ = "TrainState.apply_gradients"
    else:
        # What a type checker sees: `count` is required. At run time it
        # defaults to None, so that a missing or misspelt one gets this
        # class's own error, which says what to pass. (The run-time method is
        # defined under another name and aliased: mypy would keep a first
        # definition of the same name.)
        def apply_gradients(
            self,
            *,
            grads: optax.Updates,
            count: jax.typing.ArrayLike,
            value: jax.typing.ArrayLike | None = None,
            close_window: jax.typing.ArrayLike | None = None,
            extra_args: Mapping[str, Any] | None = None,
            **kwargs: Any,
        ) -> Self: ...

    @property
    def gradient_step(self) -> jax.Array:
        """The number of optimizer updates applied (windows that saw tokens and
        whose mean was finite: the inner optimizer ran on them).

        Read from the :class:`MaskedMultiStepsState` in ``opt_state``, which may
        be nested (e.g. inside ``optax.chain``).

        Raises:
          ValueError: if ``opt_state`` holds no :class:`MaskedMultiStepsState`,
            or more than one (in ``optax.multi_transform``'s branches, say: the
            error names where each is, to read with :func:`find_state`).
        """
        return self._multisteps_field("gradient_step")

    @property
    def mini_step(self) -> jax.Array:
        """The microbatches of the current window so far (0 right after a
        window closed), read as :attr:`gradient_step` is.

        Raises:
          ValueError: as :attr:`gradient_step`.
        """
        return self._multisteps_field("mini_step")

    def _multisteps_field(self, attribute: str) -> jax.Array:
        paths = state_paths(self.opt_state, "state.opt_state")
        if len(paths) > 1:
            # (A property takes no argument: say how to read each.)
            raise ValueError(
                f"TrainState.{attribute} reads the one MaskedMultiSteps state in "
                f"`opt_state`, which holds {len(paths)} (at "
                f"{', '.join(f'`{p}`' for p in paths)}): read the one you mean, "
                f"e.g. `mm.find_state({paths[0]}).{attribute}`"
            )
        try:
            return unboxed(getattr(find_boxed(self), attribute))
        except ValueError as err:
            tx = _inner.describe(self.tx)
            no_wrapper = (
                f"; this state's `tx` is {tx}, no MaskedMultiSteps: build the "
                "state with `tx=mm.MaskedMultiSteps(opt, every_k_schedule=k)`"
                if "MaskedMultiSteps(" not in tx
                else ""
            )
            raise ValueError(
                f"TrainState.{attribute} reads the MaskedMultiSteps state in "
                f"`opt_state`: {err}{no_wrapper}"
            ) from None


def _note_other_state(err: Exception, tx: Any, opt_state: Any, params: Any) -> None:
    """Adds a note to ``err`` (raised by ``tx.update``) where ``opt_state`` is
    not the state ``tx.init`` builds: a ``tx`` replaced without its state."""
    expected = _inner.init_structure(tx, params)
    if expected is not None and expected != jax.tree.structure(opt_state):
        err.add_note(
            "`opt_state` is not the state `tx.init` builds (a `tx` replaced "
            "without its state?): replace both, `state.replace(tx=new_tx, "
            "opt_state=new_tx.init(state.params))`, or carry a wrapper's running "
            "state over with mm.from_other_settings(state.opt_state, "
            "new_tx.init(state.params))"
        )


def _checked_step(step: Any) -> Any:
    """``step``, a whole number of microbatches applied, read to the host
    where it is a concrete array (so that it can be placed anew), or an
    error naming it."""
    not_an_integer = TypeError(
        "`step` must be an integer, the microbatches applied so far (the "
        f"run's `state.step`), got {step!r}"
    )
    if isinstance(step, jax.core.Tracer):
        value = step
    elif isinstance(step, jax.Array) and not step.is_fully_addressable:
        value = step  # a replicated step across processes: placed as it is
    else:
        try:
            value = np.asarray(step)
        except TypeError as err:  # a jax PRNG key
            raise not_an_integer from err
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise not_an_integer
    if jnp.shape(value) != ():
        raise ValueError(f"`step` must be a scalar, got shape {jnp.shape(value)}")
    if isinstance(value, np.ndarray) and not 0 <= int(value) <= np.iinfo(np.int32).max:
        raise ValueError(
            f"`step` must be in [0, 2**31 - 1] (an int32 counter), got {int(value)}"
        )
    return value


def _check_opt_state(opt_state: Any, want: Any) -> None:
    """A ``ValueError`` where ``opt_state`` is not of the structure and leaf
    shapes of ``want`` (``tx.init(params)``'s, abstract), naming the first
    difference."""
    if jax.tree.structure(opt_state) != jax.tree.structure(want):
        got, built = _inner.apart(opt_state, want, "opt_state")
        raise ValueError(
            "`opt_state` must be the state `tx.init(params)` builds for these "
            f"params: it builds {built}, got {got}"
        )
    got_leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    for (path, got), wanted in zip(got_leaves, jax.tree.leaves(want), strict=True):
        if jnp.shape(got) != wanted.shape:
            raise ValueError(
                f"`opt_state{jax.tree_util.keystr(path)}` has shape "
                f"{jnp.shape(got)} where `tx.init(params)` builds "
                f"{wanted.shape}: a state of other params"
            )


def _warn_chained_around(tx: Any, deferred: bool = False) -> None:
    """A ``UserWarning`` for transformations chained before or after the
    wrapper (``optax.chain(clip, tx)``), which run on every microbatch (with
    a ``deferred`` reduction, on every device's gradient, stacked)."""
    before, after = _inner.chained_around_wrapper(tx)
    said = []
    if before:
        seen = "each microbatch's gradient"
        if deferred:
            seen = (
                "each microbatch's gradients of every device, stacked "
                "(reduction=mm.deferred: a global norm is taken over all of them)"
            )
        said.append(
            f"{', '.join(before)} before MaskedMultiSteps: they see {seen}, not "
            "the window's mean (clipping there clips every microbatch, and the "
            "mean of clipped gradients is not the clipped mean)"
        )
    if after:
        said.append(
            f"{', '.join(after)} after "
            + ("it" if before else "MaskedMultiSteps")
            + ": they run on every microbatch, on "
            "zero updates between windows (weight decay moves the params, a "
            "schedule or an optimizer's moments count microbatches)"
        )
    if said:
        warnings.warn(
            "`tx` chains " + "; and ".join(said) + ". Put what should run once "
            "per window on the window's mean gradient inside the wrapper: "
            "mm.MaskedMultiSteps(optax.chain(clip, optimizer), k) (README, "
            '"Where gradient clipping goes")',
            UserWarning,
            stacklevel=3,
        )


def _check_same_shapes(new_params: Any, params: Any) -> None:
    """Refuses params whose leaves changed shape in a step: updates of another
    shape broadcast into them silently (``optax.apply_updates``)."""
    old = {
        jax.tree_util.keystr(path): jnp.shape(x)
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    changed = [
        f"params{key} {old[key]} -> {jnp.shape(x)}"
        for path, x in jax.tree_util.tree_flatten_with_path(new_params)[0]
        if (key := jax.tree_util.keystr(path)) in old and jnp.shape(x) != old[key]
    ]
    if changed:
        raise ValueError(
            "apply_gradients changed the shape of "
            f"{first_three(changed)}: the gradients of those params have "
            "another shape than the params. With reduction=mm.deferred(...) "
            "every gradient carries a leading device axis, which only the "
            "wrapper removes: a transformation outside it (a branch of "
            "optax.multi_transform without it) hands it on; keep the wrapper "
            "outermost, with every transformation inside it. flax's fp8 "
            "'overwrite with gradient' variables are not supported with the "
            "deferred reduction"
        )
