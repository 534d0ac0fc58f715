"""Fixtures: real broker processes on ephemeral loopback ports, stopped by PID."""
from __future__ import annotations

import signal
from typing import Callable, Iterator

import pytest

from tests.support.broker import BrokerProcess
from tests.support.programs import require_nsqd
from tests.support.wire import WireClient

# pytest's own plugin for testing plugins: the tests of pybroker.testing (the pytest plugin
# shipped with the package) run their test files through it
pytest_plugins = ["pytester"]

# The slowest modules, slowest first (from --durations): the suite runs on pytest-xdist
# workers a module at a time (--dist loadfile, so module-scoped brokers and Spark sessions
# start once), and modules are handed out in collection order, so these start at once and
# the workers finish together. The other modules keep their order after them.
SLOW_FIRST = [
    "test_spark_log.py", "test_spark.py", "test_replication.py", "test_publish_faults.py",
    "test_crash_loop.py",
    "test_tools_to_file.py", "test_tools.py", "test_behaviour.py", "test_tls_clients.py",
    "test_hostile_tls_fds.py", "test_packaging.py", "test_nsqadmin.py", "test_hardening.py",
    "test_topic_log.py", "test_storage_damage.py", "test_chaos.py", "test_bench_smoke.py",
    "test_client.py", "test_dead_letters.py", "test_storage_restart.py", "test_cross_loop.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable


def _finish(b: BrokerProcess) -> None:
    code = b.stop(signal.SIGTERM)
    text = b.stderr_text()
    b.cleanup()
    assert "Traceback" not in text, text
    assert code == 0, f"{b.kind} exited {code}:\n{text}"


@pytest.fixture(scope="session")
def broker() -> Iterator[BrokerProcess]:
    """One pybroker shared by the session; tests use unique topic names."""
    b = BrokerProcess("pybroker").start()
    yield b
    _finish(b)


@pytest.fixture
def make_broker() -> Iterator[Callable[..., BrokerProcess]]:
    """Factory for a pybroker (or nsqd) with special options, stopped at teardown."""
    started: list[BrokerProcess] = []

    def make(*args: str, kind: str = "pybroker", **kw: object) -> BrokerProcess:
        if kind == "nsqd":
            kw.setdefault("nsqd_path", require_nsqd())
        b = BrokerProcess(kind, list(args), **kw).start()  # type: ignore[arg-type]
        started.append(b)
        return b

    yield make
    for b in started:
        if b.proc is not None:
            _finish(b)
        else:
            b.cleanup()


@pytest.fixture(scope="session")
def nsqd_path() -> str:
    return require_nsqd()


@pytest.fixture(scope="session")
def nsqd(nsqd_path: str) -> Iterator[BrokerProcess]:
    """A real nsqd shared by the session, for tests that compare behaviour."""
    b = BrokerProcess("nsqd", nsqd_path=nsqd_path).start()
    yield b
    _finish(b)


@pytest.fixture(params=["pybroker", "nsqd"])
def any_broker(request: pytest.FixtureRequest) -> BrokerProcess:
    """The same test against pybroker and a real nsqd (tests/support/programs.py: a skip
    without one, or a failure in strict mode)."""
    b: BrokerProcess = request.getfixturevalue("broker" if request.param == "pybroker"
                                               else "nsqd")
    return b


@pytest.fixture(params=["pybroker", "nsqd"])
def broker_kind(request: pytest.FixtureRequest) -> str:
    """"pybroker" or "nsqd": for tests that start their own broker of either kind."""
    return str(request.param)


@pytest.fixture
def make_any_broker(make_broker: Callable[..., BrokerProcess],
                    broker_kind: str) -> Callable[..., BrokerProcess]:
    """make_broker for the kind under test: make_any_broker("--msg-timeout=2s")."""

    def make(*args: str, **kw: object) -> BrokerProcess:
        return make_broker(*args, kind=broker_kind, **kw)

    return make


@pytest.fixture(scope="module")
def make_module_broker() -> Iterator[Callable[..., BrokerProcess]]:
    """Like make_broker, but shared by one module: the same (kind, flags) gives the same
    running broker, so many tests can use special options at the cost of one start."""
    started: dict[tuple[str, tuple[str, ...]], BrokerProcess] = {}

    def make(*args: str, kind: str = "pybroker") -> BrokerProcess:
        key = (kind, tuple(args))
        if key not in started:
            kw: dict[str, object] = {}
            if kind == "nsqd":
                kw["nsqd_path"] = require_nsqd()
            started[key] = BrokerProcess(kind, list(args), **kw).start()  # type: ignore[arg-type]
        return started[key]

    yield make
    for b in started.values():
        _finish(b)


@pytest.fixture
def connect() -> Iterator[Callable[..., WireClient]]:
    """connect(broker, **kw) -> WireClient with the V2 magic sent; closed at teardown."""
    clients: list[WireClient] = []

    def make(b: BrokerProcess, **kw: object) -> WireClient:
        assert b.tcp_address is not None
        client = WireClient.connect(b.tcp_address, **kw)  # type: ignore[arg-type]
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


# Small limits so oversized bodies stay small on the wire (a server that closes with
# unread input may reset the connection before the error frame is read).
SMALL_LIMITS = ("--max-msg-size=1024", "--max-body-size=4096", "--max-rdy-count=50",
                "--max-req-timeout=10s", "--max-channel-consumers=1")


@pytest.fixture
def small_broker(make_module_broker: Callable[..., BrokerProcess],
                 broker_kind: str) -> BrokerProcess:
    """A broker of the kind under test with SMALL_LIMITS, shared within a module."""
    return make_module_broker(*SMALL_LIMITS, kind=broker_kind)
