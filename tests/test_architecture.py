"""Imports go one way (docs/architecture.md): runtime <- passes <- front.

Read from the source, every import statement (also those inside functions).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = {
    "attention", "config", "cpu_kernel", "decode", "dilation", "kernels", "layout", "merge", "ops", "p2p",
    "reference", "roles", "schedule",
}  # fmt: skip
FRONT = {"__init__", "backend", "recompiles", "report", "scale", "testing", "pytest_plugin"}
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
