"""The window's conditional, in the form that keeps its state in place.

``MaskedMultiSteps`` runs the inner optimizer only when a window closes: a
conditional whose other branch passes the optimizer state, the accumulator and
the parameters through untouched. XLA:CPU and the TPU compiler keep those
buffers in place (the pass-through branch runs no kernel; read from compiled
programs, a TPU v5e's too), but XLA:GPU's default copy insertion (its
``xla_gpu_copy_insertion_use_region_analysis`` is off) copies every
pass-through buffer in that branch and copies the conditional's outputs again
into the step's donated outputs: for adam, 20 parameter-sized copies on every
microbatch, more memory traffic than the gradient itself on an optimizer-bound
step, and three parameter-sized temporaries. A ``while_loop`` that runs its
body at most once has no such copies (a loop's state is updated in place), so
that is what a GPU gets: a program traced while the default backend is a GPU
(``jax.default_backend()``; a program lowered for a GPU from a host whose
default is the CPU gets the conditional). Elsewhere it is the plain
``lax.cond``, but where jax cannot batch one (``vmap`` inside ``shard_map``
with a predicate that differs between the members: jax's batching rule fails
there, see :func:`cond`) the loop, which jax batches.

The loop cannot be differentiated in reverse mode, so it is a ``custom_jvp``
whose rule runs both branches and selects (the values computed beside the
derivatives too): a differentiated step costs both branches' derivatives, on
a GPU only, and works under ``vmap`` whatever branch each example takes (a
batched ``lax.cond`` in the rule would have no transpose).

A call outside any trace (an eager step) knows its predicate and runs the
taken branch alone, in neither form (``concrete_bool``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

__all__ = [
    "EagerMemo",
    "concrete_bool",
    "cond",
    "eager_key",
    "in_place_cond",
    "on_gpu",
    "staging",
]

S = TypeVar("S")

# "loop" or "cond" to choose the form whatever the backend (tests, and
# benchmarks that compile for a GPU without one); None: by the default backend.
FORM: Literal["loop", "cond"] | None = None


def _loop_form() -> bool:
    if FORM is not None:
        return FORM == "loop"
    return on_gpu()


def on_gpu() -> bool:
    """Whether the default backend, for which programs are traced, is a GPU."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def staging() -> bool:
    """Whether a jaxpr is being built here: under ``jit`` (``shard_map``
    inside it included), ``jax.eval_shape`` or a conditional's trace (also
    beneath ``vmap`` or a derivative taken inside them), not under an eager
    ``vmap``, derivative or ``shard_map`` alone.

    What is traced into a jaxpr may reuse jax's trace cache (a ``jax.jit``
    called again on arguments of the same types inlines its first trace);
    what runs one by one would compile such a ``jax.jit`` afresh on every
    call. (jax's own test, ``unsafe_am_i_under_a_jit``; False where a jax
    lacks it.)

    Example:
      >>> import jax, jax.numpy as jnp
      >>> _ = jax.jit(lambda x: print(staging()) or x)(jnp.ones(2))
      True
      >>> _ = jax.vmap(lambda x: print(staging()) or x)(jnp.ones(2))
      False
    """
    try:
        from jax._src import core  # noqa: PLC0415 -- jax's private module
    except ImportError:
        return False
    probe = getattr(core, "unsafe_am_i_under_a_jit", None)
    return bool(probe()) if probe is not None else False


def concrete_bool(pred: Any) -> bool | None:
    """``pred``'s value where it is known outside any trace, else None.

    A step called without ``jit`` (eagerly) knows which branch it takes, and
    takes only that one: ``lax.cond`` would trace and compile both branches
    into a program of their own on every such call (its branches are new
    closures each time), some 0.2 s per microbatch, where running the taken
    branch's operations one by one reuses their compiled kernels. Under
    ``jit`` or ``vmap``, or where it depends on what a derivative is taken
    with respect to, the predicate is a tracer, and the conditional stays (an
    eager derivative whose windows the counts decide goes through the taken
    branch alone, as the conditional's would).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> concrete_bool(jnp.bool_(True))
      True
      >>> jax.jit(lambda p: print(concrete_bool(p)))(jnp.bool_(True))
      None
    """
    if isinstance(pred, jax.core.Tracer):
        return None
    if isinstance(pred, jax.Array) and not pred.is_fully_addressable:
        return None  # spans other processes: not readable here alone
    return bool(pred)


def eager_key(*parts: Any) -> Any:
    """A hashable key of ``parts`` by their abstract values (structure, shapes,
    dtypes, weak types, shardings; a number or string by value), or None where
    a part is traced (under ``jit``, ``vmap``, a derivative or ``shard_map``,
    where what is computed from it can depend on the trace's context) or is
    any other object (which could change between calls under the same key).

    What an eager step derives from its arguments' abstract values alone (the
    window's ``jax.eval_shape`` calls, which trace the inner optimizer) can be
    remembered under this key instead of traced again on every call.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> eager_key({"w": jnp.ones(2)}, 3) == eager_key({"w": jnp.zeros(2)}, 3)
      True
      >>> jax.jit(lambda x: print(eager_key(x)))(jnp.ones(2))
      None
    """
    leaves, treedef = jax.tree.flatten(parts)
    key = []
    for x in leaves:
        if isinstance(x, jax.core.Tracer):
            return None
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            try:
                key.append(jax.typeof(x))
            except TypeError:  # no jax type (a numpy string or object)
                return None
        elif isinstance(x, (bool, int, float, complex, str, bytes)):
            key.append((type(x), x))
        else:
            return None
    try:
        hash(treedef)  # a custom node's auxiliary data may not be hashable
    except TypeError:
        return None
    return treedef, tuple(key)


class EagerMemo:
    """What was derived from abstract values, under hashable keys (an eager
    step's, under :func:`eager_key`'s): the newest ``size`` entries (the
    oldest goes).

    Threads stepping one wrapper at once share it: each read and each write
    holds a lock, so one thread's eviction never fails another's lookup.

    Example:
      >>> memo = EagerMemo(size=1)
      >>> memo.put("a", 1); memo.put("b", 2)
      >>> memo.get("a"), memo.get("b"), memo.get(None)
      (None, 2, None)
    """

    def __init__(self, size: int = 16):
        self._size = size
        self._entries: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        """The value put under ``key``, or None (also for a None key)."""
        if key is None:
            return None
        with self._lock:
            return self._entries.get(key)

    def put(self, key: Any, value: Any) -> None:
        """Remembers ``value`` under ``key`` (a None key: nothing)."""
        if key is None:
            return
        with self._lock:
            self._entries.pop(key, None)
            while len(self._entries) >= self._size:
                del self._entries[next(iter(self._entries))]
            self._entries[key] = value


def cond(pred: Any, true_fn: Callable, false_fn: Callable, *operands: Any) -> Any:
    """``lax.cond``, but a predicate known outside any trace runs its branch
    alone (:func:`concrete_bool`).

    Example:
      >>> import jax.numpy as jnp
      >>> cond(jnp.bool_(False), lambda x: x + 1, lambda x: x - 1, jnp.int32(0))
      Array(-1, dtype=int32)
    """
    taken = concrete_bool(pred)
    if taken is not None:
        return (true_fn if taken else false_fn)(*operands)
    try:
        return jax.lax.cond(pred, true_fn, false_fn, *operands)
    except ValueError as err:
        if "pvary is a invariant->variant collective" not in str(err):
            raise
        raise CondBatchingError(
            "jax could not batch a conditional of the wrapper: `jax.vmap` of a "
            "`lax.cond` whose predicate differs between the members, inside "
            "`jax.shard_map`, fails in jax's own batching rule (jax 0.10.2 to "
            "0.12, any branch that combines a value the same on every shard "
            "with one that is not). Ensemble members with a state of their "
            "own each (nothing split over the mesh axis) train correctly with "
            "`jax.shard_map(..., check_vma=False)`"
        ) from err


class CondBatchingError(ValueError):
    """jax's batching of ``lax.cond`` failed inside ``shard_map`` (see
    :func:`cond`)."""


def in_place_cond(
    pred: jax.Array,
    true_fn: Callable[..., tuple[S, Any]],
    false_fn: Callable[..., Any],
    state: S,
    *operands: Any,
) -> tuple[S, Any]:
    """``true_fn(state, *operands)`` if ``pred``, else ``(state, false_fn(state,
    *operands))``: ``state`` updated in place by the taken branch, passed
    through by the other.

    ``true_fn`` returns ``(new_state, extra)`` with ``new_state`` of ``state``'s
    structure, shapes and dtypes; ``false_fn`` returns only an ``extra`` of the
    same structure as ``true_fn``'s (it cannot change ``state``).

    Example:
      >>> import jax.numpy as jnp
      >>> step = lambda s, g: (s - g, jnp.bool_(True))
      >>> hold = lambda s, g: jnp.bool_(False)
      >>> in_place_cond(jnp.bool_(True), step, hold, jnp.ones(2), jnp.ones(2))
      (Array([0., 0.], dtype=float32), Array(True, dtype=bool))
      >>> in_place_cond(jnp.bool_(False), step, hold, jnp.ones(2), jnp.ones(2))
      (Array([1., 1.], dtype=float32), Array(False, dtype=bool))
    """
    pred = jnp.asarray(pred, jnp.bool_)
    args = (state, *operands)
    if not _loop_form() or concrete_bool(pred) is not None:
        try:
            return cond(
                pred, lambda a: true_fn(*a), lambda a: (a[0], false_fn(*a)), args
            )
        except CondBatchingError:
            # Batched inside shard_map, where jax's batching of `lax.cond`
            # fails: the loop form, whose batching works there, instead.
            pass
    # Every value the branches close over (tracers of enclosing transformations
    # included, integer ones too) becomes an argument of the custom_jvp, so that
    # its rule differentiates with respect to them and no trace leaks into it.
    true_c, true_consts = _closure_converted(true_fn, args)
    false_c, false_consts = _closure_converted(false_fn, args)
    return _loop(true_c, false_c, pred, (true_consts, false_consts), args)


def _closure_converted(fn: Callable[..., Any], args: tuple) -> tuple[Callable, list]:
    """``fn`` as a function of ``(consts, *args)``, and its closed-over consts."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    out_tree = jax.tree.structure(out_shape)
    # The function keeps a jaxpr without consts, its constvars made leading
    # invars: the consts are tracers of the enclosing trace, which would
    # outlive it (`jax.checking_leaks`) wherever jax keeps the function (newer
    # jax's jaxprs hold their consts themselves).
    open_jaxpr = closed.jaxpr.replace(
        constvars=[], invars=[*closed.jaxpr.constvars, *closed.jaxpr.invars]
    )

    def converted(consts: list, *args: Any) -> Any:
        flat = jax.core.eval_jaxpr(open_jaxpr, [], *consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(out_tree, flat)

    return converted, list(closed.consts)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _loop(true_c, false_c, pred, consts, args):
    t, f = consts
    state, *operands = args

    def body(carry):
        again, state, _ = carry
        new_state, extra = true_c(t, state, *operands)
        # False, typed as the predicate (inside shard_map, one that differs
        # between shards is varying, and the loop's carry must keep its type).
        return again & False, new_state, extra

    init = (pred, state, false_c(f, *args))
    _, state, extra = jax.lax.while_loop(lambda c: c[0], body, init)
    return state, extra


@_loop.defjvp
def _loop_jvp(true_c, false_c, primals, tangents):
    # A while loop has no derivatives in reverse mode, and the conditional's
    # cannot serve under `vmap`: a batched `lax.cond` runs both branches and
    # hides each branch's operands from the other behind `stop_gradient`,
    # which reverse mode cannot transpose when those operands are tangents (as
    # they are inside this rule). So both branches run here, each seeing the
    # tangents only where it is taken (a `where`, which transposes):
    # cotangents reach neither branch where it is not taken, even through a
    # NaN in its derivative.
    pred, (t, f), args = primals
    _, (dt, df), dargs = tangents

    def only_where(take: jax.Array, tree: Any) -> Any:
        return jax.tree.map(
            lambda d: d if _is_float0(d) else jnp.where(take, d, jnp.zeros_like(d)),
            tree,
        )

    def select(a: Any, b: Any) -> Any:
        return jax.tree.map(
            lambda x, y: x if _is_float0(x) else jnp.where(pred, x, y), a, b
        )

    taken, d_taken = jax.jvp(
        lambda c, a: true_c(c, *a), (t, args), only_where(pred, (dt, dargs))
    )
    extra, d_extra = jax.jvp(
        lambda c, a: false_c(c, *a), (f, args), only_where(~pred, (df, dargs))
    )
    held = (args[0], extra)
    d_held = (only_where(~pred, dargs[0]), d_extra)
    return select(taken, held), select(d_taken, d_held)


def _is_float0(x: Any) -> bool:
    return jax.dtypes.result_type(x) == jax.dtypes.float0
