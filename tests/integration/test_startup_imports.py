"""A broker starts with what serving needs and nothing else (issue 28's start-up budget).

Each broker runs under ``python -X importtime`` until it has answered /ping and a plain
client's PUB, SUB and message (no TLS, no compression, no AUTH), then stops; the modules
it imported in its whole life are read from that output. None of FORBIDDEN may be among
them: the other commands' packages (tools, bench, spark, the client library), typer and
click, TLS, compression, AUTH's HTTP client, the Prometheus renderer, statsd, the nsqd
data importer, TOML without a config file, and the slow stdlib modules nothing on the
serving path needs. The same broker with a certificate and a config file must import
ssl and tomllib (so the check sees what it claims to).
"""
from __future__ import annotations

import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import wire
from tests.support.broker import BrokerProcess, unique_name
from tests.support.certs import make_certs

FORBIDDEN = {
    # other commands and packages
    "pybroker.cli", "pybroker.tools", "pybroker.bench", "pybroker.spark", "pybroker.client",
    "pybroker.testing", "typer", "click", "pyspark", "locust", "prometheus_client",
    # TLS, compression, AUTH, Prometheus, statsd, the nsqd importer: when configured or used
    # (pybroker.server.auth's protocol side is imported; its HTTP client and RE2 are not)
    "pybroker.server.authhttp", "pybroker.server.grants", "re2", "ssl", "_ssl", "pybroker.tlsio", "pybroker.server.tls", "pybroker.protocol.compression", "cramjam", "http.client", "urllib.request",
    "concurrent.futures", "pybroker.http.metrics", "pybroker.http.statsd",
    "pybroker.server.importer", "pybroker.storage.nsqd_import", "pybroker.storage.oldqueues",
    # slow stdlib modules the serving path does not need
    "tomllib", "email", "email.utils", "platform", "hashlib", "_hashlib", "secrets",
    "shutil", "lzma", "bz2", "asyncio", "argparse", "subprocess", "datetime",
}


class ImportTimed(BrokerProcess):
    """A broker run by ``python -X importtime`` with exactly the argv given."""

    def __init__(self, argv: list[str], data_path: str) -> None:
        super().__init__("nsqd", data_path=data_path)
        self.argv = argv

    def command(self) -> list[str]:
        return [sys.executable, "-X", "importtime", *self.argv]

    def modules(self) -> set[str]:
        return {line.split("|")[2].strip() for line in self.stderr_lines
                if line.startswith("import time:") and "self [us]" not in line}


@pytest.fixture
def run_broker() -> Iterator[Any]:
    started: list[ImportTimed] = []

    def run(argv: list[str], data_path: str, exercise: bool = True) -> set[str]:
        b = ImportTimed(argv, data_path)
        started.append(b)
        b.start()
        with urllib.request.urlopen(f"http://{b.http_hostport}/ping", timeout=10) as r:
            assert r.read() == b"OK"
        if exercise:
            topic = unique_name()
            with wire.WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
                c.send(wire.pub(topic, b"x"))
                c.expect_response(b"OK")
            with wire.WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
                c.send(wire.sub(topic, "ch"))
                c.expect_response(b"OK")
                c.send(wire.rdy(1))
                c.read_frame()
        assert b.stop() == 0, b.stderr_text()
        return b.modules()

    yield run
    for b in started:
        if b.proc is not None and b.proc.poll() is None:
            b.stop()
        b.cleanup()


ADDRS = ["-tcp-address=127.0.0.1:0", "-http-address=127.0.0.1:0"]


@pytest.mark.parametrize("cmd", [["-m", "pybroker.nsqd_cli"], ["-m", "pybroker", "serve"]],
                         ids=["pybroker-nsqd", "pybroker serve"])
def test_serving_imports_nothing_it_does_not_need(cmd: list[str], tmp_path: Path,
                                                  run_broker: Any) -> None:
    mods = run_broker([*cmd, *ADDRS, f"-data-path={tmp_path}"], str(tmp_path))
    assert "pybroker.runtime" in mods and "pybroker.server.connection" in mods
    bad = {m for m in mods if m in FORBIDDEN or m.partition(".")[0] in FORBIDDEN
           or any(m.startswith(f + ".") for f in FORBIDDEN)}
    assert not bad, sorted(bad)


def test_tls_and_a_config_file_are_imported_when_configured(tmp_path: Path,
                                                            run_broker: Any) -> None:
    certs = make_certs(tmp_path / "certs")
    cfg = tmp_path / "nsqd.cfg"
    cfg.write_text("mem_queue_size = 100\n")
    mods = run_broker(["-m", "pybroker.nsqd_cli", *ADDRS, f"-data-path={tmp_path}",
                       f"-config={cfg}", f"-tls-cert={certs.server_cert}",
                       f"-tls-key={certs.server_key}", "-https-address=127.0.0.1:0"],
                      str(tmp_path), exercise=False)
    assert {"ssl", "pybroker.server.tls", "tomllib"} <= mods
