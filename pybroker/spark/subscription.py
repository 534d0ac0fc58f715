"""Subscription: the stream source's consumer connection(s) feeding a Ledger.

Owns one ``pybroker.client.Consumer`` whose handler disables auto-response and hands
every message to the ledger, and a ``spark-touch`` thread that TOUCHes held messages
every ``touch_interval`` (a third of the msg_timeout the server granted, by default) so
they outlive slow batches. nsqd caps a message's life at ``--max-msg-timeout`` (15m by
default) however often it is touched; past that it is redelivered: a duplicate, never a
loss. Lives on the driver, in the process Spark runs the stream reader in.
"""
from __future__ import annotations

import logging
import threading
import uuid

from pybroker.client import Config, Consumer, Message
from pybroker.spark.ledger import Ledger
from pybroker.spark.options import SourceOptions

log = logging.getLogger("pybroker.spark")

#: msg_timeout assumed before any connection has answered IDENTIFY (nsqd's default).
_DEFAULT_MSG_TIMEOUT_S = 60.0


class Subscription:
    """A running consumer of ``opts.topic``/``opts.channel``; see the module docstring."""

    def __init__(self, opts: SourceOptions, run: str | None = None,
                 heartbeat_s: float = 30.0) -> None:
        self.opts = opts
        self.run = run or uuid.uuid4().hex[:16]
        self.ledger = Ledger(self.run, opts.max_batch_size)
        self.heartbeat_s = heartbeat_s
        cfg = Config(max_in_flight=opts.max_in_flight, max_attempts=opts.max_attempts,
                     msg_timeout=opts.msg_timeout_s, heartbeat_interval=heartbeat_s,
                     lookupd_poll_interval=opts.lookupd_poll_interval_s)
        self.consumer = Consumer(opts.topic, opts.channel, self._on_message, cfg,
                                 on_give_up=self._on_give_up)
        self._stop = threading.Event()
        self._toucher: threading.Thread | None = None
        self.given_up = 0

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> Subscription:
        """Connect (blocking for nsqd addresses) and start the touch thread.

        Raises:
            OSError, pybroker.client.NSQError: an nsqd refused or could not be reached.
        """
        try:
            if self.opts.nsqd:
                self.consumer.connect_to_nsqds(self.opts.nsqd)
            if self.opts.lookupd:
                self.consumer.connect_to_nsqlookupds(self.opts.lookupd)
        except BaseException:
            self.consumer.close(2.0)
            raise
        self._toucher = threading.Thread(target=self._touch_loop, name="spark-touch",
                                         daemon=True)
        self._toucher.start()
        log.info("subscribed to %s/%s (run %s, max_in_flight %d, batch <= %d)",
                 self.opts.topic, self.opts.channel, self.run, self.opts.max_in_flight,
                 self.opts.max_batch_size)
        return self

    def close(self, done_seq: int | None = None, timeout_s: float = 5.0) -> tuple[int, int]:
        """FIN up to ``done_seq``, REQueue everything else, then CLS and disconnect.

        Returns (finished, requeued) as ``Ledger.stop`` does.
        """
        self._stop.set()
        # RDY 0 first so the server stops sending while we hand messages back
        try:
            self.consumer.change_max_in_flight(0)
        except Exception:
            log.debug("RDY 0 failed while closing", exc_info=True)
        result = self.ledger.stop(done_seq)
        self.consumer.close(timeout_s)
        if self._toucher is not None:
            self._toucher.join(timeout_s)
        log.info("closed subscription %s/%s (run %s): %d finished at close, %d requeued",
                 self.opts.topic, self.opts.channel, self.run, *result)
        return result

    # -- consumer callbacks (handler thread) ---------------------------------------------
    def _on_message(self, msg: Message) -> None:
        msg.disable_auto_response()
        self.ledger.add(msg)

    def _on_give_up(self, msg: Message) -> None:
        # only with max_attempts > 0: the consumer FINs it unhandled, as go-nsq does
        self.given_up += 1
        log.warning("giving up on message %s after %d attempts", msg.id.decode(),
                    msg.attempts)

    def batch_cap(self) -> int:
        """The most messages one batch may take: half the in-flight window.

        The window is max_in_flight, or less when the servers grant a smaller RDY
        (nsqd's --max-rdy-count, 2500 by default, caps each connection's in-flight).
        """
        conns = self.consumer.conns()
        window = self.opts.max_in_flight
        if conns:
            window = min(window, sum(c.max_rdy_count for c in conns))
        return max(1, min(self.opts.max_batch_size, window // 2))

    # -- liveness ----------------------------------------------------------------------
    def heartbeats(self) -> dict[int, int]:
        """Heartbeats received so far, per live connection (for ``heard_since``)."""
        return {id(c): c.heartbeats for c in self.consumer.conns()}

    def heard_since(self, before: dict[int, int]) -> bool:
        """True when every server is connected (every nsqd address given; those nsqlookupd
        named) and has sent a heartbeat since ``before`` was taken, and every message delivered so far is in the ledger (none still
        queued for the handler). A stalled server sends no heartbeat, and a connection
        that dropped is no answer either (the consumer reconnects)."""
        conns = self.consumer.conns()
        if len(conns) < len(self.opts.nsqd):
            return False
        if any(c.heartbeats <= before.get(id(c), 0) for c in conns):
            return False
        counts = self.ledger.counts()
        return sum(c.in_flight for c in conns) <= counts["waiting"] + counts["held"]

    # -- keep-alive --------------------------------------------------------------------
    def msg_timeout_s(self) -> float:
        """The smallest msg_timeout granted by the connected servers."""
        granted = [c.identify_response.msg_timeout_ms / 1000.0
                   for c in self.consumer.conns() if c.identify_response.msg_timeout_ms > 0]
        return min(granted) if granted else _DEFAULT_MSG_TIMEOUT_S

    def touch_interval_s(self) -> float:
        if self.opts.touch_interval_s > 0:
            return self.opts.touch_interval_s
        return max(0.05, self.msg_timeout_s() / 3.0)

    def _touch_loop(self) -> None:
        while not self._stop.wait(self.touch_interval_s()):
            try:
                n = self.ledger.touch()
                if n:
                    log.debug("touched %d messages", n)
            except Exception:
                log.exception("touching held messages failed")
