"""Helpers shared by tests and benchmarks: collectives and traffic in compiled HLO.

``collectives(compiled_text)`` lists every all-reduce, reduce-scatter and
all-gather of a compiled module (``jax.jit(f).lower(...).compile().as_text()``)
with the bytes it produces and where it runs: at the top level of the step
(``"step"``: every call), inside a loop body (``"loop"``: every iteration, a
conditional within it included) or inside a branch of a conditional outside any
loop (``"branch"``: only when that branch is taken,
e.g. the window-closing branch of ``MaskedMultiSteps``). Deterministic for a given
jax/XLA version, so tests may assert on it.

``traffic(compiled_text, taken)`` counts the kernels one call runs, on the path
that closes a window or on the one between window ends, and the bytes they
read and write (``benchmarks/bench_gpu_program.py``).

``backend_compiles()`` records the backend compilations that run inside its block.

``assert_bit_identical(a, b)`` asserts two pytrees equal leaf by leaf: the same
structure, dtypes and values (NaN where the other is NaN).

``TESTS_XLA_FLAGS`` names the environment variable holding the XLA flags the
tests' own programs compile with (``tests/conftest.py``): a process whose
results a test compares bit for bit with its own runs with them as XLA_FLAGS.
A test session started with ``FULL_OPTIMIZATION`` set compiles as a user's
programs do. ``LEGACY_EMITTERS`` set (by ``make test``) asks for XLA:CPU's legacy
emitters, which compile the suite's own programs faster (``tests/conftest.py``).
``session_free_env()`` is the environment without them (nor pytest's own), for a
process that must run as on a machine where the suite never ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterable, Iterator

import jax
import numpy as np

TESTS_XLA_FLAGS = "MASKED_MULTISTEP_TESTS_XLA_FLAGS"
FULL_OPTIMIZATION = "MASKED_MULTISTEP_TESTS_FULL_OPTIMIZATION"
LEGACY_EMITTERS = "MASKED_MULTISTEP_TESTS_LEGACY_EMITTERS"


def session_free_env() -> dict[str, str]:
    """This process's environment without the test session's settings: pytest's
    (``PYTEST_*``) and the suite's own (``MASKED_MULTISTEP_TESTS_*``)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "MASKED_MULTISTEP_TESTS_"))
    }


_KINDS = ("all-reduce", "reduce-scatter", "all-gather")
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<kind>all-reduce|reduce-scatter|all-gather)(?:-start)?\("
)
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\{\s*$")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*(?:e\d+m\d+\w*)?)\[(?P<dims>[\d,]*)\]")
_CALLS = re.compile(
    r"\b(?P<key>condition|body|to_apply|calls|true_computation|false_computation|"
    r"branch_computations)=(?P<value>\{[^}]*\}|%?[\w.\-]+)"
)
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One cross-device collective of a compiled module."""

    kind: str  # "all-reduce", "reduce-scatter" or "all-gather"
    bytes: int  # bytes of its result (all operands of a combined op)
    where: str  # "step", "loop" (inside any loop) or "branch" (in a conditional)
    computation: str


def _shape_bytes(shape: str) -> int:
    total = 0
    for m in _ARRAY.finditer(shape):
        dims = [int(d) for d in m["dims"].split(",") if d]
        size = 1
        for d in dims:
            size *= d
        total += size * _BYTES.get(m["dtype"], 4)
    return total


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """Each computation's instruction lines by name, and the entry's name."""
    bodies: dict[str, list[str]] = {}
    entry = None
    current = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and current is None:
            current = header["name"]
            bodies[current] = []
            if header["entry"]:
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            bodies[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return bodies, entry


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled HLO module, with its bytes and context."""
    bodies, entry = _computations(hlo_text)

    # The loop/branch context of every computation reachable from the entry
    # ("step" when none; "loop" when inside any loop, a branch within it too).
    context: dict[str, str] = {}

    def visit(name: str, where: str) -> None:
        if name not in bodies or context.get(name) == where:
            return
        context[name] = where
        for line in bodies[name]:
            for m in _CALLS.finditer(line):
                value = m["value"].strip("{}")
                callees = [v.strip().lstrip("%") for v in value.split(",") if v]
                key = m["key"]
                if key in ("body", "condition"):
                    inner = "loop"
                elif where != "loop" and (
                    key
                    in ("true_computation", "false_computation", "branch_computations")
                ):
                    # (A branch inside a loop runs per iteration: still "loop".)
                    inner = "branch"
                else:
                    inner = where
                for callee in callees:
                    visit(callee, inner)

    visit(entry, "step")
    found = []
    for name, lines in bodies.items():
        if name not in context:
            continue
        for line in lines:
            m = _OP.match(line)
            if m:
                found.append(
                    Collective(m["kind"], _shape_bytes(m["shape"]), context[name], name)
                )
    return found


def large(found: Iterable[Collective], min_bytes: int) -> list[Collective]:
    """The collectives moving at least ``min_bytes`` (gradient-sized ones)."""
    return [c for c in found if c.bytes >= min_bytes]


def bytes_where(found: Iterable[Collective], where: str) -> int:
    return sum(c.bytes for c in found if c.where == where)


# Instructions that launch no kernel (views, tuples, control flow itself).
_NO_KERNEL = {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "conditional",
    "while",
    "call",
    "after-all",
    "opt-barrier",
    "partition-id",
    "replica-id",
}
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>[a-z][\w\-]*)\((?P<args>[^)]*)\)(?P<rest>.*)$"
)
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Traffic:
    """The kernels one path through a compiled step runs, and what they move."""

    kernels: int = 0
    bytes: int = 0  # operands read plus results written, kernel by kernel
    copies: list[int] = dataclasses.field(default_factory=list)  # bytes of each

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.kernels + other.kernels,
            self.bytes + other.bytes,
            self.copies + other.copies,
        )

    def __mul__(self, n: int) -> Traffic:
        return Traffic(self.kernels * n, self.bytes * n, self.copies * n)


def _is_slice(body: list[str] | None) -> bool:
    """Whether a fused computation is a bare slice of its parameter."""
    if not body:
        return False
    roots = [_INSTRUCTION.match(line) for line in body if "ROOT" in line]
    return (
        len(body) == 2
        and bool(roots)
        and roots[0] is not None
        and (roots[0]["op"] == "slice")
    )


def traffic(hlo_text: str, taken: bool) -> Traffic:
    """The kernels of one call of a compiled step and the bytes they move.

    Every conditional takes its true branch (``taken``) or its false one, and a
    loop of unknown trip count (``MaskedMultiSteps``' window loop on GPUs,
    which runs at most once) runs once or not at all: with ``taken``
    the path of a call that closes a window, without it that of a call between
    window ends. A loop of known trip count (a ``scan``) runs that many times.
    A kernel's bytes are its operands' and its result's (a model of the
    traffic of a memory-bound step, not a measurement).
    """
    bodies, entry = _computations(hlo_text)

    def walk(name: str) -> Traffic:
        shapes: dict[str, str] = {}
        total = Traffic()
        for line in bodies.get(name, []):
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            shapes[m["name"]] = m["shape"]
            op = m["op"]
            called = {c["key"]: c["value"] for c in _CALLS.finditer(m["rest"])}
            if op == "conditional":
                if "true_computation" in called:
                    branch = "true_computation" if taken else "false_computation"
                    total += walk(called[branch].lstrip("%"))
                    continue
                # An indexed one (`lax.cond` lowers to index 0 false, 1 true).
                listed = called["branch_computations"].strip("{}").split(",")
                branches = [b.strip().lstrip("%") for b in listed]
                total += walk(branches[min(int(taken), len(branches) - 1)])
            elif op == "while":
                body = walk(called["body"].lstrip("%"))
                condition = walk(called["condition"].lstrip("%"))
                trips = _TRIP_COUNT.search(m["rest"])
                n = int(trips.group(1)) if trips else int(taken)
                total += (body + condition) * n + condition
            elif op not in _NO_KERNEL:
                # (Every fifth operand is printed after an /*index=N*/ comment.)
                listed = re.sub(r"/\*.*?\*/", "", m["args"])
                args = [a.strip().lstrip("%") for a in listed.split(",")]
                moved = _shape_bytes(m["shape"]) + sum(
                    _shape_bytes(shapes.get(a, "")) for a in args
                )
                if op == "slice" or _is_slice(
                    bodies.get(called.get("calls", "").lstrip("%"))
                ):
                    # A slice reads only what it returns (a scalar taken out
                    # of a combined all-reduce's buffer, say).
                    moved = 2 * _shape_bytes(m["shape"])
                copies = [_shape_bytes(m["shape"])] if op == "copy" else []
                total += Traffic(1, moved, copies)
        return total

    return walk(entry)


@contextlib.contextmanager
def backend_compiles() -> Iterator[list[str]]:
    """A list that collects one event per backend compilation in the block."""
    events: list[str] = []

    def listener(event: str, duration: float, **kwargs: object) -> None:
        del duration, kwargs
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def assert_bit_identical(a, b) -> None:
    """``a`` and ``b`` have the same tree structure and, leaf by leaf, the same
    dtype and values (NaN where the other is NaN)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True), (x, y)
