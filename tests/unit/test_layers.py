"""The import direction (STYLE.md section 2, docs/ARCHITECTURE.md), checked on the
source: every ``import`` in a package, at module level or inside a function, must stay
within what its layer may use, and no module may reach itself again through imports
(no circle of any length, inside a package or across packages). Imports under
``if TYPE_CHECKING:`` are annotations only and are left out. A broken layer or a circle
is fixed by turning an arrow around (a Protocol, a callback, a registration), never by
adding an exception here."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "pybroker"

# The allowed order, lowest first. A module may import modules of its own entry and of
# entries in lower layers, never upward and never sideways into another entry of its own
# layer. A module belongs to the entry that is the longest prefix of its name.
LAYERS: tuple[tuple[str, ...], ...] = (
    # the readiness selector under the selector loop
    ("pybroker.poller",),
    # the bottom: versions, errors, logging, the selector loop, TLS I/O, the C codec
    ("pybroker", "pybroker.errors", "pybroker.logfmt", "pybroker.evloop", "pybroker.tlsio",
     "pybroker._native", "pybroker.goflags"),
    # sans-IO protocol, the files, the options
    ("pybroker.protocol", "pybroker.storage", "pybroker.config"),
    # the domain (no I/O), and the client library (speaks the protocol)
    ("pybroker.core", "pybroker.client"),
    # the TCP server; users of the client library
    ("pybroker.server", "pybroker.tools", "pybroker.spark", "pybroker.bench",
     "pybroker.testing"),
    # replicated topics: hooks into the server's loops and publisher, asked by the
    # server only through server.services.ClusterHooks (imported by the runtime)
    ("pybroker.cluster",),
    # the HTTP API, built on the server's listeners and loops
    ("pybroker.http",),
    # the wiring of every thread (it starts the HTTP server too)
    ("pybroker.runtime",),
    # start-up: options resolved, listeners bound, the runtime run
    ("pybroker.start", "pybroker.nsqd_cli"),
    # the command lines
    ("pybroker.cli",),
    ("pybroker.launch",),
    ("pybroker.__main__",),
)

# package -> modules (prefixes) it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # the domain: no I/O layers, no sockets or selectors; storage only through Protocols
    "pybroker.core": ("pybroker.server", "pybroker.http", "pybroker.storage",
                      "pybroker.client", "pybroker.tools", "pybroker.spark", "pybroker.bench",
                      "socket", "selectors"),
    # sans-IO protocol code
    "pybroker.protocol": ("pybroker.core", "pybroker.server", "pybroker.http",
                          "pybroker.storage", "pybroker.client", "socket", "selectors",
                          "threading"),
    # storage: stdlib, the C codec and its own errors only
    "pybroker.storage": ("pybroker.core", "pybroker.server", "pybroker.http",
                         "pybroker.protocol", "pybroker.client", "pybroker.tools",
                         "socket", "selectors"),
    # users of the broker speak the protocol; they never reach into the server
    "pybroker.client": ("pybroker.core", "pybroker.server", "pybroker.http",
                        "pybroker.storage"),
    "pybroker.tools": ("pybroker.core", "pybroker.server", "pybroker.http",
                       "pybroker.storage"),
    "pybroker.bench": ("pybroker.core", "pybroker.server", "pybroker.http",
                       "pybroker.storage"),
    "pybroker.spark": ("pybroker.core", "pybroker.server", "pybroker.http",
                       "pybroker.storage"),
    # the HTTP API acts through the broker and the loops, not the TCP server's internals
    "pybroker.http": ("pybroker.server.connection", "pybroker.server.handlers",
                      "pybroker.client", "pybroker.tools"),
    # the one event-loop mechanism (server loops, HTTP server, client IOLoop): stdlib only
    "pybroker.evloop": ("pybroker.core", "pybroker.server", "pybroker.http",
                        "pybroker.storage", "pybroker.protocol", "pybroker.client",
                        "pybroker.tools", "pybroker.bench", "pybroker.spark",
                        "pybroker.config", "pybroker.errors", "pybroker._native"),
    "pybroker.config": ("pybroker.core", "pybroker.server", "pybroker.http",
                        "pybroker.storage", "pybroker.protocol"),
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, *, annotations: bool = True,
             type_checking: bool = False) -> list[tuple[int, str]]:
    """(line, name) for every import in the file: ``import a.b`` gives ``a.b``;
    ``from a import b`` gives ``a`` and ``a.b``. With annotations=False the bodies of
    ``if TYPE_CHECKING:`` are left out and ``from a import b`` gives ``a.b`` only (the
    graph then names ``a.b`` if it is a module, else ``a``); type_checking=True then
    keeps the bodies of ``if TYPE_CHECKING:`` (the graph of annotations too)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if (not annotations and not type_checking and isinstance(node, ast.If)
                and _is_type_checking(node.test)):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if annotations:  # the package itself too, for the FORBIDDEN prefixes
                out.append((node.lineno, mod))
            out.extend((node.lineno, f"{mod}.{a.name}") for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _sources() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "_nsqframe" not in p.name)


def test_there_are_sources() -> None:
    assert len(_sources()) > 50


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports(layer: str) -> None:
    bad = []
    for path in _sources():
        mod = _module_name(path)
        if mod != layer and not mod.startswith(layer + "."):
            continue
        for line, name in _imports(path):
            for banned in FORBIDDEN[layer]:
                if name == banned or name.startswith(banned + "."):
                    bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    assert not bad, "\n".join(sorted(set(bad)))


SHARED_IO = {"evloop.py", "poller.py", "tlsio.py"}


@pytest.mark.parametrize("module", sorted(SHARED_IO))
def test_shared_io_modules_import_only_the_standard_library(module: str) -> None:
    """pybroker.evloop (with its pybroker.poller) and pybroker.tlsio sit below every
    layer (the server, HTTP and client all build on them), so they import nothing from
    PyPI and nothing of pybroker but each other."""
    import sys

    own = tuple(f"pybroker.{m.removesuffix('.py')}" for m in SHARED_IO)
    top = {name.split(".")[0] for _, name in _imports(ROOT / module, annotations=False)
           if not name.startswith(own)}
    assert top <= set(sys.stdlib_module_names) | {"__future__"}, top


def test_one_selector_loop_implementation() -> None:
    """Only pybroker.evloop (through its pybroker.poller) creates a selector and runs
    select(); the server's loops, the HTTP server and the client's IOLoop are its
    subclasses."""
    from pybroker.client.loop import IOLoop
    from pybroker.evloop import SelectorLoop
    from pybroker.http.server import HttpServer
    from pybroker.server.loop import EventLoop

    for cls in (IOLoop, HttpServer, EventLoop):
        assert issubclass(cls, SelectorLoop), cls
    makers = [str(p.relative_to(ROOT.parent)) for p in _sources()
              if any(f"{w}(" in p.read_text() for w in ("DefaultSelector", "socketpair",
                                                          "select.epoll", " Poller"))]
    assert makers == ["pybroker/evloop.py", "pybroker/poller.py"], makers


# --- the module graph: circles and the order of layers --------------------------------

def _graph(type_checking: bool = False) -> dict[str, dict[str, int]]:
    """module -> {module it imports at run time (and, with type_checking, for
    annotations): first line}; a ``from a import b`` names the module ``a.b`` when
    there is one, else ``a``."""
    modules = {_module_name(p): p for p in _sources()}
    graph: dict[str, dict[str, int]] = {}
    for mod, path in modules.items():
        edges: dict[str, int] = {}
        for line, name in _imports(path, annotations=False, type_checking=type_checking):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != mod and name.startswith("pybroker"):
                edges.setdefault(name, line)
        graph[mod] = edges
    return graph


def find_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each given
    as one circle through it: a -> b -> ... -> a."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return [_one_circle(graph, set(c)) for c in components]


def _one_circle(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself."""
    start = min(component)
    came: dict[str, str] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w not in component:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came[path[-1]])
                return [start, *reversed(path[:-1]), start] if v != start else [start, start]
            if w not in came:
                came[w] = v
                queue.append(w)
    return sorted(component)


def _describe(graph: dict[str, dict[str, int]], circle: list[str]) -> str:
    members = _component(graph, circle[0])
    steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(circle, circle[1:])]
    return (f"{len(members)} modules in one circle ({', '.join(members)}); one way round:"
            "\n    " + "\n    ".join(steps))


def _component(graph: dict[str, dict[str, int]], start: str) -> list[str]:
    def reach(edges: dict[str, set[str]]) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for w in edges.get(todo.pop(), ()):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen
    forward = {v: set(e) for v, e in graph.items()}
    backward: dict[str, set[str]] = {}
    for v, e in graph.items():
        for w in e:
            backward.setdefault(w, set()).add(v)
    return sorted(reach(forward) & reach(backward))


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, entry) of the longest entry that is the module or a prefix of it."""
    best: tuple[int, str] | None = None
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and (
                    best is None or len(entry) > len(best[1])):
                best = (i, entry)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def wrong_way(graph: dict[str, dict[str, int]]) -> list[str]:
    bad = []
    for mod, edges in sorted(graph.items()):
        mine, my_entry = layer_of(mod)
        for other, line in sorted(edges.items()):
            theirs, their_entry = layer_of(other)
            if their_entry == my_entry:
                continue
            if theirs >= mine:
                how = "upward" if theirs > mine else "sideways"
                bad.append(f"{mod} (line {line}) imports {other}: {how}, "
                           f"{my_entry} (layer {mine}) -> {their_entry} (layer {theirs})")
    return bad


def test_no_import_circles() -> None:
    graph = _graph()
    circles = find_circles(graph)
    assert not circles, "\n".join(_describe(graph, c) for c in circles)


# packages whose modules still name each other's classes in annotations round a circle
# (cut by Protocols, as core, storage and http were; docs/ARCHITECTURE.md): to shrink
ANNOTATION_CIRCLES_LEFT: set[str] = set()


def test_no_circles_through_annotations_outside_the_packages_left() -> None:
    """Annotations (``if TYPE_CHECKING:`` imports) may not close a circle either,
    except inside the packages listed above."""
    graph = _graph(type_checking=True)
    left = [c for c in find_circles(graph)
            if not all(m.rpartition(".")[0] in ANNOTATION_CIRCLES_LEFT for m in c)]
    assert not left, "\n".join(_describe(graph, c) for c in left)


def test_imports_follow_the_order_of_layers() -> None:
    bad = wrong_way(_graph())
    assert not bad, "\n".join(bad)


def test_every_module_is_in_a_layer() -> None:
    for mod in _graph():
        layer_of(mod)


def test_the_checks_see_a_new_circle_and_a_wrong_way_arrow() -> None:
    """The two checks on a copy of the graph with one arrow added each way."""
    graph = _graph()
    graph["pybroker.core.channel"]["pybroker.core.broker"] = 1
    graph["pybroker.core.broker"]["pybroker.core.channel"] = 1
    circles = find_circles(graph)
    assert any({"pybroker.core.channel", "pybroker.core.broker"} <= set(c) for c in circles)
    graph = _graph()
    graph["pybroker.protocol.decoder"]["pybroker.server.loop"] = 7
    assert any(b.startswith("pybroker.protocol.decoder (line 7) imports pybroker.server.loop")
               for b in wrong_way(graph))


_OPTIONAL = {"pyspark", "pyarrow", "py4j", "numpy", "pandas"}  # the spark extra


@pytest.mark.parametrize("module", sorted(_module_name(p) for p in _sources()
                                          if p.name != "__main__.py"))
def test_every_module_imports_alone(module: str) -> None:
    """Each module imports on its own (a circle that only shows at run time would fail
    here in a fresh interpreter's order; this catches a module that cannot load)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in _OPTIONAL:
            pytest.skip(f"{module} needs {e.name}, an optional extra")
        raise
