"""Producer: publish to one nsqd (PUB, MPUB, DPUB), blocking or pipelined with futures.

Commands are pipelined on one connection; nsqd answers them in order, so each
response (``OK`` or an ``E_*`` error frame) completes the oldest pending future. The
connection is made on first use and again after it drops (go-nsq's Producer); futures
still pending when it drops fail with NotConnectedError.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import Iterable, Sequence

from pybroker.client import protocol as P
from pybroker.client.config import Config
from pybroker.client.conn import Conn
from pybroker.client.errors import NotConnectedError, ProtocolError, StoppedError
from pybroker.client.loop import IOLoop
from pybroker.client.message import Message

log = logging.getLogger("pybroker.client")


class Producer:
    """Publishes to the nsqd at ``address`` ("host:port").

    Args:
        address: the nsqd TCP address.
        config: a Config; keyword ``options`` override its fields.

    The blocking methods raise ProtocolError for an error frame (``.code`` is e.g.
    "E_BAD_TOPIC") and NotConnectedError if the connection failed; the ``*_async``
    forms return a ``concurrent.futures.Future`` resolving to the response bytes.
    """

    def __init__(self, address: str, config: Config | None = None, **options: object) -> None:
        cfg = (config or Config()).copy()
        for name, value in options.items():
            cfg.set(name, value)
        cfg.validate()
        self.address = address
        self.config = cfg
        self._loop = IOLoop(name=f"nsq-producer-{address}")
        self._loop.start()
        self._guard = threading.Lock()          # connect / close
        self._tx_lock = threading.Lock()        # pairs each write with its future
        self._conn: Conn | None = None
        self._transactions: dict[Conn, deque[Future[bytes]]] = {}
        self._stopped = False
        self.connects = 0

    # -- publishing ------------------------------------------------------------------
    def publish(self, topic: str, body: bytes, timeout_s: float | None = None) -> None:
        """PUB one message and wait for the server's OK."""
        self.publish_async(topic, body).result(timeout_s)

    def multi_publish(self, topic: str, bodies: Sequence[bytes],
                      timeout_s: float | None = None) -> None:
        """MPUB several messages atomically and wait for the OK."""
        self.multi_publish_async(topic, bodies).result(timeout_s)

    def deferred_publish(self, topic: str, delay_s: float, body: bytes,
                         timeout_s: float | None = None) -> None:
        """DPUB: deliver ``body`` after ``delay_s`` seconds; wait for the OK."""
        self.deferred_publish_async(topic, delay_s, body).result(timeout_s)

    def publish_async(self, topic: str, body: bytes) -> "Future[bytes]":
        return self._send(P.pub(topic, body))

    def multi_publish_async(self, topic: str, bodies: Iterable[bytes]) -> "Future[bytes]":
        parts = list(bodies)
        if not parts:
            raise ValueError("MPUB needs at least one message")
        return self._send(P.mpub(topic, parts))

    def deferred_publish_async(self, topic: str, delay_s: float, body: bytes) -> "Future[bytes]":
        return self._send(P.dpub(topic, int(delay_s * 1000), body))

    def ping(self) -> None:
        """Connect if needed and send NOP (go-nsq's Ping)."""
        self._connected().send(P.nop())

    def _send(self, cmd: bytes) -> "Future[bytes]":
        line = cmd[:cmd.index(b"\n")]
        if line.count(b" ") != (2 if line.startswith(b"DPUB") else 1) or b"\r" in line:
            # whitespace in a topic would split the command line: refuse, never send it
            name = line.split(b" ", 1)[1] if b" " in line else b""
            if line.startswith(b"DPUB"):
                name = name.rsplit(b" ", 1)[0]
            raise ValueError(f'topic name "{name[:80].decode("utf-8", "replace")}" '
                             "is not valid")
        fut: Future[bytes] = Future()
        conn = self._connected()
        with self._tx_lock:
            if conn is not self._conn or conn.is_closed:
                fut.set_exception(NotConnectedError(f"{self.address}: connection closed"))
                return fut
            pending = self._transactions.setdefault(conn, deque())
            pending.append(fut)
            try:
                conn.send(cmd)
            except NotConnectedError as e:
                # on_close fails every pending future of this connection, this one too
                if not fut.done():
                    pending.remove(fut)
                    fut.set_exception(e)
        return fut

    # -- connection ------------------------------------------------------------------
    @property
    def is_connected(self) -> bool:
        conn = self._conn
        return conn is not None and not conn.is_closed

    def connect(self) -> None:
        """Connect now instead of on the first publish."""
        self._connected()

    def _connected(self) -> Conn:
        conn = self._conn
        if conn is not None and not conn.is_closed:
            return conn
        with self._guard:
            if self._stopped:
                raise StoppedError("producer stopped")
            conn = self._conn
            if conn is not None and not conn.is_closed:
                return conn
            log.info("(%s) connecting to nsqd", self.address)
            conn = Conn(self.address, self.config, self, self._loop)
            try:
                conn.connect()
            except OSError as e:
                said = str(e)      # a failed dial names the address already
                raise NotConnectedError(said if self.address in said
                                        else f"{self.address}: {said}") from e
            with self._tx_lock:
                self._transactions[conn] = deque()
                self._conn = conn
            self.connects += 1
            conn.start()
            return conn

    def stop(self) -> None:
        """Close the connection (pending futures fail) and stop the IO thread."""
        with self._guard:
            if self._stopped:
                return
            self._stopped = True
            conn = self._conn
        if conn is not None:
            conn.close("producer stopped")
        self._loop.stop()
        self._fail_all(None, StoppedError("producer stopped"))

    close = stop

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- ConnDelegate (loop thread) ----------------------------------------------------
    def _pop(self, conn: Conn) -> "Future[bytes] | None":
        with self._tx_lock:
            pending = self._transactions.get(conn)
            return pending.popleft() if pending else None

    def on_response(self, conn: Conn, data: bytes) -> None:
        fut = self._pop(conn)
        if fut is None:
            log.error("(%s) unexpected response %r", self.address, data[:32])
            conn.close("unexpected response")
            return
        fut.set_result(data)

    def on_error(self, conn: Conn, data: bytes) -> None:
        fut = self._pop(conn)
        if fut is None:
            log.error("(%s) unexpected error frame %r", self.address, data[:64])
            return
        fut.set_exception(ProtocolError(data))

    def on_heartbeat(self, conn: Conn) -> None:
        pass

    def on_message(self, conn: Conn, message: Message) -> None:
        conn.close("a producer connection received a message")

    def on_message_finished(self, conn: Conn, message: Message) -> None:
        pass

    def on_message_requeued(self, conn: Conn, message: Message, backoff: bool) -> None:
        pass

    def on_close(self, conn: Conn) -> None:
        self._fail_all(conn, NotConnectedError(f"{self.address}: connection closed"))

    def _fail_all(self, conn: Conn | None, error: Exception) -> None:
        """Fail the futures pending on ``conn`` (on every connection if None)."""
        with self._tx_lock:
            if conn is None:
                pending = [f for q in self._transactions.values() for f in q]
                self._transactions.clear()
            else:
                pending = list(self._transactions.pop(conn, ()))
        for fut in pending:
            if not fut.done():
                fut.set_exception(error)
