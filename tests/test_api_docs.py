"""docs/api.md is true to the code: every public name of ``ring_rewrite`` and of
``ring_rewrite.testing`` is listed there with the code's signature and the file that defines it,
every ``ring_rewrite.`` name the page mentions exists, and every public name has a docstring
(a function's with ``Args:``, ``Returns:`` and ``Example::``)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import ring_rewrite
import ring_rewrite.testing

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
TEXT = API.read_text()

PUBLIC = [f"ring_rewrite.{name}" for name in ring_rewrite.__all__] + [
    f"ring_rewrite.testing.{name}" for name in ring_rewrite.testing.__all__
]

# An entry: a heading with the name (and, for a callable, its signature), then a paragraph that
# ends with the file that defines it.
_ENTRY = re.compile(r"^### `(ring_rewrite(?:\.\w+)+)(\(.*\))?`$", re.MULTILINE)
_MENTION = re.compile(r"\bring_rewrite(?:\.[A-Za-z_]\w*)+")
_FILE = re.compile(r"`([\w/]+\.py)`\.?\s*$")


def _resolve(dotted: str):
    """The object ``dotted`` names, as a user reaches it: attributes from the top package on,
    importing a submodule where no attribute has its name yet (``ring_rewrite.backend`` is the
    function, not the module)."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, attr in enumerate(parts[1:], 2):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i]))
    return obj


def _entries() -> dict[str, tuple[str | None, str]]:
    """``name -> (signature or None, body)`` of every entry of the page."""
    matches = list(_ENTRY.finditer(TEXT))
    entries = {}
    for match, after in zip(matches, [*matches[1:], None]):
        body = TEXT[match.end() : after.start() if after else len(TEXT)]
        body = body.split("\n## ", 1)[0].split("\n**", 1)[0]
        assert match.group(1) not in entries, f"{match.group(1)} is listed twice"
        entries[match.group(1)] = (match.group(2), body.strip())
    return entries


ENTRIES = _entries()


def _signature(obj) -> str:
    """``inspect.signature`` without annotations, as the page writes it."""
    sig = inspect.signature(obj)
    empty = inspect.Parameter.empty
    params = [p.replace(annotation=empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=empty))


def _attribute_docstring(module, name: str) -> str | None:
    """The string literal right after ``name = ...`` at the top level of ``module``'s source."""
    body = ast.parse(inspect.getsource(module)).body
    for node, following in zip(body, body[1:]):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                return following.value.value
    return None


def _defining_module(dotted: str):
    """The module whose source assigns the constant ``dotted`` names."""
    package, name = dotted.rsplit(".", 1)
    module = importlib.import_module(package)
    for sub in [module, *(importlib.import_module(f"{package}.{m}") for m in _submodules(module))]:
        if _attribute_docstring(sub, name) is not None or re.search(
            rf"^{name}\s*[:=]", inspect.getsource(sub), re.MULTILINE
        ):
            return sub
    raise LookupError(dotted)


def _submodules(package) -> list[str]:
    folder = Path(package.__file__).parent
    return sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_is_listed(name):
    assert name in ENTRIES, f"docs/api.md has no entry '### `{name}...`'"


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_has_a_docstring(name):
    obj = _resolve(name)
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
        # NOTE: a dataclass without a docstring gets its signature as one.
        assert doc and not doc.startswith(f"{obj.__name__}("), f"{name} has no docstring of its own"
    elif callable(obj):
        doc = inspect.getdoc(obj) or ""
        missing = [part for part in ("Args:", "Returns:", "Example::") if part not in doc]
        assert not missing, f"{name}'s docstring lacks {missing}"
    else:
        module = _defining_module(name)
        assert _attribute_docstring(module, name.rsplit(".", 1)[1]), f"{name} has no docstring"


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_signatures_are_the_code_s(name):
    listed, _ = ENTRIES[name]
    obj = _resolve(name)
    if listed is None:
        assert not callable(obj) or inspect.isclass(obj), f"{name} is listed without its signature"
        return
    assert listed == _signature(obj), f"docs/api.md: {name}{listed}; the code: {name}{_signature(obj)}"


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_entries_name_the_file_that_defines_them(name):
    _, body = ENTRIES[name]
    found = _FILE.search(body)
    assert found, f"the entry of {name} does not end with its file"
    obj = _resolve(name)
    if inspect.isclass(obj) or callable(obj):
        source = Path(inspect.getsourcefile(inspect.unwrap(obj))).resolve()
    else:
        source = Path(_defining_module(name).__file__).resolve()
    assert source == (ROOT / found.group(1)).resolve(), f"{name} is defined in {source}, not {found.group(1)}"


def test_every_name_the_page_mentions_exists():
    missing = []
    for dotted in sorted(set(_MENTION.findall(TEXT))):
        try:
            _resolve(dotted)
        except (ImportError, AttributeError):
            missing.append(dotted)
    assert not missing, f"docs/api.md mentions names that do not exist: {missing}"
