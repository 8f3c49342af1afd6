"""No import circle among the modules of ``flaxformer_lite/data`` (issue 46, item 5): every
import, at module level or inside a function, read from the source with ``ast``."""

import ast
import pathlib

import flaxformer_lite.data

DATA = pathlib.Path(flaxformer_lite.data.__file__).parent
PACKAGE = "flaxformer_lite.data"


def imports_of(path: pathlib.Path) -> set[str]:
    """The modules of ``flaxformer_lite.data`` that ``path`` imports (``from data import x``
    counts x when it is a module), but those only a type checker reads."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    checked_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and ast.unparse(branch.test) == "TYPE_CHECKING"
        for node in ast.walk(branch)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in checked_only:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    modules = {p.stem for p in DATA.glob("*.py")}
    return {
        name.removeprefix(PACKAGE + ".")
        for name in names
        if name.startswith(PACKAGE + ".") and name.removeprefix(PACKAGE + ".") in modules
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (module -> modules it imports) as a path back to its start."""
    done, path = set(), []

    def visit(node):
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        path.append(node)
        for other in sorted(graph.get(node, ())):
            if cycle := visit(other):
                return cycle
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        if cycle := visit(start):
            return cycle
    return None


def test_the_data_modules_import_each_other_without_a_circle():
    graph = {p.stem: imports_of(p) - {p.stem} for p in DATA.glob("*.py")}
    assert graph["tokenizers"] >= {"tokenizer_base", "hf_tokenizer", "sentencepiece_tokenizer"}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_circle_through_a_lazy_import(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from flaxformer_lite.data.config import DataConfig\n"
        "def f():\n    from flaxformer_lite.data import store\n"
    )
    assert imports_of(module) == {"store"}
