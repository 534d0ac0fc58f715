"""RDY flow control and backoff for a Consumer, as go-nsq does it.

Theory of operation: ``max_in_flight`` is spread over the connections, each getting
``max(1, max_in_flight // connections)`` (its *share*); the sum of RDY counts never
exceeds ``max_in_flight`` (a connection's RDY is truncated, and retried later, if it
would). Each delivery lowers the connection's remaining RDY; RDY is refilled when the
remainder falls to 1, below 25 % of the last RDY, or when the RDY is above the share
(connections were added). The server holds RDY as a cap on in-flight messages, not a
count used up by deliveries, so a refill to the count it already has sends nothing:
only a changed count goes on the wire. When there are more connections than ``max_in_flight``, every
``rdy_redistribute_interval`` connections idle past ``low_rdy_idle_timeout`` (or holding
RDY longer than ``low_rdy_timeout``) give up their RDY and random others get RDY 1.

Backoff: a failed message raises the backoff level; the consumer sends RDY 0 everywhere
and waits ``backoff_duration(level)``; then one random connection gets RDY 1 (a trial).
A success lowers the level; at level 0 every connection returns to its share. While a
backoff wait is running, further signals are ignored, as in go-nsq.
All methods run under ``lock``; RDY hooks are called with it held and must be quick.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from enum import Enum
from typing import Callable

from pybroker.client import protocol as P
from pybroker.client.config import Config
from pybroker.client.conn import Conn
from pybroker.client.loop import IOLoop, Timer

log = logging.getLogger("pybroker.client")

RdyHook = Callable[[Conn, int], None]
_RDY_RETRY_S = 5.0


class BackoffSignal(Enum):
    BACKOFF = "backoff"      # a message failed (Requeue)
    CONTINUE = "continue"    # requeued without backoff: keep the current level
    RESUME = "resume"        # a message succeeded


class FlowController:
    """RDY bookkeeping for one Consumer. Owned by the Consumer; guarded by ``lock``."""

    def __init__(self, config: Config, loop: IOLoop, conns: Callable[[], list[Conn]],
                 on_rdy: RdyHook | None = None) -> None:
        self.config = config
        self.loop = loop
        self.conns = conns
        self.on_rdy = on_rdy
        self.lock = threading.RLock()
        self.max_in_flight = config.max_in_flight
        self.total_rdy_count = 0
        self.backoff_counter = 0
        self.backoff_duration_s = 0.0      # > 0 while a backoff wait is running
        self.need_rdy_redistributed = False
        self.stopping = False
        self._retry_timers: dict[Conn, Timer] = {}
        self._rng = random.Random()

    # -- queries ---------------------------------------------------------------------
    def per_conn_max_in_flight(self) -> int:
        """The share of one connection: ``min(max(1, mif // n), mif)``."""
        mif = self.max_in_flight
        n = len(self.conns())
        if n == 0:
            return mif
        return min(max(1, mif // n), mif)

    def in_backoff(self) -> bool:
        return self.backoff_counter > 0

    def in_backoff_timeout(self) -> bool:
        return self.backoff_duration_s > 0

    # -- deliveries ------------------------------------------------------------------
    def on_message(self, conn: Conn) -> None:
        """Count a delivery and refill RDY when it runs low (loop thread)."""
        with self.lock:
            conn.in_flight += 1
            conn.queued += 1
            conn.rdy_remaining -= 1
            if self.in_backoff() or self.in_backoff_timeout() or self.stopping:
                return
            share = self.per_conn_max_in_flight()
            remain = conn.rdy_remaining
            if remain <= 1 or remain < conn.rdy_count / 4 or (0 < share < conn.rdy_count):
                self.update_rdy(conn, share)

    def on_dispatched(self, conn: Conn) -> None:
        """A handler thread took one of ``conn``'s messages off the queue."""
        with self.lock:
            conn.queued = max(0, conn.queued - 1)

    def on_response_sent(self, conn: Conn) -> None:
        """A FIN/REQ left for ``conn``: one fewer in flight."""
        with self.lock:
            conn.in_flight = max(0, conn.in_flight - 1)

    def maybe_update_rdy(self, conn: Conn) -> None:
        """Give ``conn`` its share unless backing off (new connection, new max)."""
        with self.lock:
            if self.in_backoff() or self.in_backoff_timeout() or self.stopping:
                return
            self.update_rdy(conn, self.per_conn_max_in_flight())

    def change_max_in_flight(self, max_in_flight: int) -> None:
        with self.lock:
            if max_in_flight == self.max_in_flight:
                return
            self.max_in_flight = max_in_flight
            for c in self.conns():
                self.maybe_update_rdy(c)

    # -- RDY -------------------------------------------------------------------------
    def update_rdy(self, conn: Conn, count: int) -> bool:
        """Set ``conn``'s RDY to ``count``, truncated to stay within max_in_flight.

        Returns False if nothing could be sent (closing, or no RDY left to give).
        """
        with self.lock:
            if conn.closing or conn.is_closed:
                return False
            count = min(count, conn.max_rdy_count)
            self._cancel_retry(conn)
            max_possible = self.max_in_flight - self.total_rdy_count + conn.rdy_count
            if 0 < max_possible < count:
                count = max_possible
            if max_possible <= 0 and count > 0:
                if conn.rdy_count == 0:
                    # could not leave RDY 0: retry later so this connection never starves
                    self._retry_timers[conn] = self.loop.call_later(
                        _RDY_RETRY_S, self._retry_rdy, conn, count)
                return False
            self._send_rdy(conn, count)
            return True

    def _retry_rdy(self, conn: Conn, count: int) -> None:
        with self.lock:
            if self._retry_timers.pop(conn, None) is not None:
                self.update_rdy(conn, count)

    def _cancel_retry(self, conn: Conn) -> bool:
        timer = self._retry_timers.pop(conn, None)
        if timer is not None:
            timer.cancel()
            return True
        return False

    def _send_rdy(self, conn: Conn, count: int) -> None:
        if count == conn.rdy_count:
            # RDY is a cap on in-flight messages (nsqd, pybroker), not a count used up by
            # deliveries: the count the server already has changes nothing there, so it
            # is not sent again (at max_in_flight 1 that was a RDY per message); the
            # refill only restarts the window kept here
            if count > 0:
                conn.rdy_remaining = count
                conn.last_rdy_ts = time.monotonic()
            return
        self.total_rdy_count += count - conn.rdy_count
        conn.rdy_count = count
        conn.rdy_remaining = count
        if count > 0:
            conn.last_rdy_ts = time.monotonic()
        conn.send_quietly(P.rdy(count))
        if self.on_rdy is not None:
            self.on_rdy(conn, count)

    def on_conn_close(self, conn: Conn, left: int) -> None:
        """Take a closed connection's RDY out of the total (loop thread)."""
        with self.lock:
            had_retry = self._cancel_retry(conn)
            rdy = conn.rdy_count
            self.total_rdy_count -= rdy
            conn.rdy_count = conn.rdy_remaining = 0
            if (had_retry or rdy > 0) and (left == self.max_in_flight or self.in_backoff()):
                # leaving the ordinary case: move this RDY to another connection
                self.need_rdy_redistributed = True

    # -- backoff ---------------------------------------------------------------------
    def signal(self, signal: BackoffSignal) -> None:
        """go-nsq's startStopContinueBackoff."""
        with self.lock:
            if self.in_backoff_timeout() or self.stopping:
                return
            updated = False
            if signal is BackoffSignal.RESUME and self.backoff_counter > 0:
                self.backoff_counter -= 1
                updated = True
            elif signal is BackoffSignal.BACKOFF:
                nxt = self.config.backoff_duration(self.backoff_counter + 1)
                if nxt <= self.config.max_backoff_duration:
                    self.backoff_counter += 1
                    updated = True
            if self.backoff_counter == 0 and updated:
                count = self.per_conn_max_in_flight()
                log.warning("exiting backoff, returning all to RDY %d", count)
                for c in self.conns():
                    self.update_rdy(c, count)
            elif self.backoff_counter > 0:
                duration = min(self.config.backoff_duration(self.backoff_counter),
                               self.config.max_backoff_duration)
                log.warning("backing off for %.3fs (backoff level %d), setting all to RDY 0",
                            duration, self.backoff_counter)
                for c in self.conns():
                    self.update_rdy(c, 0)
                self._backoff(duration)

    def _backoff(self, duration_s: float) -> None:
        self.backoff_duration_s = max(duration_s, 1e-9)
        self.loop.call_later(duration_s, self._resume)

    def _resume(self) -> None:
        with self.lock:
            if self.stopping:
                self.backoff_duration_s = 0.0
                return
            conns = [c for c in self.conns() if not c.closing and not c.is_closed]
            if not conns:
                log.warning("no connection available to resume; backing off for 1s")
                self._backoff(1.0)
                return
            choice = self._rng.choice(conns)
            log.warning("(%s) backoff timeout expired, sending RDY 1", choice)
            # while in backoff only ever let 1 message at a time through
            self.backoff_duration_s = 0.0
            if not self.update_rdy(choice, 1):
                self._backoff(1.0)

    # -- redistribution --------------------------------------------------------------
    def redistribute(self) -> None:
        """go-nsq's redistributeRDY; runs every ``rdy_redistribute_interval``."""
        with self.lock:
            if self.in_backoff_timeout() or self.stopping:
                return
            conns = [c for c in self.conns() if not c.closing and not c.is_closed]
            if not conns:
                return
            if len(conns) > self.max_in_flight:
                self.need_rdy_redistributed = True
            if self.in_backoff() and len(conns) > 1:
                self.need_rdy_redistributed = True
            if not self.need_rdy_redistributed:
                return
            self.need_rdy_redistributed = False
            now = time.monotonic()
            for c in conns:
                if c.rdy_count > 0:
                    if now - c.last_message_ts > self.config.low_rdy_idle_timeout:
                        log.debug("(%s) idle connection, giving up RDY", c)
                        self.update_rdy(c, 0)
                    elif now - c.last_rdy_ts > self.config.low_rdy_timeout:
                        log.debug("(%s) RDY timeout, giving up RDY", c)
                        self.update_rdy(c, 0)
            available = self.max_in_flight - self.total_rdy_count
            if self.in_backoff():
                available = 1 - self.total_rdy_count
            possible = list(conns)
            while possible and available > 0:
                available -= 1
                c = possible.pop(self._rng.randrange(len(possible)))
                log.debug("(%s) redistributing RDY", c)
                self.update_rdy(c, 1)
