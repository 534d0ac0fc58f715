"""Load for the publish-failure tests: publishers that keep going through errors and
record the outcome of every command, and a consumer that makes a channel dead-letter
everything it is given.

Each publisher has one command outstanding at a time, so an answer settles exactly the
bodies of that command. A TCP error answer (E_PUB_FAILED and friends are fatal in
nsqd: the connection closes) is recorded and the publisher reconnects; a connection
that closes without an answer to the outstanding command is recorded as "no answer"
(which the tests count as a failure of the broker). Everything talks to a real broker
over loopback sockets (tests/support/wire.py encodes).
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from tests.support.durability import FrameBuffer, _Worker
from tests.support.wire import (
    FRAME_ERROR,
    FRAME_MESSAGE,
    FRAME_RESPONSE,
    HEARTBEAT,
    MAGIC_V2,
    ConnectionClosed,
    dpub,
    identify,
    mpub,
    nop,
    parse_message,
    pub,
    rdy,
    read_frame,
    req,
    sub,
)


@dataclass
class Outcome:
    """One command: its kind (PUB, MPUB, DPUB, /pub, /mpub), bodies, when it was sent
    and answered (time.monotonic), and the answer: "OK", an error text, "no answer"."""
    kind: str
    bodies: list[bytes]
    sent: float
    answered: float
    answer: str


@dataclass
class _Recorder(_Worker):
    prefix: str = ""
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _n: int = 0

    def _body(self) -> bytes:
        self._n += 1
        return f"{self.prefix}-{self._n:07d}".encode()

    @property
    def acked(self) -> set[bytes]:
        return {b for o in self.outcomes if o.answer == "OK" for b in o.bodies}

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.answer != "OK"]


@dataclass
class TcpPublisher(_Recorder):
    """PUB, MPUB of ``batch`` and DPUB in turn; reconnects after an error."""
    address: tuple[str, int] = ("127.0.0.1", 0)
    topic: str = ""
    batch: int = 5
    pause_s: float = 0.0

    def _thread_name(self) -> str:
        return f"tcp-{self.prefix}"

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                sock = socket.create_connection(self.address, timeout=5.0)
            except OSError:
                time.sleep(0.05)
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(MAGIC_V2)
                while not self._stop.is_set():
                    kind = ("PUB", "MPUB", "DPUB")[i % 3]
                    i += 1
                    if kind == "MPUB":
                        msgs = [self._body() for _ in range(self.batch)]
                        data = mpub(self.topic, msgs)
                    else:
                        msgs = [self._body()]
                        data = (pub(self.topic, msgs[0]) if kind == "PUB"
                                else dpub(self.topic, 1, msgs[0]))
                    sent = time.monotonic()
                    answer = self._command(sock, data)
                    self.outcomes.append(Outcome(kind, msgs, sent, time.monotonic(), answer))
                    if answer != "OK":
                        break
                    if self.pause_s:
                        time.sleep(self.pause_s)
            finally:
                sock.close()

    @staticmethod
    def _command(sock: socket.socket, data: bytes) -> str:
        try:
            sock.sendall(data)
            while True:
                ftype, payload = read_frame(sock, 30.0)
                if ftype == FRAME_RESPONSE and payload == HEARTBEAT:
                    sock.sendall(nop())
                    continue
                break
        except (OSError, ConnectionClosed, TimeoutError) as e:
            return f"no answer ({type(e).__name__})"
        if ftype == FRAME_RESPONSE and payload == b"OK":
            return "OK"
        return payload.decode("utf-8", "replace")


@dataclass
class HttpPublisher(_Recorder):
    """POST /pub and /mpub of ``batch`` in turn over keep-alive; goes on after a 500."""
    address: tuple[str, int] = ("127.0.0.1", 0)
    topic: str = ""
    batch: int = 5
    pause_s: float = 0.0

    def _thread_name(self) -> str:
        return f"http-{self.prefix}"

    def _run(self) -> None:
        q = urllib.parse.quote(self.topic)
        i = 0
        conn = http.client.HTTPConnection(*self.address, timeout=30)
        try:
            while not self._stop.is_set():
                one = i % 2 == 0
                i += 1
                msgs = [self._body() for _ in range(1 if one else self.batch)]
                path = f"/pub?topic={q}" if one else f"/mpub?topic={q}"
                sent = time.monotonic()
                try:
                    conn.request("POST", path, body=b"\n".join(msgs))
                    resp = conn.getresponse()
                    text = resp.read()
                except (OSError, http.client.HTTPException) as e:
                    answer = f"no answer ({type(e).__name__})"
                    conn.close()
                    conn = http.client.HTTPConnection(*self.address, timeout=30)
                else:
                    answer = "OK" if resp.status == 200 else f"{resp.status} {text.decode()}"
                self.outcomes.append(Outcome("/pub" if one else "/mpub", msgs, sent,
                                             time.monotonic(), answer))
                if self.pause_s:
                    time.sleep(self.pause_s)
        finally:
            conn.close()


@dataclass
class Requeuer(_Worker):
    """Subscribes and REQs every delivery at once: on a channel with max_attempts 1
    every message is dead-lettered on its next dispatch. ``seen`` counts deliveries."""
    address: tuple[str, int] = ("127.0.0.1", 0)
    topic: str = ""
    channel: str = ""
    seen: dict[bytes, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _thread_name(self) -> str:
        return "requeuer"

    def _run(self) -> None:
        try:
            sock = socket.create_connection(self.address, timeout=5.0)
        except OSError as e:
            self.errors.append(f"connect: {e}")
            return
        frames = FrameBuffer(sock)
        try:
            sock.sendall(MAGIC_V2 + identify(msg_timeout=60000))
            assert read_frame(sock, 5.0) == (FRAME_RESPONSE, b"OK")
            sock.sendall(sub(self.topic, self.channel))
            assert read_frame(sock, 5.0) == (FRAME_RESPONSE, b"OK")
            sock.sendall(rdy(100))
            while not self._stop.is_set():
                for ftype, payload in frames.read(0.2):
                    if ftype == FRAME_RESPONSE and payload == HEARTBEAT:
                        sock.sendall(nop())
                    elif ftype == FRAME_MESSAGE:
                        m = parse_message(payload)
                        self.seen[m.body] = self.seen.get(m.body, 0) + 1
                        sock.sendall(req(m.id, 0))
                    elif ftype == FRAME_ERROR:
                        self.errors.append(payload[:100].decode("utf-8", "replace"))
        except (OSError, ConnectionClosed) as e:
            self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            sock.close()


def envelope_body(message: bytes) -> bytes:
    """The original body inside a dead-letter envelope (a JSON line, then the body)."""
    header, _, body = message.partition(b"\n")
    assert json.loads(header)["body_len"] == len(body), header
    return body
