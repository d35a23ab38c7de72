"""The shape of nbtrain's import graph, read from the source with :mod:`ast` (no nbtrain module is imported).

What is checked, and why:

1. **No import cycles** between nbtrain's modules (a module is one ``.py`` file; ``pkg/__init__.py`` is module
   ``pkg``). Every import statement counts, wherever it is, *including imports inside functions*: an import moved
   into a function to dodge a circular import is still a cycle in the design, only one that fails later and less
   predictably. Imports under ``if TYPE_CHECKING:`` are not counted (they never run).
2. **No private names across modules**: ``from nbtrain.x import _name`` (one leading underscore, not a dunder)
   reaches into another module's internals; a name another module needs is public API and should be named so.
3. **Layers import one way**: data -> models -> profiler -> planner -> run -> app (``nbtrain.notebook``,
   ``nbtrain.cli``, ``nbtrain.demo``). A module may import its own layer and any layer below it, never one above.
   The single files directly in ``nbtrain/`` that everything uses (errors, units, table) are the *foundation*:
   importable from anywhere, importing only each other. ``nbtrain/__init__.py`` is the public facade and may
   import anything, but no module inside nbtrain may import the facade (``import nbtrain``, or ``from nbtrain
   import X`` where X is not a submodule): the facade is for users, and going through it hides the real edge.

How an import statement becomes edges (:func:`import_edges`):

* relative imports are resolved against the importing module's package;
* ``import a.b.c`` is an edge to ``a.b.c``; ``from a.b import c`` is an edge to ``a.b.c`` when ``a/b/c.py`` (or
  ``a/b/c/``) exists, else an edge to ``a.b`` (``c`` is a name defined there);
* importing a submodule runs the ``__init__`` of every package above it, so each such package gets an *implicit*
  edge too. An implicit edge from a module to one of its own ancestor packages (``nbtrain.a.b`` -> ``nbtrain.a``)
  is dropped: Python runs the ancestors' ``__init__`` before the module anyway, so that edge says nothing. An
  *explicit* edge to an ancestor (``from nbtrain.a import name_defined_in_a_init``, or ``import nbtrain``) is kept:
  it can close a real cycle when that ``__init__`` imports the module back. Edges from a package ``__init__`` to
  its own submodules are ordinary edges.

Not seen by this test: imports done with ``importlib.import_module(...)`` on computed strings (the facade's lazy
``_PUBLIC`` table, :mod:`nbtrain.models.resolve`), and attribute access such as ``nbtrain.x._private`` after an
``import nbtrain.x``.
"""

from __future__ import annotations

import ast
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "nbtrain"

# The layers, lowest first. A module may import modules of its own layer and of any layer before it in this tuple.
LAYER_ORDER = ("foundation", "data", "models", "profiler", "planner", "run", "app")

# The layer of each top-level module or subpackage of nbtrain (by its name right under ``nbtrain``).
LAYER_OF = {
    # Foundation: plain single files directly in nbtrain/, used by every layer; they import only each other.
    "errors": "foundation",
    "units": "foundation",  # imports errors
    "table": "foundation",
    "checks": "foundation",  # a positive-integer check, powers of two: imports errors
    "expert_dispatch": "foundation",  # expert parallelism's token dispatch: torch only; the executor and link_bench
    "gradients": "foundation",  # clipping gradients that may be DTensors: torch only; the trainer and the calibration
    "tensor_memory": "foundation",  # the tensors a rank holds, counted on the CPU: the trainer and the profile's timing
    "gc_pause": "foundation",  # the garbage collector held off: the trainer's steps and the profile's timed steps
    "files": "foundation",  # a file written whole (renamed over): the links and profile caches, the workers' reports
    # Data: nbtrain/data.py, and the stdlib corpus behind it (data_corpus is data's own helper, not shared
    # infrastructure: it tokenizes the stdlib documents that nbtrain.data serves, and uses torch).
    "data": "data",
    "data_corpus": "data",
    "data_lengths": "data",  # documents with a measured length mix (the Wikipedia histogram), filled from the corpus
    # The subpackages, in layer order.
    "models": "models",
    "profiler": "profiler",
    "planner": "planner",
    "run": "run",
    # App level: what users drive. notebook and cli share the top layer; demo.py is a top-level file but clearly
    # app-level (it builds a model, plans, and trains: it imports models, planner and the facade; cli and
    # notebook.cell call it), so it is in the top layer with them.
    "notebook": "app",
    "cli": "app",
    "plan_flags": "app",  # the planning flags cli and notebook.magics share: argparse only, so cli stays IPython-free
    "demo": "app",
}


# --- the graph builder -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Edge:
    """One module importing another, as written at ``file:line``."""

    importer: str
    imported: str
    file: str  # the importer's path, relative to the root directory
    line: int
    names: tuple[str, ...] = ()  # for ``from imported import names``: the names taken from ``imported`` itself
    implicit: bool = False  # a package whose ``__init__`` runs on the way to the named module

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def discover_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (found in ``root/package``): dotted name -> file."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_edges(root: Path, package: str) -> list[Edge]:
    """Every import between modules of ``package`` (in ``root/package``), sorted by file and line.

    Imports inside functions and classes count; those under ``if TYPE_CHECKING:`` do not. Imports of anything
    outside the package are left out. See the module docstring for how a statement becomes edges.
    """
    modules = discover_modules(root, package)
    edges = []
    for importer, path in modules.items():
        file = path.relative_to(root).as_posix()
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _executed_imports(tree):
            explicit = _explicit_targets(node, importer, is_package, package, modules)
            implicit = {ancestor for target in explicit for ancestor in _ancestors(target) if ancestor in modules}
            for target, names in explicit.items():
                edges.append(Edge(importer, target, file, node.lineno, names))
            for target in sorted(implicit - explicit.keys()):
                edges.append(Edge(importer, target, file, node.lineno, implicit=True))
    return sorted(edges, key=lambda e: (e.file, e.line, e.imported))


def _executed_imports(tree: ast.AST):
    """The import statements of a module, at any depth, except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _explicit_targets(node, importer: str, is_package: bool, package: str, modules) -> dict[str, tuple[str, ...]]:
    """The modules an import statement names: module -> names taken from that module (a ``from`` import's
    attributes; empty when the module itself is what is imported)."""
    targets: dict[str, list[str]] = {}
    if isinstance(node, ast.Import):
        for alias in node.names:
            target = _existing(alias.name, package, modules)
            if target:
                targets.setdefault(target, [])
        return {target: tuple(names) for target, names in targets.items()}
    base = _absolute(node.module, node.level, importer, is_package)
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if alias.name != "*" and submodule in modules:
            targets.setdefault(submodule, [])
        else:
            target = _existing(base, package, modules)
            if target:
                targets.setdefault(target, []).append(alias.name)
    return {target: tuple(names) for target, names in targets.items()}


def _absolute(module: str | None, level: int, importer: str, is_package: bool) -> str:
    """The absolute name behind ``from <level dots><module> import ...`` written in ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _existing(name: str, package: str, modules) -> str | None:
    """The module of ``package`` that importing ``name`` reaches (its longest existing prefix); None outside."""
    if name != package and not name.startswith(package + "."):
        return None
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name if name in modules else None


def _ancestors(module: str) -> list[str]:
    """The packages above ``module``, outermost first: ``a.b.c`` -> ``a``, ``a.b``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


# --- the checks --------------------------------------------------------------------------------------------------


def dependency_graph(edges: list[Edge]) -> dict[str, dict[str, list[Edge]]]:
    """importer -> imported -> the edges saying so; without self-imports and without the implicit edges from a
    module to its own ancestor packages."""
    graph: dict[str, dict[str, list[Edge]]] = defaultdict(dict)
    for edge in edges:
        if edge.importer == edge.imported:
            continue
        if edge.implicit and edge.imported in _ancestors(edge.importer):
            continue
        graph[edge.importer].setdefault(edge.imported, []).append(edge)
    return graph


def strongly_connected_components(graph: dict[str, dict[str, list[Edge]]]) -> list[list[str]]:
    """Tarjan's algorithm: the components of more than one module, each sorted, largest first."""
    nodes = sorted(set(graph) | {target for targets in graph.values() for target in targets})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, {})):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in nodes:
        if node not in index:
            visit(node)
    return sorted(components, key=lambda c: (-len(c), c))


def shortest_cycle(graph: dict[str, dict[str, list[Edge]]], component: list[str]) -> list[Edge]:
    """One concrete cycle through the component's first module: the shortest, as the edges that make it."""
    start, members = component[0], set(component)
    came_by: dict[str, Edge] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target, edges in sorted(graph.get(node, {}).items()):
            if target not in members or target in came_by:
                continue
            came_by[target] = edges[0]
            if target == start:
                path, at = [], start
                while True:
                    path.append(came_by[at])
                    at = came_by[at].importer
                    if at == start:
                        return path[::-1]
            queue.append(target)
    raise AssertionError(f"no cycle through {start} in {component}")


def describe_cycles(edges: list[Edge]) -> str:
    """Every cycle, for an assertion message: each component's modules, one concrete cycle, and every edge inside
    the component (one of which has to go)."""
    graph = dependency_graph(edges)
    components = strongly_connected_components(graph)
    lines = [f"{len(components)} import cycle(s) (strongly connected components of more than one module):"]
    for number, component in enumerate(components, 1):
        members = set(component)
        lines.append(f"\nSCC {number} ({len(component)} modules): {', '.join(component)}")
        cycle = shortest_cycle(graph, component)
        lines.append("  one cycle: " + cycle[0].importer + "".join(
            f" -> {edge.imported} ({edge.where})" for edge in cycle))
        lines.append("  edges inside it:")
        for importer in component:
            for target, target_edges in sorted(graph.get(importer, {}).items()):
                if target in members:
                    wheres = ", ".join(edge.where + (" (implicit: package init)" if edge.implicit else "")
                                       for edge in target_edges)
                    lines.append(f"    {importer} -> {target}  [{wheres}]")
    return "\n".join(lines)


def private_imports(edges: list[Edge]) -> list[tuple[str, str, str, str]]:
    """``(importer, module, name, file:line)`` for each ``from module import _name`` across modules."""
    return [(edge.importer, edge.imported, name, edge.where)
            for edge in edges
            if not edge.implicit and edge.importer != edge.imported
            for name in edge.names
            if name.startswith("_") and not (name.startswith("__") and name.endswith("__"))]


def layer_of(module: str, package: str, layers: dict[str, str]) -> str:
    """The layer of a module: ``facade`` for the package itself, else that of its top-level name."""
    if module == package:
        return "facade"
    return layers[module.split(".")[1]]


def layer_violations(edges: list[Edge], package: str, layers: dict[str, str],
                     order: tuple[str, ...] = LAYER_ORDER) -> list[tuple[str, str, str, str, str]]:
    """``(importer, imported, importer's layer, imported's layer, file:line)`` for each import that goes up a
    layer, or that reaches the facade from inside the package. The facade itself may import anything."""
    violations = []
    for edge in edges:
        if edge.implicit or edge.importer == package or edge.importer == edge.imported:
            continue  # implicit edges are to packages of the same layer as the named module
        upper = layer_of(edge.importer, package, layers)
        lower = layer_of(edge.imported, package, layers)
        if lower == "facade" or order.index(upper) < order.index(lower):
            violations.append((edge.importer, edge.imported, upper, lower, edge.where))
    return violations


def _listing(title: str, rows) -> str:
    return "\n".join([f"{len(rows)} {title}:"] + ["  " + "  ".join(row) for row in rows])


# --- the specification -------------------------------------------------------------------------------------------


def test_no_module_imports_itself_back_even_through_function_level_imports():
    edges = import_edges(ROOT, PACKAGE)
    cycles = strongly_connected_components(dependency_graph(edges))
    assert not cycles, describe_cycles(edges)


def test_no_module_imports_another_modules_private_names():
    offenders = private_imports(import_edges(ROOT, PACKAGE))
    assert not offenders, _listing("private names imported from another module (importer, module, name, where)",
                                   offenders)


def test_every_top_level_module_has_a_layer():
    top_level = {name.split(".")[1] for name in discover_modules(ROOT, PACKAGE) if name != PACKAGE}
    assert top_level == set(LAYER_OF), (
        f"unclassified: {sorted(top_level - set(LAYER_OF))}; gone: {sorted(set(LAYER_OF) - top_level)}")
    assert set(LAYER_OF.values()) <= set(LAYER_ORDER)


def test_layers_import_only_downward_and_nothing_inside_imports_the_facade():
    violations = layer_violations(import_edges(ROOT, PACKAGE), PACKAGE, LAYER_OF)
    assert not violations, _listing("imports against the layers (importer, imported, its layer, their layer, where)",
                                    violations)


def test_the_checks_catch_a_function_level_cycle_a_private_import_and_a_layer_breach(tmp_path):
    files = {
        "fake/__init__.py": '"""The facade."""\n',
        "fake/errors.py": "from fake.sub.d import D  # foundation reaching up a layer\n",
        "fake/a.py": "from fake.b import helper\n\n_secret = 1\n",
        "fake/b.py": ("from typing import TYPE_CHECKING\n"
                      "\n"
                      "if TYPE_CHECKING:\n"
                      "    from fake.c import Thing  # never runs: no b -> c edge, so no b <-> c cycle\n"
                      "\n"
                      "\n"
                      "def helper():\n"
                      "    from .a import _secret  # hidden in a function: still closes a -> b -> a\n"
                      "    return _secret\n"),
        "fake/c.py": "import fake  # the facade, from inside\nfrom fake.b import helper\n\nThing = object\n",
        # A package importing its submodules, and a submodule importing a sibling through the package: the
        # implicit d -> sub edge (sub's __init__ runs first anyway) must not make a sub <-> d cycle.
        "fake/sub/__init__.py": "from fake.sub.d import D\n",
        "fake/sub/d.py": "from fake.sub import e\n\nD = e\n",
        "fake/sub/e.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    edges = import_edges(tmp_path, "fake")

    assert strongly_connected_components(dependency_graph(edges)) == [["fake.a", "fake.b"]]
    report = describe_cycles(edges)
    assert "fake.a -> fake.b (fake/a.py:1) -> fake.a (fake/b.py:8)" in report, report
    assert private_imports(edges) == [("fake.b", "fake.a", "_secret", "fake/b.py:8")]
    layers = {"errors": "foundation", "a": "app", "b": "app", "c": "app", "sub": "models"}
    assert layer_violations(edges, "fake", layers) == [
        ("fake.c", "fake", "app", "facade", "fake/c.py:1"),
        ("fake.errors", "fake.sub.d", "foundation", "models", "fake/errors.py:1"),
    ]


# -- the layout the map promises (docs/ARCHITECTURE.md) ----------------------------------------------------------------
MAX_LINES = 400


def test_no_module_is_over_four_hundred_lines():
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / PACKAGE).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (cut them by concern): {long}"


def test_every_subpackage_says_what_it_is_in_its_docstring():
    silent = [str(p.relative_to(ROOT)) for p in sorted((ROOT / PACKAGE).rglob("__init__.py"))
              if len((ast.get_docstring(ast.parse(p.read_text())) or "").split()) < 8]
    assert not silent, f"packages without a docstring that names their idea: {silent}"


def test_the_architecture_map_lists_a_cells_path_of_at_most_twelve_existing_files():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## One `%%autoparallel --launch` cell, file by file", 1)[1].split("\n## ", 1)[0]
    steps = [line for line in section.splitlines() if line[:3].rstrip(".").strip().isdigit()]
    files = [line.split("`")[1] for line in steps]
    assert 0 < len(files) <= 12, files
    missing = [f for f in files if not (ROOT / f).is_file()]
    assert not missing, f"the map names files that do not exist: {missing}"
    named = {str(p.relative_to(ROOT)) for p in (ROOT / PACKAGE).rglob("*.py")}
    unnamed = sorted(f for f in named if f.split("/")[-1] != "__init__.py" and f"`{f}`" not in text
                     and f"`{f.split('/', 1)[1]}`" not in text and f"`{f.split('/')[-1]}`" not in text)
    assert not unnamed, f"modules the map does not mention: {unnamed}"
