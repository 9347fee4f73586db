"""The Makefile's guards: what a fresh clone meets before anything installs."""

import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make(cwd, *args):
    return subprocess.run(
        ["make", *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_a_python_older_than_3_11_is_refused_before_the_venv_is_made(tmp_path):
    for name in ("Makefile", "setup.cfg", "pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    old = tmp_path / "python3"  # answers like Python 3.10
    old.write_text(
        '#!/bin/sh\n[ "$1" = "-V" ] && echo "Python 3.10.13" && exit 0\nexit 1\n'
    )
    old.chmod(old.stat().st_mode | stat.S_IEXEC)
    proc = make(tmp_path, "install", f"PYTHON={old}")
    assert proc.returncode != 0
    assert "needs Python >= 3.11" in proc.stdout and "Python 3.10.13" in proc.stdout
    assert "make install PYTHON=python3.11" in proc.stdout
    assert not (tmp_path / ".venv").exists()


def test_make_test_lints_as_make_lint_does():
    proc = make(ROOT, "-n", "test")
    assert proc.returncode == 0, proc.stderr
    lint = make(ROOT, "-n", "lint").stdout
    for line in ("ruff check", "ruff format --check"):
        (expected,) = [s for s in lint.splitlines() if line in s]
        assert expected in proc.stdout


def test_no_recipe_comment_is_echoed_to_the_terminal():
    # A recipe line `\t# ...` goes to the shell, and make prints it first:
    # `make demo` showed four lines of the Makefile's own notes.
    echoed = [
        n
        for n, line in enumerate((ROOT / "Makefile").read_text().splitlines(), 1)
        if line.startswith("\t#")
    ]
    assert not echoed, f"Makefile lines {echoed}: write `@#` or move them out"


def test_make_test_latest_installs_unpinned_and_runs_the_suite_as_make_test():
    # `make test-latest` is the suite against what `pip install` gives a user
    # today: no constraints file, the newest releases, a venv of its own (the
    # pinned .venv stays as it is), and the same pytest run as `make test`.
    proc = make(ROOT, "-n", "test-latest")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    installs = [s for s in lines if "pip install" in s or '-e ".[dev]"' in s]
    assert installs and not any("constraints" in s for s in installs)
    assert any("--upgrade" in s for s in installs)
    assert "-m venv --clear .venv-latest" in proc.stdout
    assert not any(s.startswith(".venv/") for s in lines)
    (pytest_line,) = [s for s in lines if "-m pytest" in s]
    (pinned,) = [
        s for s in make(ROOT, "-n", "test").stdout.splitlines() if "-m pytest" in s
    ]
    assert pytest_line.split("-m pytest", 1)[1] == pinned.split("-m pytest", 1)[1]
    assert pytest_line.startswith(".venv-latest/bin/python")
