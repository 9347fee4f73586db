"""Sphinx configuration of the masked_multistep documentation (`make docs`).

The site is the README (the guide), the stored notebooks rendered as they are
(never executed here: `make test` executes them), the benchmark results, the
changelog, and an API reference generated from the docstrings of every name in
``masked_multistep.__all__``.
"""

from __future__ import annotations

import inspect
import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Document the checkout these docs belong to, installed or not.
sys.path.insert(0, str(ROOT))

import masked_multistep  # noqa: E402

# Sphinx reads documents from docs/ only, and the README's links
# (`notebooks/01_...ipynb`, `benchmarks/README.md`) must land on documents, so
# the stored notebooks and the benchmark results are copied in afresh at every
# build (git ignores the copies; edit the originals).
COPIED = {"notebooks": ("*.ipynb", "*.png"), "benchmarks": ("README.md",)}
DOCS = pathlib.Path(__file__).resolve().parent
for _folder, _patterns in COPIED.items():
    shutil.rmtree(DOCS / _folder, ignore_errors=True)
    (DOCS / _folder).mkdir()
    for _pattern in _patterns:
        for _path in sorted((ROOT / _folder).glob(_pattern)):
            shutil.copy2(_path, DOCS / _folder / _path.name)

project = "masked_multistep"
author = "masked_multistep authors"
copyright = "masked_multistep authors, Apache-2.0"
release = masked_multistep.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "myst_nb",
]

exclude_patterns = [
    "_build",
    "**.ipynb_checkpoints",
    "Thumbs.db",
    ".DS_Store",
]

# The notebooks are stored executed; the docs show those outputs.
nb_execution_mode = "off"
# README headings become link targets (`#installation`).
myst_heading_anchors = 3

# API reference.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# `accumulator_dtype=jnp.float32`, not the repr of the class.
autodoc_preserve_defaults = True
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# References to this package's own names must resolve; names from the libraries
# it builds on are left as plain text (no network for intersphinx).
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jnp|np|numpy|optax|flax|nnx|chex|orbax|typing|collections)\..*"),
    (r"py:.*", r"(Any|Callable|Sequence|Mapping|NamedTuple|ArrayTree|ArrayLike)"),
    # Type variables in signatures (`microbatched_value_and_grad`'s params and
    # batch types): not documented entries of their own.
    (r"py:class", r"masked_multistep\._microbatch\.(ParamsT|BatchT)"),
    # ... and `MaskedMultiSteps.apply_gradients`' params type, and the type of
    # `WindowStats`' per-group figures (its docstring says what they are).
    (r"py:class", r"_ParamsT"),
    (r"py:class", r"(masked_multistep\._stats_state\.)?_Figure"),
    # The type of `MaskedMultiSteps(reduction=...)`: built by `mm.deferred`,
    # whose entry documents it.
    (r"py:class", r"masked_multistep\._deferred\.Deferred"),
    # MaskedMultiSteps' docstrings (the class, has_updated, apply_gradients) say
    # :meth:`update`, which Sphinx does not resolve there; remove this line once
    # they write :meth:`MaskedMultiSteps.update`.
    ("py:meth", "update"),
]

# Each API entry has its own heading; the page contents list those only.
toc_object_entries = False

html_theme = "sphinx_book_theme"
html_title = f"masked_multistep {release}"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
}

# The API page lists every public name: `api.md` holds a marker that is
# replaced, when the page is read, by one autodoc entry per name in `__all__`,
# so a name added to `__all__` is documented without editing the page.
API_MARKER = "<!-- api entries: generated from masked_multistep.__all__ -->"


def public_names() -> list[str]:
    """``masked_multistep.__all__``, with ``TrainState`` (needs flax) always."""
    names = list(masked_multistep.__all__)
    if "TrainState" not in names:
        names.append("TrainState")
    return names


def _entry(name: str) -> str:
    obj = getattr(masked_multistep, name)
    if inspect.isclass(obj):
        # Inherited methods too (flax's `TrainState.create`), but not a tuple's.
        directive = (
            f"autoclass:: masked_multistep.{name}\n"
            "   :members:\n   :inherited-members: tuple"
        )
    elif callable(obj):
        directive = f"autofunction:: masked_multistep.{name}"
    else:
        directive = f"autodata:: masked_multistep.{name}"
    # autodoc writes reStructuredText, so its directives run inside eval-rst.
    return f"## `{name}`\n\n```{{eval-rst}}\n.. {directive}\n```\n"


def _constant_doc(app, what, name, obj, options, lines):
    # autodoc looks for a public constant's `#:` comment in `__init__.py`, where
    # it is only imported, and falls back to its type's docstring (a tuple's
    # "Built-in immutable sequence"), in its entry and in the summary table:
    # the comment is read from the module that defines it.
    if what == "data" and name.startswith("masked_multistep."):
        lines[:] = _data_doc(name.removeprefix("masked_multistep."), obj)


def _data_doc(name: str, obj: object) -> list[str]:
    """The ``#:`` comment of the public constant ``name`` where it is defined."""
    from sphinx.pycode import ModuleAnalyzer

    for module in sorted(m for m in sys.modules if m.startswith("masked_multistep.")):
        if getattr(sys.modules[module], name, None) is not obj:
            continue
        doc = ModuleAnalyzer.for_module(module).find_attr_docs().get(("", name))
        if doc:
            return list(doc)
    raise RuntimeError(
        f"masked_multistep.{name} has no `#:` comment where it is defined"
    )


def _api_entries() -> str:
    names = public_names()
    rows = "\n".join(f"   {name}" for name in names)
    table = (
        "```{eval-rst}\n.. currentmodule:: masked_multistep\n\n"
        f".. autosummary::\n   :nosignatures:\n\n{rows}\n```\n"
    )
    return "\n".join([table, *(_entry(name) for name in names)])


def _fill_api_page(app, docname, source):
    if docname == "api":
        if API_MARKER not in source[0]:
            raise RuntimeError(f"docs/api.md lost its marker line {API_MARKER!r}")
        source[0] = source[0].replace(API_MARKER, _api_entries())


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    # A NamedTuple's fields are documented by its docstring's `Attributes:`;
    # their generated "Alias for field number N" entries would duplicate them.
    doc = getattr(obj, "__doc__", None) or ""
    if doc.startswith("Alias for field number"):
        return True
    return None


def _always_reread_api(app, env, added, changed, removed):
    # The page's content depends on the package, not on its own source file.
    return ["api"] if "api" in env.found_docs else []


def _numpy_bool_by_name(app, doctree):
    # numpy 2 names `np.bool_` "bool", so signatures annotated
    # `bool | np.bool_` read `bool | bool`: show the numpy one by its name.
    from docutils import nodes
    from sphinx import addnodes

    for ref in doctree.findall(addnodes.pending_xref):
        if ref.get("reftarget") == "numpy.bool" and ref.astext() == "bool":
            ref.children = [nodes.Text("np.bool_")]


def setup(app):
    app.connect("source-read", _fill_api_page)
    app.connect("doctree-read", _numpy_bool_by_name)
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
    app.connect("autodoc-process-docstring", _constant_doc)
    app.connect("env-get-outdated", _always_reread_api)
