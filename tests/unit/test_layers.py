"""The import direction (STYLE.md section 2, ARCHITECTURE.md "Arrows"), checked on the
source: every ``import`` in a package, at module level or inside a function, must stay
within what its layer may use. A broken layer is fixed by moving code, never by adding
an exception here."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "pybroker"

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


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
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


@pytest.mark.parametrize("module", ["evloop.py", "tlsio.py"])
def test_shared_io_modules_import_only_the_standard_library(module: str) -> None:
    """pybroker.evloop and pybroker.tlsio sit below every layer (the server, HTTP and
    client all build on them), so they import nothing of pybroker or from PyPI."""
    import sys

    top = {name.split(".")[0] for _, name in _imports(ROOT / module)}
    assert top <= set(sys.stdlib_module_names) | {"__future__"}, top


def test_one_selector_loop_implementation() -> None:
    """Only pybroker.evloop creates a selector and runs select(); the server's loops, the
    HTTP server and the client's IOLoop are its subclasses."""
    from pybroker.client.loop import IOLoop
    from pybroker.evloop import SelectorLoop
    from pybroker.http.server import HttpServer
    from pybroker.server.loop import EventLoop

    for cls in (IOLoop, HttpServer, EventLoop):
        assert issubclass(cls, SelectorLoop), cls
    makers = [str(p.relative_to(ROOT.parent)) for p in _sources()
              if "DefaultSelector(" in p.read_text() or "socketpair(" in p.read_text()]
    assert makers == ["pybroker/evloop.py"], makers
