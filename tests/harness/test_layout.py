"""The package's layout holds what the README's drawing says of it: no module imports itself round in a
circle, no two stage folders import each other, `core/` imports no other stage and `kernels/` only `core/`.
Read from the source (every import, inside functions too), so a new import that breaks it fails here."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "moe_eval"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _run_time_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under `if TYPE_CHECKING:` (an import the type checker alone reads runs nothing,
    as import-linter's exclude_type_checking_imports says)."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def _imports() -> dict[str, set[str]]:
    """moe_eval module -> the moe_eval modules it imports when it runs (a `from moe_eval.x import y` of a
    submodule y counts as importing y)."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        source = _module_name(path)
        for node in _run_time_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moe_eval"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    graph[source].add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[source].update(a.name for a in node.names if a.name.startswith("moe_eval."))
    return {m: {d for d in deps if d != m} for m, deps in graph.items()}


def _stage(module: str) -> str:
    """moe_eval.evaluate.golden -> evaluate; moe_eval.runner -> runner (a top-level module is its own)."""
    return module.split(".")[1] if module.count(".") else module


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_imports_itself_round_a_circle():
    assert _circle(_imports()) is None, " -> ".join(_circle(_imports()) or [])


def test_no_two_stages_import_each_other_and_the_bottom_stays_at_the_bottom():
    edges = {(_stage(a), _stage(b)) for a, deps in _imports().items() for b in deps}
    edges = {(a, b) for a, b in edges if a != b}
    both_ways = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
    assert not both_ways, f"stages importing each other: {both_ways}"
    assert not {b for a, b in edges if a == "core"}, "core/ imports no other stage"
    assert {b for a, b in edges if a == "kernels"} <= {"core"}, "kernels/ imports core/ only"
    # The check reads something: the pipeline's own edges are there.
    assert {("runner", "evaluate"), ("evaluate", "gates"), ("runner", "gates"), ("cli", "configs")} <= edges
    assert ("configs", "gates") in edges  # the config asks the registry for each gate's keys


# What does I/O: serving, evaluating through a server, launching processes, the run's own orchestration.
IO_STAGES = ("evaluate", "serve", "launch", "steps", "runner", "worker", "scheduler", "cli")


def test_the_gates_reach_no_stage_that_does_io_even_indirectly():
    """Issue 41: the judge imported moe_eval.evaluate.golden for one constant, and with it the launcher,
    serving and subprocess code; gates/ started golden servers (golden_checks). Now nothing under gates/
    reaches evaluate/, serve/, launch.py or the run's orchestration through any chain of imports."""
    graph = _imports()
    for start in sorted(m for m in graph if _stage(m) == "gates"):
        seen, todo = {start}, [start]
        while todo:
            for dep in graph.get(todo.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        reached = sorted(m for m in seen if _stage(m) in IO_STAGES)
        assert not reached, f"{start} reaches {reached}"


def test_judging_reads_no_file(monkeypatch):
    """gates/ judges from the Measurements alone: with every way to read a file made to fail, the judge
    still gives its checks, sections and verdict (a gate that opened a file would fail here)."""
    import builtins
    import dataclasses
    import io
    import os
    import pathlib

    from moe_eval.gates.judge import judge
    from tests.harness.test_judge import QUESTIONS, TORCH_TP1, load_config, measured

    config = dataclasses.replace(load_config(TORCH_TP1), num_questions=QUESTIONS, accuracy_threshold=0.9)
    m = measured(config)  # built before the reads are closed: the test's own fixtures read files

    def refused(*args, **kwargs):
        raise AssertionError(f"a file was read while judging: {args[:1]}")

    for target, name in ((builtins, "open"), (io, "open"), (os, "open"), (pathlib.Path, "open"),
                         (pathlib.Path, "read_text"), (pathlib.Path, "read_bytes")):  # fmt: skip
        monkeypatch.setattr(target, name, refused)
    got = judge(config, m)
    assert got.verdict == "passed" and {"gate", "paired", "divergence", "golden_gate", "layer_check"} <= set(
        got.sections
    )
