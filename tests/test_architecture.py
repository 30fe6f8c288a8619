"""The package's shape: no import cycles, and no module reaching into another's private state."""

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jmp"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(module: str) -> bool:
    base = PACKAGE.parent.joinpath(*module.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _imports(path: pathlib.Path) -> set[str]:
    """The jmp modules ``path`` imports when it is loaded (module-level statements, not function bodies)."""
    found = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("jmp"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            if not source.startswith("jmp"):
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if _exists(submodule) else source)
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_jmp_module_imports_itself_back():
    graph = _graph()
    assert "jmp.model.distributed_model" in graph and "jmp.torch_bridge.tensor" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_config_imports_nothing_downstream():
    """Data flows config -> mesh -> bridge -> front end: the config depends only on leaf modules."""
    assert _imports(PACKAGE / "runtime" / "config.py") <= {"jmp.errors", "jmp.remat.policy_syntax"}


_OWNED = {
    r"\bmodel\._[a-z]": "distributed_model.py",  # DistributedModel's private state
    r"\boptimizer\._[a-z]": "distributed_optimizer.py",  # DistributedOptimizer's
}


def test_no_module_touches_the_private_state_of_the_model_or_optimizer():
    trespass = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for pattern, owner in _OWNED.items()
        if re.search(pattern, line) and path.name != owner
    ]
    assert not trespass, "\n".join(trespass)
