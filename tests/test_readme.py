"""Every python code block in README.md runs."""

import os
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(
    r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S
)


def test_readme_has_examples():
    assert len(BLOCKS) >= 1


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
    code = BLOCKS[index]
    exec(compile(code, f"README.md[block {index}]", "exec"), {"__name__": "readme"})


def test_the_xla_flags_the_docs_advise_are_ones_xla_knows():
    # A misspelt flag or value makes XLA abort at start-up ("Unknown flag in
    # XLA_FLAGS"): each `XLA_FLAGS=...` the READMEs advise starts jax and runs
    # a step (the GPU flags are parsed on every platform).
    import subprocess
    import sys

    root = README.parent
    texts = [
        README.read_text(encoding="utf-8"),
        (root / "benchmarks" / "README.md").read_text(encoding="utf-8"),
    ]
    flags = set(re.findall(r"XLA_FLAGS=(--xla_gpu_[\w=+,-]+)", "\n".join(texts)))
    assert "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" in flags
    for flag in sorted(flags):
        proc = subprocess.run(
            [sys.executable, "-c", "import jax; print(jax.jit(lambda x: x + 1)(1.0))"],
            env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0 and proc.stdout.strip() == "2.0", (
            flag,
            proc.stderr[-500:],
        )
