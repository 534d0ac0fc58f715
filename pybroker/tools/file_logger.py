"""FileLogger: one topic's consumer and the router thread that writes it to files.

Theory of operation (nsq_to_file's FileLogger): the consumer's handler disables
auto-response and hands each message to the router. The router writes ``body\\n`` and
keeps the message un-FIN'd; it *syncs* (ends the gzip member or flushes, then fsyncs)
and only then FINs everything written, when the sync interval ticks, when max-in-flight
messages are waiting, or when the consumer is starved. A crash therefore loses nothing:
unsynced messages were never FIN'd and come back. Rotation (new datetime, size, interval)
closes the file (sync, close, move from the work dir to the output dir without
overwriting) and opens the next revision.
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO, Callable

from pybroker.client import Config, Consumer, Message
from pybroker.tools.files import (GzipMemberWriter, compute_filename_format,
                                  exclusive_rename, make_parent_dir, strftime, with_rev)

log = logging.getLogger("pybroker.tools")
# what the router thread acts on: ("msg", a message), or "term", "hup", "tick" or
# "stopped" with None
Event = tuple[str, Message | None]


@dataclass
class FileOptions:
    """nsq_to_file's options that shape files (durations in seconds)."""

    channel: str = "nsq_to_file"
    output_dir: str = "/tmp"
    work_dir: str = "/tmp"
    datetime_format: str = "%Y-%m-%d_%H"
    filename_format: str = "<TOPIC>.<HOST><REV>.<DATETIME>.log"
    host: str = ""
    gzip: bool = False
    gzip_level: int = 6
    skip_empty_files: bool = False
    rotate_size: int = 0
    rotate_interval: float = 0.0
    sync_interval: float = 30.0
    max_in_flight: int = 200


def _die(message: str) -> None:
    """nsq_to_file exits on any file error: better to stop than to FIN unwritten data."""
    log.critical(message)
    sys.stderr.flush()
    os._exit(1)


class FileLogger:
    """Writes one topic to files. Owned by the discoverer; runs one router thread."""

    def __init__(self, topic: str, opts: FileOptions, config: Config,
                 on_written: Callable[[int, int], None] | None = None) -> None:
        self.topic = topic
        self.opts = opts
        self.filename_format = compute_filename_format(
            opts.filename_format, topic, gzip=opts.gzip,
            rotating=opts.rotate_size > 0 or opts.rotate_interval > 0,
            work_dir_differs=opts.work_dir != opts.output_dir, host=opts.host)
        self.on_written = on_written
        self._events: queue.Queue[Event] = queue.Queue(maxsize=1)
        self._control: queue.Queue[str] = queue.Queue()
        self.consumer = Consumer(topic, opts.channel, self._handle, config)
        self._out: BinaryIO | None = None
        self._path = ""
        self._gz: GzipMemberWriter | None = None
        self.filename = ""
        self.rev = 0
        self.filesize = 0
        self.open_time = 0.0
        self._thread = threading.Thread(target=self._router, name=f"to-file-{topic}",
                                        daemon=True)

    def _tag(self) -> str:
        return f"[{self.topic}/{self.opts.channel}]"

    # -- consumer side ----------------------------------------------------------------
    def _handle(self, msg: Message) -> None:
        msg.disable_auto_response()
        self._events.put(("msg", msg))

    def connect(self, nsqd: list[str], lookupd: list[str]) -> None:
        self.consumer.connect_to_nsqds(nsqd)
        self.consumer.connect_to_nsqlookupds(lookupd)

    def start(self) -> None:
        self._thread.start()

    def terminate(self) -> None:
        self._control.put("term")

    def hup(self) -> None:
        self._control.put("hup")

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    # -- router ----------------------------------------------------------------------
    def _router(self) -> None:
        opts = self.opts
        pending: list[Message] = []
        next_tick: float | None = time.monotonic() + opts.sync_interval
        terminating = False
        while True:
            sync = close_file = exit_ = False
            kind, payload = self._next_event(next_tick, terminating)
            if kind == "stopped":
                sync = close_file = exit_ = True
            elif kind == "term":
                next_tick = None
                terminating = True
                self.consumer.stop()
                sync = True
            elif kind == "hup":
                sync = close_file = True
            elif kind == "tick":
                next_tick = time.monotonic() + opts.sync_interval
                if self._needs_rotation():
                    if opts.skip_empty_files:
                        close_file = True
                    else:
                        self._update_file()
                sync = True
            elif kind == "msg" and payload is not None:
                msg = payload
                if self._needs_rotation():
                    self._update_file()
                    sync = True
                self._write(msg.body + b"\n")
                pending.append(msg)
                if self.on_written is not None:
                    self.on_written(1, len(msg.body))
                if len(pending) >= opts.max_in_flight or terminating:
                    sync = True     # stopping: no more ticks, so never hold a message
            if (sync or self.consumer.is_starved()) and pending:
                log.info("%s syncing %d records to disk", self._tag(), len(pending))
                self._sync()
                for m in pending:
                    m.finish()
                pending = []
            if close_file:
                self._close()
            if exit_:
                return

    def _next_event(self, next_tick: float | None, terminating: bool) -> Event:
        while True:
            try:
                return (self._control.get_nowait(), None)
            except queue.Empty:
                pass
            if terminating and self.consumer.stopped.is_set() and self._events.empty():
                return ("stopped", None)
            now = time.monotonic()
            if next_tick is not None and now >= next_tick:
                return ("tick", None)
            wait = 0.1 if next_tick is None else min(0.1, next_tick - now)
            try:
                return self._events.get(timeout=max(wait, 0.0))
            except queue.Empty:
                continue

    # -- files -----------------------------------------------------------------------
    def _current_filename(self) -> str:
        return self.filename_format.replace("<DATETIME>",
                                            strftime(self.opts.datetime_format))

    def _needs_rotation(self) -> bool:
        if self._out is None:
            return True
        filename = self._current_filename()
        if filename != self.filename:
            log.info("%s new filename %s, rotating...", self._tag(), filename)
            return True
        if self.opts.rotate_interval > 0:
            since = time.monotonic() - self.open_time
            if since > self.opts.rotate_interval:
                log.info("%s %.3fs since last open, rotating...", self._tag(), since)
                return True
        if self.opts.rotate_size > 0 and self.filesize > self.opts.rotate_size:
            log.info("%s %s currently %d bytes (> %d), rotating...", self._tag(), self._path,
                     self.filesize, self.opts.rotate_size)
            return True
        return False

    def _write(self, data: bytes) -> None:
        try:
            if self._gz is not None:
                self._gz.write(data)
            else:
                # unbuffered, one write per line: a killed process leaves whole lines only
                assert self._out is not None
                view = memoryview(data)
                while view:
                    n = self._out.write(view)
                    view = view[n or 0:]
        except OSError as e:
            _die(f"{self._tag()} writing message to disk: {e}")
        self.filesize += len(data)

    def _sync(self) -> None:
        """Make everything written durable: end the gzip member, flush, fsync."""
        assert self._out is not None
        try:
            if self._gz is not None:
                # a complete member per sync: its trailer marks what was acknowledged
                self._gz.close()
                self._gz = GzipMemberWriter(self._out, self.opts.gzip_level)
            self._out.flush()
            os.fsync(self._out.fileno())
        except OSError as e:
            _die(f"{self._tag()} failed syncing messages: {e}")

    def _close(self) -> None:
        if self._out is None:
            return
        src = self._path
        try:
            if self._gz is not None:
                self._gz.close()
                self._gz = None
            self._out.flush()
            os.fsync(self._out.fileno())
            self._out.close()
        except OSError as e:
            _die(f"{self._tag()} failed to close output file: {e}")
        self._out = None
        if self.opts.work_dir != self.opts.output_dir:
            self._move_to_output(src)

    def _output_path(self, work_path: str) -> str:
        rel = os.path.relpath(work_path, self.opts.work_dir)
        return os.path.join(self.opts.output_dir, rel)

    def _move_to_output(self, src: str) -> None:
        dst = self._output_path(src)
        log.info("%s moving finished file %s to %s", self._tag(), src, dst)
        try:
            exclusive_rename(src, dst)
            return
        except FileExistsError:
            pass
        except OSError as e:
            _die(f"{self._tag()} unable to move file from {src} to {dst}: {e}")
        template = self._output_path(os.path.join(self.opts.work_dir, self.filename))
        rev = self.rev + 1
        while True:
            log.warning("%s destination file already exists: %s", self._tag(), dst)
            dst = with_rev(template, rev)
            try:
                exclusive_rename(src, dst)
            except FileExistsError:
                rev += 1
                continue
            except OSError as e:
                _die(f"{self._tag()} unable to rename file from {src} to {dst}: {e}")
            log.info("%s renamed finished file %s to %s to avoid overwrite", self._tag(),
                     src, dst)
            return

    def _update_file(self) -> None:
        self._close()      # uses the current filename and rev to settle a clash on move
        filename = self._current_filename()
        self.rev = 0 if filename != self.filename else self.rev + 1
        self.filename = filename
        self.open_time = time.monotonic()
        full = os.path.join(self.opts.work_dir, filename)
        try:
            make_parent_dir(full)
        except OSError as e:
            _die(f"{self._tag()} unable to create dir: {e}")
        flags = os.O_WRONLY | os.O_CREAT
        if self.opts.gzip or self.opts.rotate_interval > 0:
            flags |= os.O_EXCL
        else:
            flags |= os.O_APPEND
        while True:
            path = with_rev(full, self.rev)
            if self.opts.work_dir != self.opts.output_dir:
                # look ahead in the output dir so the move on close rarely clashes
                out_path = self._output_path(path)
                try:
                    make_parent_dir(out_path)
                except OSError as e:
                    _die(f"{self._tag()} unable to create dir: {e}")
                if os.path.exists(out_path):
                    log.warning("%s output file already exists: %s", self._tag(), out_path)
                    self.rev += 1
                    continue
            try:
                fd = os.open(path, flags, 0o666)
            except FileExistsError:
                log.warning("%s working file already exists: %s", self._tag(), path)
                self.rev += 1
                continue
            except OSError as e:
                _die(f"{self._tag()} unable to open {path}: {e}")
            log.info("%s opening %s", self._tag(), path)
            self._out = os.fdopen(fd, "ab" if flags & os.O_APPEND else "wb",
                                  buffering=-1 if self.opts.gzip else 0)
            self._path = path
            self.filesize = os.fstat(fd).st_size
            if self.opts.rotate_size > 0 and self.filesize > self.opts.rotate_size:
                log.info("%s %s currently %d bytes (> %d), rotating...", self._tag(), path,
                         self.filesize, self.opts.rotate_size)
                self._out.close()
                self._out = None
                self.rev += 1
                continue
            break
        self._gz = GzipMemberWriter(self._out, self.opts.gzip_level) if self.opts.gzip else None
