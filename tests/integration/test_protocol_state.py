"""A stateful property test of the V2 protocol against the live server: random sequences
of PUB/MPUB, RDY, FIN, REQ, TOUCH, FINs of ids a client does not hold, and consumers
leaving, over raw sockets (tests/support/wire.py), checked against a model.

Invariants: a connection never holds more messages in flight than the highest RDY it
sent; attempts count deliveries on the channel; FIN, REQ and TOUCH of a held message
succeed and of any other id get E_FIN_FAILED (and the connection stays open); a FIN'd
message never comes back; after the run every published message not FIN'd is delivered
to a new consumer. PYBROKER_STATE_EXAMPLES raises the example count for a longer run.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.support import wire
from tests.support.broker import BrokerProcess, unique_name
from tests.support.durability import consume
from tests.support.wire import WireClient

EXAMPLES = int(os.environ.get("PYBROKER_STATE_EXAMPLES", "12"))


class Consumer:
    def __init__(self, b: BrokerProcess, topic: str) -> None:
        self.c = WireClient.connect(b.tcp_address)  # type: ignore[arg-type]
        self.c.sub(topic, "ch")
        self.max_rdy = 0
        self.held: dict[bytes, tuple[bytes, int]] = {}   # id -> (body, attempts)
        self.errors_expected = 0

    def drain(self, wait: float = 0.05) -> list[wire.Message]:
        """Every frame that arrives within wait: messages returned, errors counted."""
        got = []
        while True:
            try:
                ftype, data = self.c.read_frame(wait)
            except TimeoutError:
                return got
            if ftype == wire.FRAME_MESSAGE:
                got.append(wire.parse_message(data))
            elif ftype == wire.FRAME_ERROR:
                assert data.startswith(b"E_FIN_FAILED") and self.errors_expected > 0, data
                self.errors_expected -= 1
            wait = 0.02


class ProtocolMachine(RuleBasedStateMachine):
    broker: BrokerProcess

    @initialize()
    def setup(self) -> None:
        self.topic = unique_name("state")
        self.producer = WireClient.connect(self.broker.tcp_address)  # type: ignore[arg-type]
        self.consumers = [Consumer(self.broker, self.topic) for _ in range(2)]
        self.published: set[bytes] = set()
        self.finished: set[bytes] = set()
        self.deliveries: dict[bytes, int] = {}   # body -> deliveries so far
        self.left_unread = False                 # a consumer left: unseen deliveries
        self.n = 0

    def _receive(self, k: int, wait: float = 0.05) -> None:
        cons = self.consumers[k]
        for m in cons.drain(wait):
            assert m.body in self.published, m
            assert m.body not in self.finished, f"a FIN'd message came back: {m.body!r}"
            # attempts count every delivery; a consumer that left may have been sent
            # some it never read, so the model only knows a lower bound
            seen = self.deliveries.get(m.body, 0) + 1
            assert m.attempts >= seen, (m, seen)
            if not self.left_unread:
                assert m.attempts == seen, (m, seen)
            self.deliveries[m.body] = m.attempts
            assert m.id == b"%016x" % int(m.id, 16)
            cons.held[m.id] = (m.body, m.attempts)
            assert len(cons.held) <= cons.max_rdy, (len(cons.held), cons.max_rdy)

    @rule(n=st.integers(1, 5), multi=st.booleans())
    def publish(self, n: int, multi: bool) -> None:
        bodies = [b"s%06d" % (self.n + i) for i in range(n)]
        self.n += n
        if multi:
            self.producer.mpub(self.topic, bodies)
        else:
            for body in bodies:
                self.producer.pub(self.topic, body)
        self.published.update(bodies)

    @rule(k=st.integers(0, 1), count=st.integers(0, 6))
    def rdy(self, k: int, count: int) -> None:
        cons = self.consumers[k]
        cons.c.rdy(count)
        cons.max_rdy = max(cons.max_rdy, count)
        self._receive(k)

    @rule(k=st.integers(0, 1))
    def receive(self, k: int) -> None:
        self._receive(k)

    @rule(k=st.integers(0, 1), pick=st.integers(0, 999))
    def finish(self, k: int, pick: int) -> None:
        cons = self.consumers[k]
        if not cons.held:
            return
        mid = sorted(cons.held)[pick % len(cons.held)]
        body, _ = cons.held.pop(mid)
        cons.c.fin(mid)
        self.finished.add(body)
        self._receive(k)

    @rule(k=st.integers(0, 1), pick=st.integers(0, 999))
    def requeue(self, k: int, pick: int) -> None:
        cons = self.consumers[k]
        if not cons.held:
            return
        mid = sorted(cons.held)[pick % len(cons.held)]
        cons.held.pop(mid)
        cons.c.req(mid, 0)
        self._receive(k)

    @rule(k=st.integers(0, 1), pick=st.integers(0, 999))
    def touch(self, k: int, pick: int) -> None:
        cons = self.consumers[k]
        if cons.held:
            cons.c.touch(sorted(cons.held)[pick % len(cons.held)])

    @rule(k=st.integers(0, 1), other=st.booleans())
    def finish_not_held(self, k: int, other: bool) -> None:
        """FIN an id this connection does not hold: the other's, or one never sent."""
        cons = self.consumers[k]
        theirs = self.consumers[1 - k].held
        mid = sorted(theirs)[0] if other and theirs else b"%016x" % (10**15 + self.n)
        cons.errors_expected += 1
        cons.c.fin(mid)
        self._receive(k)

    @precondition(lambda self: self.n < 200)
    @rule(k=st.integers(0, 1))
    def reconnect(self, k: int) -> None:
        """A consumer leaves (its messages are requeued at once) and another joins."""
        self.consumers[k].c.close()
        self.left_unread = True
        self.consumers[k] = Consumer(self.broker, self.topic)

    @invariant()
    def connections_open(self) -> None:
        for cons in getattr(self, "consumers", []):
            assert cons.c.sock.fileno() >= 0

    def teardown(self) -> None:
        for cons in getattr(self, "consumers", []):
            cons.drain(0.1)
            cons.c.close()
        if not hasattr(self, "producer"):
            return
        self.producer.close()
        rest = consume(self.broker, self.topic, "ch", idle_s=0.5)
        got = {r.msg.body for r in rest}
        assert not got & self.finished, "FIN'd messages delivered again"
        missing = self.published - self.finished - got
        assert not missing, f"{len(missing)} messages never delivered: {sorted(missing)[:5]}"


def test_protocol_state_machine(broker: BrokerProcess) -> None:
    ProtocolMachine.broker = broker
    run = ProtocolMachine.TestCase
    run.settings = settings(max_examples=EXAMPLES, stateful_step_count=25, deadline=None,
                            suppress_health_check=list(HealthCheck))
    run().runTest()

