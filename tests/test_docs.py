"""The documentation builds without a warning, and covers the public API.

`make docs` runs the same build; here it goes into a temporary folder, with
warnings as errors (broken references included: the docs are nitpicky about
this package's own names), so a docstring that breaks the docs fails the tests.
"""

import pathlib
import re
import subprocess
import sys

import pytest

import masked_multistep

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def html(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("docs")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
        + ["-d", str(out / "doctrees"), str(ROOT / "docs"), str(out / "html")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out / "html"


def test_every_public_name_has_an_api_entry(html):
    page = (html / "api.html").read_text(encoding="utf-8")
    documented = set(re.findall(r'id="masked_multistep\.(\w+)"', page))
    names = set(masked_multistep.__all__) | {"TrainState"}
    assert names <= documented, f"missing from the API page: {names - documented}"


def test_constants_are_described_by_their_own_comment(html):
    # Not by their type's docstring, which autodoc falls back to for a
    # constant only imported into `__init__.py`.
    page = (html / "api.html").read_text(encoding="utf-8")
    for builtin in (tuple, list, dict, str, int, float, frozenset):
        first_line = builtin.__doc__.strip().splitlines()[0]
        assert first_line not in page, builtin
    constants = [
        name
        for name in masked_multistep.__all__
        if not callable(getattr(masked_multistep, name))
    ]
    assert constants == ["STATE_0_1_FIELDS"]
    entry = page.split('id="masked_multistep.STATE_0_1_FIELDS"')[1]
    assert "The fields of a version 0.1" in entry.split('id="masked_multistep.')[0]


def test_every_stored_notebook_is_rendered_with_its_outputs(html):
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks
    for notebook in notebooks:
        page = html / "notebooks" / f"{notebook.stem}.html"
        assert page.exists(), f"{notebook.name} is not in the docs"
        # Stored figures are shown, not re-computed.
        assert re.search(
            r'<img[^>]+src="\.\./_images/', page.read_text(encoding="utf-8")
        ), page


def test_the_readme_is_the_guide_and_its_links_resolve(html):
    from docutils.nodes import make_id

    index = (html / "index.html").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    # Every section of the README is a section of the landing page.
    for heading in re.findall(r"^## (.+)$", readme, flags=re.M):
        assert f'id="{make_id(heading)}"' in index, heading
    # The README's relative links land on pages of the site.
    links = r"(?<!!)\[[^]]*\]\(((?:notebooks|benchmarks)/[^)#]+)\)"
    for target in re.findall(links, readme):
        page = re.sub(r"\.(ipynb|md)$", ".html", target)
        assert f'href="{page}' in index, target
        assert (html / page).exists(), page
    # Its images are shown.
    for target in re.findall(r"!\[[^]]*\]\(([^)]+)\)", readme):
        name = pathlib.PurePosixPath(target).name
        assert re.search(rf'<img[^>]+src="_images/{re.escape(name)}"', index), target
        assert (html / "_images" / name).exists(), target
    assert (html / "changelog.html").exists()


def test_numpy_bool_keeps_its_name_in_signatures(html):
    # numpy 2 names `np.bool_` "bool", and `has_aux: bool | np.bool_` read
    # `has_aux: bool | bool`.
    text = re.sub(r"<[^>]+>", "", (html / "api.html").read_text())
    assert "bool | bool" not in text
    assert "has_aux: bool | np.bool_" in text
