"""The package's import graph has no cycle: no module imports one that imports it back, however
far round, the compiled modules (pyx/) and imports inside functions included. A cycle works only
by the order imports happen to run in, and the next import moved to the top breaks it."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _setup_modules():
    """{pyx source stem: compiled module name}, as setup.py builds them."""
    text = (ROOT / "setup.py").read_text()
    verbs = ast.literal_eval(re.search(r"^VERBS_MODULES = (\[.*?\])", text, re.M).group(1))
    other = ast.literal_eval(re.search(r"^OTHER_MODULES = (\{.*?\})", text, re.M).group(1))
    return {**{m: f"pyrdma._verbs.{m}" for m in verbs}, **other}


def _python_modules():
    """{module name: path} of the package's Python modules."""
    modules = {}
    for path in (ROOT / "pyrdma").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports_of_python(path, name, is_package):
    """What ``path`` imports: for each import a list of names, the first of which that is one of
    the package's modules counts (``from pkg import x``: the submodule pkg.x, else pkg itself)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [[a.name] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:          # relative: resolved against this module's package
                base = name.split(".")[:len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found += [[f"{module}.{a.name}", module] for a in node.names]
    return found


_PYX_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+c?import\s+(.+)|c?import\s+([\w., ]+))", re.M)


def _imports_of_pyx(path):
    found = []
    for m in _PYX_IMPORT.finditer(path.read_text()):
        if m.group(1):
            found += [[f"{m.group(1)}.{n.strip().split(' ')[0]}", m.group(1)]
                      for n in m.group(2).strip("()").split(",") if n.strip()]
        else:
            found += [[n.strip().split(" ")[0]] for n in m.group(3).split(",")]
    return found


def import_graph():
    """{module: the package's modules it imports}."""
    modules = {name: ("py", path) for name, path in _python_modules().items()}
    modules.update({name: ("pyx", ROOT / "pyx" / f"{stem}.pyx") for stem, name in _setup_modules().items()})
    graph = {}
    for name, (kind, path) in modules.items():
        raw = (_imports_of_python(path, name, path.name == "__init__.py") if kind == "py"
               else _imports_of_pyx(path))
        edges = set()
        for names in raw:
            # the first name that is (the longest prefix of) one of the package's modules
            for target in names:
                parts = target.split(".")
                hit = next((".".join(parts[:k]) for k in range(len(parts), 0, -1)
                            if ".".join(parts[:k]) in modules), None)
                if hit is not None and (hit == target or target == names[-1]):
                    if hit != name:
                        edges.add(hit)
                    break
        graph[name] = edges
    return graph


def _cycles(graph):
    """Each strongly connected group of more than one module (Tarjan), sorted."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def test_the_import_graph_sees_the_edges_it_must():
    # the checker itself: an edge of each kind it has to find
    graph = import_graph()
    assert "pyrdma.collectives.bootstrap" in graph["pyrdma.torch"]                 # from ... import
    assert "pyrdma._hostcalls" in graph["pyrdma.collectives.hostplans"]           # a compiled module
    assert "pyrdma._engine" in graph["pyrdma._hostcalls"]                          # a cimport in pyx
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_one_that_imports_it_back():
    cycles = _cycles(import_graph())
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


if __name__ == "__main__":      # the graph, for a look at the layers
    for module, edges in sorted(import_graph().items()):
        print(module, "->", ", ".join(sorted(edges)))
    pytest.main([__file__])
