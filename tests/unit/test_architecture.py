"""The layout DESIGN.md promises, checked on the source: who may import whom."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ("ingress", "consumer", "outbox_worker")


def imports(path: Path, *, top_level_only: bool) -> set[str]:
    """The top package of every module `path` imports (at module level only, if asked)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("component", COMPONENTS)
def test_components_never_import_each_other(component: str) -> None:
    others = set(COMPONENTS) - {component}
    offenders = {
        str(path.relative_to(ROOT)): sorted(imports(path, top_level_only=False) & others)
        for path in (ROOT / component).rglob("*.py")
    }
    assert {path: found for path, found in offenders.items() if found} == {}


def test_the_kernel_is_the_ground_floor() -> None:
    """The kernel imports neither a process nor the tooling above them, anywhere."""
    above = {*COMPONENTS, "control"}
    offenders = {
        str(path.relative_to(ROOT)): sorted(imports(path, top_level_only=False) & above)
        for path in (ROOT / "payhook").rglob("*.py")
    }
    assert {path: found for path, found in offenders.items() if found} == {}


@pytest.mark.parametrize("component", COMPONENTS)
def test_no_process_imports_the_tooling_above_it(component: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(imports(path, top_level_only=False) & {"control"})
        for path in (ROOT / component).rglob("*.py")
    }
    assert {path: found for path, found in offenders.items() if found} == {}


def test_the_tooling_starts_a_process_only_from_the_command_that_runs_it() -> None:
    """Importing `control` (the dashboard, say) does not import a process."""
    offenders = {
        str(path.relative_to(ROOT)): sorted(imports(path, top_level_only=True) & set(COMPONENTS))
        for path in (ROOT / "control").rglob("*.py")
    }
    assert {path: found for path, found in offenders.items() if found} == {}
