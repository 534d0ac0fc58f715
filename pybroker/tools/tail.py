"""``pybroker tail``: print a topic's messages to stdout (nsq_tail's flags and output).

One line per message (``body\\n``), prefixed by ``topic | `` with ``--print-topic``.
``-n N`` stops after N messages (max-in-flight is lowered to N so no more are asked
for); a message that arrives after that is requeued, not lost. The default channel is
an ephemeral ``tailNNNNNN#ephemeral``, as nsq_tail's.
"""
from __future__ import annotations

import logging
import sys
import threading
from typing import BinaryIO, Callable, List

import typer

from pybroker import __version__
from pybroker.client import Config, Consumer, Message, random_ephemeral_channel
from pybroker.stopflag import StopFlag
from pybroker.tools._common import Progress, StopSignals, apply_opts, fatal, opt, setup_logging

log = logging.getLogger("pybroker.tools")


def binary_stdout() -> BinaryIO:
    out = sys.stdout
    return out.buffer if hasattr(out, "buffer") else out  # type: ignore[return-value]


class TailPrinter:
    """The handler shared by every topic's consumer: writes, counts, stops at N."""

    def __init__(self, out: BinaryIO, total: int, print_topic: bool, progress: Progress,
                 stop: StopFlag, stop_consumers: Callable[[], None] = lambda: None) -> None:
        self.out = out
        self.total = total
        self.print_topic = print_topic
        self.progress = progress
        self.stop = stop
        self.stop_consumers = stop_consumers
        self.shown = 0
        self._done = False
        self._lock = threading.Lock()

    def handler(self, topic: str) -> Callable[[Message], None]:
        """The handler for ``topic``'s consumer."""
        prefix = topic.encode() + b" | " if self.print_topic else b""

        def handle(msg: Message) -> None:
            with self._lock:
                if self._done:
                    msg.requeue_without_backoff(0)   # past -n: give it back at once
                    return
                try:
                    self.out.write(prefix + msg.body + b"\n")
                    self.out.flush()
                except (BrokenPipeError, ValueError):
                    self._finish()
                    msg.requeue_without_backoff(0)
                    return
                self.shown += 1
                self.progress.add(1, len(msg.body))
                if self.total > 0 and self.shown >= self.total:
                    self._finish()

        return handle

    def _finish(self) -> None:
        """Done: CLS on every consumer's connections before this message's FIN or REQ
        goes out.

        The server must not fill the RDY a FIN frees (nor hand a REQ'd message straight
        back): each extra message would be requeued, and its attempts would climb for as
        long as the main thread takes to send CLS.
        """
        self._done = True
        self.stop_consumers()
        self.stop.set()


def tail_command(
    topic: List[str] = opt([], "topic", help="NSQ topic (may be given multiple times)"),
    channel: str = opt("", "channel", help="NSQ channel",
                       show_default="tailNNNNNN#ephemeral"),
    max_in_flight: int = opt(200, "max-in-flight",
                             help="max number of messages to allow in flight"),
    # nsq_tail's -n; Go's --n spelling is accepted too (GoFlagsCommand)
    total_messages: int = typer.Option(0, "-n", "--total-messages", metavar="INT",
                                       help="total messages to show (will wait if starved)"),
    print_topic: bool = opt(False, "print-topic",
                            help="print topic name where message was received"),
    nsqd_tcp_address: List[str] = opt([], "nsqd-tcp-address",
                                      help="nsqd TCP address (may be given multiple times)"),
    lookupd_http_address: List[str] = opt(
        [], "lookupd-http-address", help="lookupd HTTP address (may be given multiple times)"),
    consumer_opt: List[str] = opt([], "consumer-opt", help="option to passthrough to the "
                                  "Consumer, name,value (may be given multiple times)"),
    version: bool = opt(False, "version", help="print version string"),
) -> None:
    """Print messages of a topic to stdout (nsq_tail)."""
    if version:
        typer.echo(f"pybroker tail v{__version__}")
        return
    setup_logging("warn")
    if not channel:
        channel = random_ephemeral_channel("tail")
    if not nsqd_tcp_address and not lookupd_http_address:
        fatal("--nsqd-tcp-address or --lookupd-http-address required")
    if nsqd_tcp_address and lookupd_http_address:
        fatal("use --nsqd-tcp-address or --lookupd-http-address not both")
    if not topic:
        fatal("--topic required")
    # don't ask for more messages than we want
    if 0 < total_messages < max_in_flight:
        max_in_flight = total_messages
    cfg = Config(user_agent=f"pybroker-tail/{__version__}")
    apply_opts(cfg, consumer_opt, "consumer-opt")
    cfg.max_in_flight = max_in_flight

    out = binary_stdout()
    stdout_tty = hasattr(sys.stdout, "isatty") and sys.stdout.isatty()
    progress = Progress("tail", enabled=None if not stdout_tty else False)
    consumers: list[Consumer] = []
    with StopSignals() as signals:
        def stop_consumers() -> None:
            for c in list(consumers):
                c.stop()        # CLS: the server sends no more; returns at once

        printer = TailPrinter(out, total_messages, print_topic, progress, signals.stop,
                              stop_consumers=stop_consumers)
        try:
            for t in topic:
                log.info("Adding consumer for topic: %s", t)
                c = Consumer(t, channel, printer.handler(t), cfg)
                consumers.append(c)
                c.connect_to_nsqds(nsqd_tcp_address)
                c.connect_to_nsqlookupds(lookupd_http_address)
        except Exception as e:
            for c in consumers:
                c.close(5.0)
            fatal(str(e) or type(e).__name__)
        progress.start()
        signals.wait()
        for c in consumers:
            c.stop()
        for c in consumers:
            c.wait(30.0)
        progress.stop()
