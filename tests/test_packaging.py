"""The package's version has one source, and its sdist carries working tests."""

import configparser
import importlib.util
import pathlib
import re
import subprocess
import sys
import tarfile

import pytest
from _helpers import session_free_env

import masked_multistep
from masked_multistep import _version

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_version_is_written_once():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg", encoding="utf-8")
    assert cfg["metadata"]["version"] == "attr: masked_multistep._version.__version__"
    assert masked_multistep.__version__ == _version.__version__
    # The changelog has a section for it (`## 0.2.0 (unreleased)` for 0.2.0.dev0).
    release = re.match(r"\d+\.\d+\.\d+", _version.__version__).group()
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert re.search(rf"^## {re.escape(release)}\b", changelog, flags=re.M)


def _build_sdist(out: pathlib.Path) -> pathlib.Path:
    if importlib.util.find_spec("build") is not None:
        command = [sys.executable, "-m", "build", "--sdist", "--no-isolation"]
        command += ["--outdir", str(out), str(ROOT)]
    else:  # setuptools alone, through its PEP 517 hook
        command = [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; "
            "build_meta.build_sdist(sys.argv[1])",
            str(out),
        ]
    proc = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (sdist,) = out.glob("masked_multistep-*.tar.gz")
    return sdist


def _files(folder: pathlib.Path) -> set[str]:
    return {
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and ".ipynb_checkpoints" not in p.parts
    }


@pytest.mark.slow
def test_sdist_ships_its_tests_and_they_collect(tmp_path):
    sdist = _build_sdist(tmp_path / "dist")
    assert sdist.name == f"masked_multistep-{masked_multistep.__version__}.tar.gz"
    # The extraction filters came with Python 3.11.4 (Debian 12's is 3.11.2);
    # from 3.12 extracting without one warns.
    filters = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", **filters)
    (tree,) = (tmp_path / "unpacked").iterdir()

    for folder in ["tests", "notebooks"]:
        missing = _files(ROOT / folder) - _files(tree / folder)
        assert not missing, f"not in the sdist: {sorted(missing)}"
    for name in ["README.md", "CHANGELOG.md", "constraints.txt", "pyproject.toml"]:
        assert (tree / name).is_file(), name
    assert (tree / "docs" / "conf.py").is_file()
    assert not (tree / "docs" / "_build").exists()

    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist"],
        cwd=tree,
        # Without the session's own settings (tests/conftest.py): the unpacked
        # tests collect as on a machine where they were never run.
        env={**session_free_env(), "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # `N tests collected in ...s`, and no `, M errors`.
    assert re.search(r"^\d+ tests collected in ", proc.stdout, flags=re.M), proc.stdout[
        -500:
    ]
    collected = {line.split("::")[0] for line in proc.stdout.splitlines()}
    expected = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")}
    assert expected <= collected, sorted(expected - collected)
    # The package's doctests are collected too.
    assert "masked_multistep/_multisteps.py::" in proc.stdout
