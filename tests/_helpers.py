"""Helpers shared by tests and benchmarks: cross-device collectives in compiled HLO.

``collectives(compiled_text)`` lists every all-reduce, reduce-scatter and
all-gather of a compiled module (``jax.jit(f).lower(...).compile().as_text()``)
with the bytes it produces and where it runs: at the top level of the step
(``"step"``: every call), inside a loop body (``"loop"``: every iteration, a
conditional within it included) or inside a branch of a conditional outside any
loop (``"branch"``: only when that branch is taken,
e.g. the window-closing branch of ``MaskedMultiSteps``). Deterministic for a given
jax/XLA version, so tests may assert on it.

``backend_compiles()`` records the backend compilations that run inside its block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterable, Iterator

import jax

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


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled HLO module, with its bytes and context."""
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
