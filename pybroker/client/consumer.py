"""Consumer: subscribe to a topic/channel on many nsqds and run a handler per message.

Threads: one IOLoop (reads every connection, answers heartbeats, fires RDY timers),
``concurrency`` handler threads fed by a queue, and a lookupd poller when discovery is
used. The loop hands a turn's messages to the queue at the end of the turn, just before
it sleeps again, so a woken handler thread finds the GIL free (docs/client.md). With
``inline=True`` there are no handler threads: the loop runs the handler itself at the
end of the turn, as gnsq and pynsq do (one thread woken per message instead of two).
Returning from the handler FINs the message; raising REQueues it (with backoff).
Flow control lives in ``rdy.FlowController``. Names follow go-nsq (ConnectToNSQD,
ConnectToNSQLookupd, ChangeMaxInFlight, Stop/StopChan, MaxAttempts...).
"""
from __future__ import annotations

import logging
import queue
import random
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

from pybroker.client import protocol as P
from pybroker.client.config import Config
from pybroker.client.conn import Conn
from pybroker.client.errors import StoppedError
from pybroker.client.lookupd import LookupdPoller
from pybroker.client.loop import IOLoop
from pybroker.client.message import Message
from pybroker.client.rdy import BackoffSignal, FlowController, RdyHook

log = logging.getLogger("pybroker.client")

Handler = Callable[[Message], object]     # its return value is ignored
GiveUpHook = Callable[[Message], object]


@dataclass(frozen=True, slots=True)
class ConsumerStats:
    messages_received: int
    messages_finished: int
    messages_requeued: int
    connections: int


class Consumer:
    """Consume ``topic``/``channel`` with ``handler`` (go-nsq's Consumer).

    Args:
        topic, channel: names to SUB to.
        handler: called with each Message from a handler thread; return to FIN, raise to
            REQ (delay from ``default_requeue_delay``, and backoff). Call
            ``message.disable_auto_response()`` to finish or requeue later yourself.
        config: a Config; keyword ``options`` override its fields (``max_in_flight=100``).
        concurrency: handler threads.
        inline: no handler threads: run ``handler`` on the I/O loop's thread at the end
            of each turn (``concurrency`` is then ignored). Per message that wakes one
            thread instead of two, which at a low ``max_in_flight`` is most of the cost
            (docs/client.md); but while the handler runs, no connection is read and no
            heartbeat answered, so keep it well under the heartbeat interval.
        on_rdy: ``hook(conn, count)`` after every RDY sent (for observing flow control).
        on_give_up: called with a message delivered more than ``max_attempts`` times,
            just before it is FIN'd unhandled. A handler's ``log_failed_message`` method
            is used when this is None (go-nsq's FailedMessageLogger).
    """

    def __init__(self, topic: str, channel: str, handler: Handler | None = None,
                 config: Config | None = None, *, concurrency: int = 1,
                 inline: bool = False, on_rdy: RdyHook | None = None,
                 on_give_up: GiveUpHook | None = None,
                 **options: object) -> None:
        if not P.is_valid_topic_name(topic):
            raise ValueError(f"invalid topic name {topic!r}")
        if not P.is_valid_channel_name(channel):
            raise ValueError(f"invalid channel name {channel!r}")
        cfg = (config or Config()).copy()
        for name, value in options.items():
            cfg.set(name, value)
        cfg.validate()
        self.topic, self.channel, self.config = topic, channel, cfg
        self.on_give_up = on_give_up
        self._lock = threading.RLock()
        self._connections: dict[str, Conn] = {}
        self._pending: set[str] = set()
        self.nsqd_tcp_addresses: list[str] = []
        self._loop = IOLoop(name=f"nsq-consumer-{topic}", end_of_turn=self._hand_over)
        self.flow = FlowController(cfg, self._loop, self.conns, on_rdy)
        # messages for the handler threads; None tells one handler thread to exit
        self._incoming: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._received: list[Message] = []   # this loop turn's, not yet handed over
        self._handlers: list[threading.Thread] = []
        # inline=True: the handler the loop runs itself, with its give-up hook
        self._inline: tuple[Handler, GiveUpHook | None] | None = None
        self._running_handlers = 0
        self._stop_flag = threading.Event()
        self._stopped = threading.Event()
        self._handlers_stopped = False
        self._connected_flag = False
        self._counts = {"received": 0, "finished": 0, "requeued": 0}
        self._lookupd = LookupdPoller(topic, cfg, self._on_discovered, self._stop_flag,
                                      self._live_connections)
        self._loop.start()
        self._loop.call_later(cfg.rdy_redistribute_interval, self._redistribute_tick)
        if handler is not None:
            if inline:
                self.add_inline_handler(handler)
            else:
                self.add_concurrent_handlers(handler, concurrency)

    # -- handlers --------------------------------------------------------------------
    def add_handler(self, handler: Handler) -> None:
        self.add_concurrent_handlers(handler, 1)

    def add_concurrent_handlers(self, handler: Handler, concurrency: int) -> None:
        """Start ``concurrency`` threads running ``handler``; only before connecting."""
        if self._connected_flag:
            raise RuntimeError("already connected")
        for _ in range(concurrency):
            t = threading.Thread(target=self._handler_loop, args=(handler,),
                                 name=f"nsq-handler-{self.topic}-{len(self._handlers)}",
                                 daemon=True)
            with self._lock:
                self._running_handlers += 1
            self._handlers.append(t)
            t.start()

    def add_inline_handler(self, handler: Handler) -> None:
        """Run ``handler`` on the I/O loop's thread (see ``inline``); only before
        connecting, and not beside handler threads."""
        if self._connected_flag:
            raise RuntimeError("already connected")
        if self._handlers or self._inline is not None:
            raise RuntimeError("handlers already added")
        self._inline = (handler, self._give_up_of(handler))
        with self._lock:
            self._running_handlers += 1

    def _give_up_of(self, handler: Handler) -> GiveUpHook | None:
        hook: GiveUpHook | None = self.on_give_up or getattr(handler, "log_failed_message",
                                                               None)
        return hook

    def _handler_loop(self, handler: Handler) -> None:
        give_up = self._give_up_of(handler)
        while True:
            msg = self._incoming.get()
            if msg is None:
                break
            self._handle(handler, give_up, msg)
        with self._lock:
            self._running_handlers -= 1
            last = self._running_handlers == 0
        if last:
            self._exit()

    def _handle(self, handler: Handler, give_up: GiveUpHook | None, msg: Message) -> None:
        """One message, on a handler thread (or the loop's, inline): give up on it past
        ``max_attempts``, else run the handler; FIN on return, REQ on an exception."""
        if isinstance(msg.delegate, Conn):
            self.flow.on_dispatched(msg.delegate)
        max_attempts = self.config.max_attempts
        if max_attempts > 0 and msg.attempts > max_attempts:
            log.warning("msg %s attempted %d times, giving up",
                        msg.id.decode(), msg.attempts)
            if give_up is not None:
                try:
                    give_up(msg)
                except Exception:
                    log.exception("give-up hook failed for msg %s", msg.id.decode())
            msg.finish()
            return
        try:
            handler(msg)
        except Exception as e:
            log.error("Handler returned error (%r) for msg %s", e, msg.id.decode())
            if not msg.is_auto_response_disabled():
                msg.requeue(None)
            return
        if not msg.is_auto_response_disabled():
            msg.finish()

    # -- connections -----------------------------------------------------------------
    def conns(self) -> list[Conn]:
        """The live connections (introspection: rdy_count, in_flight per connection)."""
        with self._lock:
            return list(self._connections.values())

    def connect_to_nsqd(self, address: str) -> None:
        """Connect, IDENTIFY and SUB to one nsqd ("host:port"); blocking.

        Does nothing if already connected to it.

        Raises:
            StoppedError, RuntimeError (no handler), OSError, IdentifyError,
            ProtocolError (SUB refused).
        """
        if self._stop_flag.is_set():
            raise StoppedError("consumer stopped")
        if self._running_handlers == 0:
            raise RuntimeError("no handlers")
        self._connected_flag = True
        with self._lock:
            if address in self._connections or address in self._pending:
                return
            self._pending.add(address)
            if address not in self.nsqd_tcp_addresses:
                self.nsqd_tcp_addresses.append(address)
        log.info("(%s) connecting to nsqd", address)
        conn = Conn(address, self.config, self, self._loop)
        conn.max_pending_write = 0
        try:
            resp = conn.connect()
            if resp.max_rdy_count < self.flow.max_in_flight:
                log.warning("(%s) max RDY count %d < consumer max in flight %d, "
                            "truncation possible", address, resp.max_rdy_count,
                            self.flow.max_in_flight)
            conn.subscribe(self.topic, self.channel)
        except BaseException:
            with self._lock:
                self._pending.discard(address)
            conn.close("connect failed")
            raise
        with self.flow.lock, self._lock:
            self._pending.discard(address)
            if self._stop_flag.is_set():
                conn.close("consumer stopped")
                raise StoppedError("consumer stopped")
            self._connections[address] = conn
            conn.start()
            # tell existing connections to lower their RDY before the new one gets its share
            for c in self.conns():
                if c is not conn:
                    self.flow.maybe_update_rdy(c)
            self.flow.maybe_update_rdy(conn)

    def connect_to_nsqds(self, addresses: Iterable[str]) -> None:
        for address in addresses:
            self.connect_to_nsqd(address)

    def connect_to_nsqlookupd(self, address: str) -> None:
        """Discover nsqds for the topic through nsqlookupd's ``/lookup``; poll it.

        The first query runs now; then every ``lookupd_poll_interval`` (with jitter).
        """
        if self._stop_flag.is_set():
            raise StoppedError("consumer stopped")
        if self._running_handlers == 0:
            raise RuntimeError("no handlers")
        self._connected_flag = True
        self._lookupd.add(address)

    def connect_to_nsqlookupds(self, addresses: Iterable[str]) -> None:
        for address in addresses:
            self.connect_to_nsqlookupd(address)

    def disconnect_from_nsqd(self, address: str) -> None:
        """Close the connection to ``address`` and stop reconnecting to it."""
        with self._lock:
            if address not in self.nsqd_tcp_addresses:
                raise ValueError(f"not connected to {address}")
            self.nsqd_tcp_addresses.remove(address)
            conn = self._connections.get(address)
        if conn is not None:
            conn.close("disconnect requested")

    def _live_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def _on_discovered(self, addresses: list[str]) -> None:
        for address in addresses:
            try:
                self.connect_to_nsqd(address)
            except StoppedError:
                return
            except Exception as e:
                log.error("(%s) error connecting to nsqd - %s", address, e)

    # -- ConnDelegate (loop thread) ---------------------------------------------------
    def on_message(self, conn: Conn, message: Message) -> None:
        with self._lock:
            self._counts["received"] += 1
        self.flow.on_message(conn)
        self._received.append(message)

    def _hand_over(self) -> None:
        """End of a loop turn (a few steps from ``select()``, which releases the GIL):
        queue the turn's messages. A handler woken mid-turn would find the GIL held
        and sleep on it again: two more context switches a message (docs/client.md)."""
        received = self._received
        if received:
            self._received = []
            inline = self._inline
            if inline is not None:
                handler, give_up = inline
                for m in received:
                    self._handle(handler, give_up, m)
                return
            for m in received:
                self._incoming.put(m)

    def on_message_finished(self, conn: Conn, message: Message) -> None:
        with self._lock:
            self._counts["finished"] += 1
        self.flow.on_response_sent(conn)
        self.flow.signal(BackoffSignal.RESUME)

    def on_message_requeued(self, conn: Conn, message: Message, backoff: bool) -> None:
        with self._lock:
            self._counts["requeued"] += 1
        self.flow.on_response_sent(conn)
        self.flow.signal(BackoffSignal.BACKOFF if backoff else BackoffSignal.CONTINUE)

    def on_response(self, conn: Conn, data: bytes) -> None:
        if data == P.CLOSE_WAIT:
            # the server acknowledged CLS: no more messages will come on this connection
            log.info("(%s) received CLOSE_WAIT from nsqd", conn)
            conn.closing = True
            conn.close_wait = True
            conn.maybe_close_drained()

    def on_error(self, conn: Conn, data: bytes) -> None:
        pass  # fatal errors are followed by the server closing the connection

    def on_heartbeat(self, conn: Conn) -> None:
        pass

    def on_close(self, conn: Conn) -> None:
        with self._lock:
            if self._connections.get(conn.address) is conn:
                del self._connections[conn.address]
            left = len(self._connections)
            reconnect = conn.address in self.nsqd_tcp_addresses
        self.flow.on_conn_close(conn, left)
        log.log(logging.INFO if self._stop_flag.is_set() else logging.WARNING,
                "there are %d connections left alive", left)
        if self._stop_flag.is_set():
            if left == 0:
                self._stop_handlers()
            return
        if self._lookupd.has_addresses():
            self._lookupd.recheck()
        elif reconnect:
            threading.Thread(target=self._reconnect, args=(conn.address,),
                             name=f"nsq-reconnect-{conn.address}", daemon=True).start()

    def _reconnect(self, address: str) -> None:
        while True:
            log.info("(%s) re-connecting in %.3fs", address, self.config.lookupd_poll_interval)
            if self._stop_flag.wait(self.config.lookupd_poll_interval):
                return
            with self._lock:
                if address not in self.nsqd_tcp_addresses:
                    return
            try:
                self.connect_to_nsqd(address)
                return
            except StoppedError:
                return
            except Exception as e:
                log.error("(%s) error connecting to nsqd - %s", address, e)

    def _redistribute_tick(self) -> None:
        if self._stopped.is_set():
            return
        self.flow.redistribute()
        self._loop.call_later(self.config.rdy_redistribute_interval, self._redistribute_tick)

    # -- control ---------------------------------------------------------------------
    def change_max_in_flight(self, max_in_flight: int) -> None:
        """Set a new max_in_flight and update every connection's RDY (0 pauses)."""
        self.flow.change_max_in_flight(max_in_flight)

    def is_starved(self) -> bool:
        """True if handlers hold >= 85 % of a connection's RDY (go-nsq's IsStarved).

        Held means given to a handler and not yet finished or requeued; messages still
        queued for a handler do not count, as go-nsq reads no further than its handlers.
        """
        for c in self.conns():
            threshold = int(c.rdy_count * 0.85)
            held = c.in_flight - c.queued
            if held >= threshold and held > 0 and not c.closing:
                return True
        return False

    def stats(self) -> ConsumerStats:
        with self._lock:
            return ConsumerStats(self._counts["received"], self._counts["finished"],
                                 self._counts["requeued"], len(self._connections))

    def stop(self) -> None:
        """Begin a clean stop: CLS on every connection, drain in-flight, then exit.

        Returns at once; ``wait()`` (or ``close()``) blocks until done.
        """
        if self._stop_flag.is_set():
            return
        self._stop_flag.set()
        with self.flow.lock:
            self.flow.stopping = True
        conns = self.conns()
        if not conns:
            self._stop_handlers()
            return
        for c in conns:
            c.closing = True
            c.send_quietly(P.cls())
        # handlers blocked on a message must not hold the process forever (go-nsq: 30 s)
        self._loop.call_later(30.0, self._force_exit)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until stopped; True if it stopped within ``timeout_s``."""
        return self._stopped.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """``stop()`` then ``wait()``; forcibly closes what is left after the timeout."""
        self.stop()
        if not self.wait(timeout_s):
            self._force_exit()
            self.wait(5.0)

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stopped(self) -> threading.Event:
        """Set once the consumer has fully stopped (go-nsq's StopChan)."""
        return self._stopped

    def _stop_handlers(self) -> None:
        with self._lock:
            if self._handlers_stopped:
                return
            self._handlers_stopped = True
            n = len(self._handlers)
        log.info("stopping handlers")
        if n == 0:
            self._exit()
        for _ in range(n):
            self._incoming.put(None)

    def _force_exit(self) -> None:
        if self._stopped.is_set():
            return
        for c in self.conns():
            c.close("stop timed out")
        self._stop_handlers()
        self._exit()

    def _exit(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._loop.stop()


def random_ephemeral_channel(prefix: str = "tail") -> str:
    """nsq_tail's default channel: ``tail%06d#ephemeral``."""
    return f"{prefix}{random.randrange(999999):06d}#ephemeral"
