"""An exact token total: the tokens seen, for the window statistics and for a
token budget that depends on them.

A count of tokens outgrows float32 (exact to ``2**24``) and int32 (``2**31``)
within a run; :class:`TokenTotal` keeps it as the unevaluated sum of two
float32 values, exact to ``2**48``, whatever the count dtype, and reads as the
one number it stands for.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from masked_multistep._checks import traced

__all__ = ["TokenTotal", "add_tokens", "token_total", "with_tokens_seen"]

_F32 = jnp.float32
# Count dtypes are split into float32 pieces of at most 24 bits, each exact.
_CHUNK_BITS = 24


class TokenTotal(NamedTuple):
    """A token total kept exactly as the unevaluated sum ``hi + lo`` of two floats.

    A double-float32 (compensated) sum: each addition is exact as long as the
    total's integer value stays below ``2**48`` (2.8e14 tokens), whatever the
    count dtype, far beyond the ``2**24`` of one float32 or the ``2**31`` of an
    int32. ``float(total)`` (or :meth:`value`) gives it as a Python float, exact
    for integer totals below ``2**53``; ``int(total)``, ``round(total)``,
    ``bool(total)``, formatting (``f"{total:,.0f}"``), arithmetic and
    comparisons work as on that float (``total / 1e6``, ``total > budget``;
    traced by ``jit``, on ``hi + lo`` in float32); a batched total (under
    ``jax.vmap``) indexes as its numbers do (``total[i]``, a ``TokenTotal``),
    while ``len``, iteration and unpacking give the pair (the number of
    totals in a batch is ``total.hi.shape[0]``). NumPy and jax take it as
    the one number it stands for, not as the pair: ``np.asarray(total)`` is
    that float64, and ``jnp.asarray(total)`` is ``hi + lo``, the total
    rounded to float32, also under ``jit``; jax.numpy functions take it so,
    and an optax schedule of the tokens seen takes ``jnp.asarray(total)``.

    Attributes:
      hi: float32, the leading part.
      lo: float32, the remainder (``|lo| <= ulp(hi) / 2``).

    Examples:
      2**24 + 1 tokens, which float32 alone rounds to 2**24:

      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import masked_multistep as mm
      >>> seen = mm.TokenTotal(hi=jnp.float32(2**24), lo=jnp.float32(1))
      >>> print(int(seen), f"{seen:,.0f}", float(seen.hi + seen.lo), seen / 1e6)
      16777217 16,777,217 16777216.0 16.777217
      >>> print(np.asarray(seen), float(jnp.asarray(seen)))
      16777217.0 16777216.0
    """

    hi: jax.Array
    lo: jax.Array

    def value(self) -> np.float64 | np.ndarray:
        """The total as a float64 NumPy value: a ``np.float64`` scalar, or an
        array of them if batched.

        Examples:
          >>> import jax.numpy as jnp
          >>> import masked_multistep as mm
          >>> print(mm.TokenTotal(jnp.float32(2.0**30), jnp.float32(3.0)).value())
          1073741827.0
        """
        total = np.asarray(self.hi, np.float64) + np.asarray(self.lo, np.float64)
        return cast("np.float64 | np.ndarray", total)

    def __float__(self) -> float:
        return float(self.value())

    def __int__(self) -> int:
        return int(float(self))

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        # The total, not the pair (as a tuple, it would read as [hi, lo]).
        return np.asarray(self.value(), dtype)

    def __jax_array__(self) -> jax.Array:
        return self.hi + self.lo

    def __getitem__(self, index: Any) -> TokenTotal:  # type: ignore[override]
        # A batched total (the statistics of runs under `jax.vmap`, or logs
        # stacked) indexes as the numbers it stands for: `seen[i]` is run i's
        # total, not the pair's `hi` or `lo` (read those by name).
        if not jnp.ndim(self.hi):
            raise IndexError(
                "a TokenTotal of one total (not batched) has no entries to "
                "index: read the number with float(total), its parts as "
                "`total.hi` and `total.lo`"
            )
        return TokenTotal(self.hi[index], self.lo[index])

    def __format__(self, format_spec: str) -> str:
        # The number (as a float64 formats); traced, the tuple.
        if traced(self):
            return str(self)
        value = self.value()
        if np.ndim(value) == 0:
            return format(float(value), format_spec)
        if not format_spec:
            return format(value)
        # A batch of totals: each formatted as one would be (numpy's own
        # `format` takes no format spec for an array).
        return np.array2string(
            np.asarray(value),
            separator=", ",
            formatter={"float_kind": lambda v: format(float(v), format_spec)},
        )

    # Arithmetic and comparisons read the number, not the pair: as a tuple,
    # `total * 2` would repeat it and `total + 1` or `total > 1` fail. Outside
    # `jit` the exact float64 value; traced, `hi + lo` (float32).

    def _number(self) -> Any:
        return self.__jax_array__() if traced(self) else self.value()

    def item(self) -> float:
        """``float(total)``."""
        return float(self)

    def __bool__(self) -> bool:
        # The number's truth, not the pair's (a tuple of two is always true):
        # `if seen:` is false for no tokens. Traced, jax's error, as for a
        # traced float.
        return bool(self._number() != 0)

    def __round__(self, ndigits: int | None = None) -> Any:
        return round(float(self), ndigits)

    def __neg__(self) -> Any:
        return -self._number()

    def __abs__(self) -> Any:
        return abs(self._number())

    def __add__(self, other: Any) -> Any:  # type: ignore[override]
        return self._number() + _number_of(other)

    def __radd__(self, other: Any) -> Any:
        return _number_of(other) + self._number()

    def __sub__(self, other: Any) -> Any:
        return self._number() - _number_of(other)

    def __rsub__(self, other: Any) -> Any:
        return _number_of(other) - self._number()

    def __mul__(self, other: Any) -> Any:  # type: ignore[override]
        return self._number() * _number_of(other)

    def __rmul__(self, other: Any) -> Any:  # type: ignore[override]
        return _number_of(other) * self._number()

    def __truediv__(self, other: Any) -> Any:
        return self._number() / _number_of(other)

    def __rtruediv__(self, other: Any) -> Any:
        return _number_of(other) / self._number()

    def __floordiv__(self, other: Any) -> Any:
        return self._number() // _number_of(other)

    def __rfloordiv__(self, other: Any) -> Any:
        return _number_of(other) // self._number()

    def __mod__(self, other: Any) -> Any:
        return self._number() % _number_of(other)

    def __rmod__(self, other: Any) -> Any:
        return _number_of(other) % self._number()

    def __divmod__(self, other: Any) -> Any:
        return divmod(self._number(), _number_of(other))

    def __rdivmod__(self, other: Any) -> Any:
        return divmod(_number_of(other), self._number())

    def __pow__(self, other: Any) -> Any:
        return self._number() ** _number_of(other)

    def __rpow__(self, other: Any) -> Any:
        return _number_of(other) ** self._number()

    def __lt__(self, other: Any) -> Any:  # type: ignore[override]
        return self._number() < _number_of(other)

    def __le__(self, other: Any) -> Any:  # type: ignore[override]
        return self._number() <= _number_of(other)

    def __gt__(self, other: Any) -> Any:  # type: ignore[override]
        return self._number() > _number_of(other)

    def __ge__(self, other: Any) -> Any:  # type: ignore[override]
        return self._number() >= _number_of(other)

    def __eq__(self, other: object) -> Any:  # type: ignore[override]
        return self._number() == _number_of(other)

    def __ne__(self, other: object) -> Any:  # type: ignore[override]
        return self._number() != _number_of(other)

    if not TYPE_CHECKING:  # (mypy would read it as a field of the tuple)
        __hash__ = None  # equal totals need not be the same pair


def _number_of(x: Any) -> Any:
    """``x``, or the number a :class:`TokenTotal` stands for."""
    return x._number() if isinstance(x, TokenTotal) else x


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(s, e)`` with ``s = fl(a + b)`` and ``a + b = s + e`` exactly (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _add_exact_piece(total: TokenTotal, x: jax.Array) -> TokenTotal:
    s, e = _two_sum(total.hi, x)
    e = e + total.lo
    hi = s + e
    lo = e - (hi - s)
    # Past float32's range the total is inf, not NaN (inf - inf in the
    # remainder): a budget callable of the tokens seen gets inf, not a NaN
    # (which it would have to handle; NaN budgets count as 0).
    finite = jnp.isfinite(s)
    return TokenTotal(jnp.where(finite, hi, s), jnp.where(finite, lo, 0))


def _float32_pieces(x: jax.Array) -> list[jax.Array]:
    """Non-negative ``x`` as float32 values, each exact, that sum to ``x``.

    Integers are cut into 24-bit chunks; float64 into its float32 rounding and
    the (float32-rounded) remainder.
    """
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.integer):
        bits = 8 * x.dtype.itemsize
        mask = (1 << _CHUNK_BITS) - 1
        pieces = []
        for shift in range(0, bits, _CHUNK_BITS):
            chunk = (x >> shift) & jnp.asarray(mask, x.dtype)
            pieces.append(chunk.astype(_F32) * np.float32(2.0**shift))
        return pieces
    if x.dtype.itemsize > 4:
        hi = x.astype(_F32)
        # Beyond float32's range `hi` is inf, and the remainder would be -inf
        # (the total inf + -inf = NaN, for good): the total is inf then.
        rest = jnp.where(jnp.isfinite(hi), x - hi.astype(x.dtype), 0)
        return [hi, rest.astype(_F32)]
    return [x.astype(_F32)]


def add_tokens(total: TokenTotal, x: jax.Array) -> TokenTotal:
    """``total + x`` for a non-negative count ``x`` of any count dtype, exact
    while the total stays below ``2**48`` (the tokens seen, for the window
    statistics and for a token budget that depends on them)."""
    for piece in _float32_pieces(x):
        total = _add_exact_piece(total, piece)
    return total


def token_total(tokens: Any, what: str) -> TokenTotal:
    """A concrete count of tokens (a whole number in ``[0, 2**48]``: a Python
    or numpy integer, or a whole float) as an exact :class:`TokenTotal`.

    A :class:`TokenTotal` (one read from a state) is taken by its value.

    Examples:
      >>> print(int(token_total(2**40 + 3, "`tokens_seen`")))
      1099511627779
    """
    if isinstance(tokens, TokenTotal):
        # Read from a state (`mm.window_stats(state).tokens_seen`): as exact
        # as it is, checked as any other count below.
        tokens = tokens.value()
    if isinstance(tokens, bool) or not isinstance(
        tokens, (numbers.Real, np.ndarray, np.generic, jax.Array)
    ):
        raise TypeError(
            f"{what} must be a whole number of tokens, got {tokens!r} of type "
            f"{type(tokens).__name__}"
        )
    try:
        value = np.asarray(tokens)
    except TypeError as err:  # a jax PRNG key
        raise TypeError(
            f"{what} must be a whole number of tokens, got an array of dtype "
            f"{getattr(tokens, 'dtype', None)}"
        ) from err
    kinds = (np.integer, np.floating)
    if not any(np.issubdtype(value.dtype, k) for k in kinds):
        raise TypeError(
            f"{what} must be a whole number of tokens, got dtype {value.dtype}"
        )
    if value.shape != ():
        raise ValueError(
            f"{what} must be a scalar (a whole number of tokens), got shape "
            f"{value.shape}"
        )
    item = value.item()
    if not (math.isfinite(item) and item == int(item) and 0 <= item <= 2**48):
        raise ValueError(
            f"{what} must be a whole number of tokens in [0, 2**48], got {item!r}"
        )
    whole = int(item)
    hi = np.float32(whole)
    lo = np.float32(whole - int(hi))  # exact: |lo| <= ulp(hi) / 2 <= 2**23
    return TokenTotal(jnp.asarray(hi), jnp.asarray(lo))


def with_tokens_seen(tree: Any, seen: TokenTotal) -> Any:
    """``tree`` with every :class:`TokenTotal` in it (a token budget's tokens
    seen) and the window statistics' ``tokens_seen`` (a node with a
    ``with_tokens_seen`` method) set to ``seen``, each a copy of its own: a
    donated state may not hold one buffer twice."""

    def holding(x: Any) -> bool:
        return isinstance(x, TokenTotal) or hasattr(x, "with_tokens_seen")

    def set_to_seen(x: Any) -> Any:
        if isinstance(x, TokenTotal):
            return jax.tree.map(jnp.copy, seen)
        return x.with_tokens_seen(seen) if holding(x) else x

    return jax.tree.map(set_to_seen, tree, is_leaf=holding)
