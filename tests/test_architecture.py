"""Imports go one way (docs/architecture.md): runtime <- passes <- front.

Read from the source, every import statement (also those inside functions).

And the project's docs are its own: every Note the code or the docs point to is written in the
repository, and nothing cites a contract kept outside it (docs/semantics.md is the contract).
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = {
    "attention", "comm", "config", "cpu_choice", "cpu_kernel", "decode", "dilation", "kernels", "layout", "merge",
    "numerics", "ops", "program", "reference", "roles", "schedule", "site_plan",
}  # fmt: skip
FRONT = {
    "__init__", "backend", "cache", "hf", "inductor_fixes", "memory", "recompiles", "report", "scale", "testing",
    "pytest_plugin",
}  # fmt: skip
LAYERS = {"runtime": 0, "passes": 1, "front": 2}


def _modules() -> dict[str, tuple[str, Path]]:
    """Every project module by dotted name, with its layer."""
    found = {}
    for path in sorted((ROOT / "ring_rewrite").rglob("*.py")):
        parts = path.relative_to(ROOT / "ring_rewrite").with_suffix("").parts
        top = parts[0]
        layer = "runtime" if top in RUNTIME else "front" if top in FRONT else None
        assert layer is not None, f"{path}: which layer? (add it to RUNTIME or FRONT here)"
        found[".".join(("ring_rewrite", *parts)).removesuffix(".__init__")] = (layer, path)
    for path in sorted((ROOT / "passes").rglob("*.py")):
        name = ".".join(("ring_rewrite", "passes", *path.relative_to(ROOT / "passes").with_suffix("").parts))
        found[name.removesuffix(".__init__")] = ("passes", path)
    return found


MODULES = _modules()


def _layer_of(name: str) -> str | None:
    while name:
        if name in MODULES:
            return MODULES[name][0]
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path) -> list[tuple[str, str | None]]:
    """``(imported module, name taken from it or None)`` of every import in the file; ``from
    package import module`` imports the module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    result: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            result += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                result.append((sub, None) if sub in MODULES else (target, alias.name))
    return result


def test_every_module_has_a_layer():
    assert {layer for layer, _ in MODULES.values()} == set(LAYERS)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_one_way(module):
    layer, path = MODULES[module]
    for target, _ in _imports(module, path):
        if target.split(".")[0] != "ring_rewrite":
            continue
        other = _layer_of(target)
        assert other is not None, f"{module} imports unknown {target}"
        assert LAYERS[other] <= LAYERS[layer], f"{module} ({layer}) imports {target} ({other})"


def _project_imports(module: str) -> set[str]:
    """The project modules ``module`` imports (a name taken from a module: that module)."""
    found = set()
    for target, _ in _imports(module, MODULES[module][1]):
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != module:
            found.add(target)
    return found


def test_no_import_circles():
    """No module reaches itself through what it imports (type-checking imports included): each
    can be read, and tested, from the ones it stands on."""
    graph = {m: _project_imports(m) for m in MODULES}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError(" -> ".join(path[path.index(module) :] + [module]))
        if module not in done:
            for other in sorted(graph[module]):
                visit(other, path + [module])
            done.add(module)

    for module in sorted(graph):
        visit(module, [])


@pytest.mark.parametrize("module", sorted(m for m, (layer, _) in MODULES.items() if layer != "passes"))
def test_nothing_outside_passes_imports_a_private_name_of_it(module):
    _, path = MODULES[module]
    for target, name in _imports(module, path):
        if target.startswith("ring_rewrite.passes"):
            private = [p for p in (*target.split("."), name or "") if p.startswith("_")]
            assert not private, f"{module} imports {private} from {target}"


def test_every_package_installs_and_the_passes_under_the_project_namespace():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'package-dir = {"ring_rewrite.passes" = "passes"}' in text
    listed = text.split("\npackages = ")[1].split("\n")[0]
    packages = {m for m, (_, path) in MODULES.items() if path.name == "__init__.py"}
    assert {p.strip(' "') for p in listed.strip("[]").split(",")} == packages


# ---- the docs are the project's own ----------------------------------------------------------


def _project_files() -> list[Path]:
    """Every file git tracks or would track (untracked ones that are not ignored); outside a git
    checkout, every file under the project's folders."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout.decode()  # fmt: skip
        paths = [ROOT / name for name in listed.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        tops = ("ring_rewrite", "passes", "tests", "examples", "benchmarks", "docs")
        paths = [p for top in tops for p in (ROOT / top).rglob("*")] + list(ROOT.glob("*.md"))
        paths = [p for p in paths if "__pycache__" not in p.parts]
    return sorted(p for p in paths if p.is_file())


FILES = _project_files()
SOURCES = [p for p in FILES if p.suffix in (".py", ".md", ".c")]

# A Note is written as its title line, then a line of tildes, in a docstring, a markdown file or
# behind a comment marker (``#``, ``//``, `` * ``):
#
#     # Note [Positions in sharded mode]
#     # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
_MARKER = r"[ \t]*(?:(?:#|//|\*)[ \t]*)?"
_DEFINITION = re.compile(rf"^{_MARKER}Note \[([^\]\n]+)\][ \t]*\n{_MARKER}~~~+[ \t]*$", re.MULTILINE)
# A reference may wrap over lines, behind comment markers or the tree drawing of
# docs/architecture.md; joined, it reads "Note" then its title in brackets.
_LINE_START = re.compile(r"\n[ \t]*(?:(?:#|//|\*|>|[│├└])[ \t]*)*")
_REFERENCE = re.compile(r"\bNote\s+\[([^\]]+)\]")


def _notes_defined() -> dict[str, list[str]]:
    defined: dict[str, list[str]] = {}
    for path in SOURCES:
        for match in _DEFINITION.finditer(path.read_text()):
            defined.setdefault(match.group(1), []).append(str(path.relative_to(ROOT)))
    return defined


def test_every_note_is_defined_once():
    twice = {name: where for name, where in _notes_defined().items() if len(where) > 1}
    assert not twice, f"Notes written more than once: {twice}"


def test_every_note_referred_to_is_defined():
    defined = _notes_defined()
    dangling = []
    for path in SOURCES:
        joined = _LINE_START.sub(" ", path.read_text())
        for match in _REFERENCE.finditer(joined):
            name = " ".join(match.group(1).split())
            if name not in defined:
                dangling.append(f"{path.relative_to(ROOT)}: {name}")
    assert not dangling, "Notes referred to but written nowhere:\n" + "\n".join(sorted(set(dangling)))


_WITH_FILE = re.compile(r"\bNote\s+\[[^\]]+\]\s+in\s+`+[\w/.\-]+\.(?:py|md|c)`+")


def test_notes_are_referred_to_by_their_title_alone():
    """A Note's title is unique (above), so a reference names no file: one that did would go
    stale when the Note moves with its code."""
    found = [
        f"{path.relative_to(ROOT)}: {' '.join(match.group().split())}"
        for path in SOURCES
        for match in _WITH_FILE.finditer(_LINE_START.sub(" ", path.read_text()))
    ]
    assert not found, "refer to a Note by its title:\n" + "\n".join(found)


# Spelled in pieces so that this file does not match itself.
_OUTSIDE = ("../" + "shared", "SPEC" + " §", "SPEC" + ".md", "FINDINGS" + ".md")


def test_nothing_cites_a_contract_outside_the_repository():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in FILES
        for number, line in enumerate(path.read_bytes().decode(errors="replace").splitlines(), 1)
        if any(text in line for text in _OUTSIDE)
    ]
    assert not found, "cite docs/semantics.md instead:\n" + "\n".join(found)


# ---- comments say what the code does, not when it changed -------------------------------------

# History belongs to git log: a comment or docstring that carries a date or names a commit tells
# what the code was, and goes stale when it changes again. Every file is checked, none excepted.
_HISTORY = (
    re.compile(r"\b\d{4}-\d{2}-\d{2}\b"),  # a date, YYYY-MM-DD
    re.compile(r"\bcommits? [0-9a-f]{7,40}\b", re.IGNORECASE),  # a commit named by its hash
)
_C_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)


def _python_comments(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and docstring (any string statement: module, class and
    function docstrings, and those under an assignment) of a Python file."""
    import io
    import tokenize

    source = path.read_text()
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.append((node.lineno, node.value.value))
    return found


def _c_comments(path: Path) -> list[tuple[int, str]]:
    source = path.read_text()
    return [(source.count("\n", 0, m.start()) + 1, m.group()) for m in _C_COMMENT.finditer(source)]


def test_no_comment_or_docstring_carries_a_date_or_a_commit():
    tops = ("ring_rewrite", "passes", "tests", "examples")
    found = []
    for path in FILES:
        if path.relative_to(ROOT).parts[0] not in tops or path.suffix not in (".py", ".c"):
            continue
        comments = _python_comments(path) if path.suffix == ".py" else _c_comments(path)
        for line, text in comments:
            for pattern in _HISTORY:
                for match in pattern.finditer(text):
                    at = line + text.count("\n", 0, match.start())
                    found.append(f"{path.relative_to(ROOT)}:{at}: {match.group()}")
    assert not found, "say what the code does and why (history is in git log):\n" + "\n".join(found)


def test_the_sites_functions_fit_in_a_head():
    """``ring_rewrite/attention.py``: no function over 40 lines or 6 positional parameters; what
    a site call's steps share lives in ``_Forward`` / ``_Backward`` (Note [The site program]).
    The entry points take the inputs of the site's traced body, ``SitePlan.build`` the plan's
    fields (keyword-only)."""
    entry = {"site_forward", "site_backward"}
    tree = ast.parse((ROOT / "ring_rewrite" / "attention.py").read_text())
    long = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name in entry:
            continue
        positional = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
        lines = node.end_lineno - node.lineno + 1
        if lines > 40 or len(positional) > 6:
            long.append(f"{node.name}: {lines} lines, {len(positional)} positional parameters")
    assert not long, long
