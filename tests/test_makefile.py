"""The Makefile's guards: what a fresh clone meets before anything installs."""

import configparser
import importlib.metadata
import os
import shutil
import stat
import subprocess
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def make(cwd, *args):
    return subprocess.run(
        ["make", *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def _make_with_python(tmp_path, version, target):
    """``make target`` in a copy of the make inputs at ``tmp_path``, with
    ``PYTHON=`` a stand-in of Python ``version``: the run, and the path of the
    stand-in's log of anything it was asked past the version checks."""
    _copy_make_inputs(tmp_path)
    log = tmp_path / "calls"
    _fake_python(tmp_path / "python3", version, log)
    return make(tmp_path, target, f"PYTHON={tmp_path / 'python3'}"), log


def test_a_python_older_than_3_11_is_refused_before_the_venv_is_made(tmp_path):
    proc, log = _make_with_python(tmp_path, "3.10.13", "install")
    assert proc.returncode != 0
    assert "needs Python >= 3.11" in proc.stdout and "Python 3.10.13" in proc.stdout
    assert "make install PYTHON=python3.11" in proc.stdout
    assert not (tmp_path / ".venv").exists() and not log.exists()


def _fake_python(path, version, log):
    """A stand-in interpreter that answers the Makefile's version checks as
    Python ``version`` would and logs (and fails) anything else it is asked."""
    minor = ".".join(version.split(".")[:2])
    major_minor = tuple(map(int, version.split(".")[:2]))
    too_old, too_new = int(major_minor < (3, 11)), int(major_minor >= (3, 15))
    path.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = "-V" ] && echo "Python {version}" && exit 0\n'
        'case "$2" in\n'
        '  "") exit 0 ;;\n'  # `-c ''`: it runs
        f'  *"< (3, 11)"*) exit {too_old} ;;\n'
        f'  *">= (3, 15)"*) exit {too_new} ;;\n'
        f'  *"print(*sys.version_info"*) echo {minor}; exit 0 ;;\n'
        "esac\n"
        f'echo "$0 $*" >> "{log}"\n'
        "exit 1\n",
        encoding="locale",  # the shell reads the log's path as the file system names it
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _copy_make_inputs(to):
    for name in ("Makefile", "setup.cfg", "pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, to / name)


def test_a_python_newer_than_the_pins_have_wheels_for_is_refused(tmp_path):
    # jaxlib 0.10.2 (constraints.txt) has wheels for Python 3.11 to 3.14 only:
    # with a newer python3 the pinned install fails in the resolver, after the
    # venv is made. Refused first, with what to run instead.
    proc, log = _make_with_python(tmp_path, "3.15.0", "test")
    assert proc.returncode != 0
    assert "jaxlib==0.10.2" in proc.stdout and "Python 3.15.0" in proc.stdout
    assert "have wheels for Python 3.11 to 3.14" in proc.stdout
    assert "make test PYTHON=python3.14" in proc.stdout
    assert not log.exists() and not (tmp_path / ".venv").exists()
    # The bound is the pinned jaxlib's, and 3.14 itself passes the check.
    assert "jaxlib==0.10.2\n" in (ROOT / "constraints.txt").read_text(encoding="utf-8")
    _fake_python(tmp_path / "python3", "3.14.1", log)
    make(tmp_path, "install", f"PYTHON={tmp_path / 'python3'}")
    assert "-m venv --clear .venv" in log.read_text(encoding="utf-8")


def test_every_pin_installs_on_every_python_the_makefile_takes():
    # `make test` installs the pins of constraints.txt with any Python 3.11 to
    # 3.14 (setup.cfg: >= 3.11; the Makefile refuses 3.15); Debian 12's
    # python3 is 3.11.2. A pin whose Requires-Python leaves out one of them
    # fails the install in the resolver there (soupsieve 4.1.3: >=3.11.5).
    # Read from the distributions installed here at their pinned versions (all
    # of them under `make test`; fewer under `make test-latest`).
    pins = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg", encoding="utf-8")
    assert setup["options"]["python_requires"] == ">=3.11"
    pythons = [Version(v) for v in ("3.11.0", "3.12.0", "3.13.0", "3.14.0")]
    checked, refused = [], []
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if pins.get(name) != dist.version:
            continue
        checked.append(name)
        spec = SpecifierSet(dist.metadata.get("Requires-Python") or "")
        refused += [
            (name, dist.version, str(spec), str(v))
            for v in pythons
            if not spec.contains(v)
        ]
    assert checked and "jaxlib" in pins
    assert refused == []


def test_a_python_that_does_not_run_is_named_with_those_that_do(tmp_path):
    # The hints above name PYTHON=python3.14: where there is none, say so (the
    # version check printed "needs Python >= 3.11; python3.14 is /bin/sh: ...
    # not found"), also for a pyenv shim of a version not installed (found on
    # the PATH, but it does not run).
    _copy_make_inputs(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    _fake_python(bin_dir / "python3.12", "3.12.4", log)
    shim = bin_dir / "python3.13"
    shim.write_text(
        '#!/bin/sh\necho "pyenv: python3.13: command not found"; exit 127\n',
        encoding="utf-8",
    )
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    # Only the stand-ins on the PATH: what the machine has installed does not
    # matter (make runs the recipes with /bin/sh, whose built-ins do the rest).
    env = {**os.environ, "PATH": str(bin_dir)}
    make_path = shutil.which("make")
    assert make_path is not None
    for target, python in [("install", "python3.14"), ("test-latest", "python3.13")]:
        proc = subprocess.run(
            [make_path, target, f"PYTHON={python}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert proc.returncode != 0
        assert f"{python} was not found (or does not run)" in proc.stdout, proc.stdout
        found = proc.stdout.split("these run here:")[1].split(")")[0].split()
        assert found == ["python3.12"], proc.stdout
    assert not (tmp_path / ".venv").exists() and not log.exists()


def test_a_venv_is_made_again_where_broken_or_a_failed_install_of_another_python(
    tmp_path,
):
    # After a failed install with one PYTHON=, a retry with another must not
    # keep the first one's .venv (the install would fail the same way); a
    # .venv that holds an install keeps its Python.
    _copy_make_inputs(tmp_path)
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls"
    for in_venv, python, stamp, remade in [
        ("3.15.0", "3.13.2", None, True),  # outside 3.11-3.14
        ("3.10.4", "3.13.2", ".installed-dev", True),
        ("3.12.0", "3.13.2", None, True),  # nothing installed, another Python
        ("3.13.0", "3.13.2", None, False),  # nothing installed, the same
        ("3.11.7", "3.13.2", ".installed-demo", False),  # an install
    ]:
        for old in venv.glob(".installed-*"):
            old.unlink()
        if stamp:  # older than setup.cfg: the install runs again
            (venv / stamp).touch()
            os.utime(venv / stamp, (0, 0))
        _fake_python(venv / "bin" / "python", in_venv, log)
        _fake_python(tmp_path / "python3", python, log)
        log.unlink(missing_ok=True)
        proc = make(tmp_path, "install", f"PYTHON={tmp_path / 'python3'}")
        assert proc.returncode != 0  # the stand-ins install nothing
        calls = log.read_text(encoding="utf-8").splitlines()
        assert ("-m venv --clear .venv" in calls[0]) == remade, (in_venv, calls)
        if not remade:  # the kept venv's pip comes next
            assert calls[0].startswith(".venv/bin/python -m pip"), calls


def test_demo_and_docs_use_the_development_stack_where_it_is_installed(tmp_path):
    # The dev extra holds the demo's and the docs': after `make test`, `make
    # demo` reinstalled (and went to the network) for its own stamp.
    _copy_make_inputs(tmp_path)
    venv = tmp_path / ".venv"
    venv.mkdir()
    for target in ("demo", "docs"):
        proc = make(tmp_path, "-n", target)  # nothing installed: its own extra
        assert proc.returncode == 0, proc.stderr
        assert f'-e ".[{target}]"' in proc.stdout, proc.stdout
    (venv / ".installed-dev").touch()  # newer than setup.cfg: up to date
    for target, runs in (("demo", "masked_multistep.demo"), ("docs", "sphinx")):
        proc = make(tmp_path, "-n", target)
        assert proc.returncode == 0, proc.stderr
        assert "pip install" not in proc.stdout and runs in proc.stdout, proc.stdout
    os.utime(venv / ".installed-dev", (0, 0))  # older: the dev stack again
    proc = make(tmp_path, "-n", "demo")
    assert '-e ".[dev]"' in proc.stdout and '".[demo]"' not in proc.stdout


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
        for n, line in enumerate(
            (ROOT / "Makefile").read_text(encoding="utf-8").splitlines(), 1
        )
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
    # With the same environment (tests/conftest.py's legacy emitters, where the
    # newest jaxlib still has them).
    env, python = pytest_line.split("-m pytest", 1)[0].rsplit(" ", 2)[:2]
    assert python == ".venv-latest/bin/python"
    assert pinned.startswith(f"{env} .venv/bin/python -m pytest")


def test_make_help_lists_every_target_on_a_line_of_its_own_in_one_column():
    phony = next(
        line.split(":", 1)[1].split()
        for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines()
        if line.startswith(".PHONY:")
    )
    proc = make(ROOT, "-s", "help")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    listed = [line.split()[1] for line in lines]
    assert sorted(listed) == sorted(t for t in phony if t != "help"), listed
    # Every description starts in the same column, past the longest name.
    starts = {len(line) - len(line.split(None, 2)[2]) for line in lines}
    assert len(starts) == 1, lines
