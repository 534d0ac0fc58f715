"""One function per V2 verb, with nsqd's checks, order and error texts.

Each handler takes the connection and a parsed Command, and either queues a reply on the
connection or raises a ClientError (fatal unless it is E_FIN/REQ/TOUCH_FAILED). Domain
errors from core (BrokerError) are translated here. Whether a verb may run in the
connection's state is not the handlers' business: ``dispatch`` asks the session
(pybroker.protocol.session, one table), and handlers move it (SUB, CLS).

A verb is a ``*_line`` step (its checks of the command line, in nsqd's order, returning
what it parsed) and, for SUB, PUB, DPUB, MPUB, IDENTIFY and AUTH, an act that does the
rest; which runs when, and where AUTH gates, is server.verbs' table.

Ownership: every handler runs on the thread of the loop that owns the connection
(``c.loop``) and touches only that connection, its session and the channels that loop
owns; a topic is reached through the broker (``Topic.lock``), other loops and threads
only through their queues (storage requests, ``call_soon_threadsafe``).
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

from pybroker import NSQ_COMPAT_VERSION, _native
from pybroker.core.flight import offset_of
from pybroker.core.snapshot import record_latency
from pybroker.errors import (AuthDisabled, BadBody, BadChannel, BadTopic, BrokerError,
                             ClientError, DpubFailed, Exiting, FinFailed, IdentifyFailed,
                             Invalid, MpubFailed,
                             PubFailed, ReqFailed, SubFailed, TouchFailed, go_quote,
                             raw_text)
from pybroker.protocol.decoder import Command, mpub_body_error
from pybroker.protocol.identify import IdentifyDecodeError, decode_identify
from pybroker.protocol.encoder import CLOSE_WAIT_FRAME, encode_error, encode_response
from pybroker.protocol.names import is_valid_name
from pybroker.protocol.wire import MSG_ID_LENGTH
from pybroker.server import auth as authd
from pybroker.server import upgrade
from pybroker.server.iostate import HELD, OPEN
from pybroker.server.ports import Parts

if TYPE_CHECKING:
    from pybroker.core.channel import Channel
    from pybroker.server.ports import Conn

log = logging.getLogger("pybroker")
MS = 1_000_000
# what a verb's line step parsed: (topic, channel, DPUB's defer in ns)
Line = tuple[str, str, int]
NO_LINE: Line = ("", "", 0)
monotonic_ns = time.monotonic_ns


def _base10(b: bytes) -> int | None:
    """nsqd's ByteToBase10: digits only (an empty string is 0), as a uint64 that wraps
    around like Go's (so any length works, with no int-string limit); None if not digits."""
    if not b:
        return 0
    if not (b.isdigit() and b.isascii()):
        return None
    if len(b) <= 19:
        return int(b) & _U64
    v = 0
    for i in range(0, len(b), 18):
        chunk = b[i:i + 18]
        v = (v * 10 ** len(chunk) + int(chunk)) & _U64
    return v


_U64 = (1 << 64) - 1


def _int64(v: int) -> int:
    """Go's int64(v) of a uint64 (two's complement)."""
    v &= _U64
    return v - (1 << 64) if v >= 1 << 63 else v


def _ms_duration(ms: int) -> int:
    """Go's time.Duration(ms) * time.Millisecond, wrapping on overflow (nanoseconds)."""
    return _int64(_int64(ms) * MS)


def _msg_id(c: Conn, params: list[bytes], verb: str, nparams: int) -> bytes:
    if len(params) < nparams:
        raise Invalid(f"{verb} insufficient number of params")
    mid = params[1]
    if len(mid) != MSG_ID_LENGTH:
        raise Invalid("invalid message ID")
    return mid


def _topic_name(params: list[bytes], verb: str, nparams: int) -> str:
    if len(params) < nparams:
        raise Invalid(f"{verb} insufficient number of parameters")
    name = params[1]
    if not is_valid_name(name):
        # matches nsqd: its MPUB text repeats the code ("E_BAD_TOPIC E_BAD_TOPIC MPUB ...")
        again = "E_BAD_TOPIC " if verb == "MPUB" else ""
        raise BadTopic(f"{again}{verb} topic name {go_quote(name)} is not valid")
    return name.decode()


# -- IDENTIFY ------------------------------------------------------------------------------
def identify(c: Conn, line: Line, body: bytes) -> None:
    try:
        data = decode_identify(body)
    except IdentifyDecodeError:
        raise BadBody("IDENTIFY failed to decode JSON body") from None
    log.info("[%s] IDENTIFY: %s", c, " ".join(f"{k}:{v}" for k, v in data.items()))
    o = c.opts
    hb, obs, obt = data["heartbeat_interval"], data["output_buffer_size"], data["output_buffer_timeout"]
    sample, msg_timeout = data["sample_rate"], data["msg_timeout"]
    # matches nsqd's clientV2.Identify: each setter validates its own range, in this order
    if hb == -1:
        hb_ns = 0
    elif hb == 0:
        hb_ns = c.heartbeat_interval_ns
    elif 1000 <= hb <= o.max_heartbeat_interval // MS:
        hb_ns = hb * MS
    else:
        raise BadBody(f"IDENTIFY heartbeat interval ({hb}) is invalid")
    obt_ns = c.output_buffer_timeout_ns
    if obt == -1:
        obt_ns = 0
    elif obt != 0:
        if o.min_output_buffer_timeout // MS <= obt <= o.max_output_buffer_timeout // MS:
            obt_ns = obt * MS
        else:
            raise BadBody(f"IDENTIFY output buffer timeout ({obt}) is invalid")
    obs_size = c.output_buffer_size
    if obs == -1:
        obs_size, obt_ns = 1, 0
    elif obs != 0:
        if 64 <= obs <= o.max_output_buffer_size:
            obs_size = obs
        else:
            raise BadBody(f"IDENTIFY output buffer size ({obs}) is invalid")
    if not 0 <= sample <= 99:
        raise BadBody(f"IDENTIFY sample rate ({sample}) is invalid")
    mt_ns = c.msg_timeout_ns
    if msg_timeout != 0:
        if 1000 <= msg_timeout <= o.max_msg_timeout // MS:
            mt_ns = msg_timeout * MS
        else:
            raise BadBody(f"IDENTIFY msg timeout ({msg_timeout}) is invalid")
    c.client_id = data["client_id"]
    c.hostname = data["hostname"]
    c.user_agent = data["user_agent"]
    c.heartbeat_interval_ns = hb_ns
    c.output_buffer_timeout_ns = obt_ns
    c.output_buffer_size = obs_size
    c.sample_rate = sample
    c.msg_timeout_ns = mt_ns
    c.session.identify_done()
    c.schedule_heartbeat()
    if not data["feature_negotiation"]:
        c.send_ok()
        return
    # matches nsqd: each feature is granted when enabled and asked for; the level
    # asked counts only with deflate granted, and is clamped to max_deflate_level
    tls_ctx = c.loop.runtime.tls_context if data["tls_v1"] else None
    deflate = bool(o.deflate and data["deflate"])
    deflate_level = data["deflate_level"] if deflate and data["deflate_level"] > 0 else 6
    deflate_level = min(deflate_level, o.max_deflate_level)
    snappy = bool(o.snappy and data["snappy"])
    if deflate and snappy:
        raise IdentifyFailed("cannot enable both deflate and snappy compression")
    resp = {
        "max_rdy_count": o.max_rdy_count,
        "version": NSQ_COMPAT_VERSION,
        "max_msg_timeout": o.max_msg_timeout // MS,
        "msg_timeout": mt_ns // MS,
        "tls_v1": tls_ctx is not None,
        "deflate": deflate,
        "deflate_level": deflate_level,
        "max_deflate_level": o.max_deflate_level,
        "snappy": snappy,
        "sample_rate": sample,
        "auth_required": bool(o.auth_http_addresses),
        "output_buffer_size": obs_size,
        "output_buffer_timeout": obt_ns // MS,
    }
    c.send_frame(encode_response(json.dumps(resp, separators=(",", ":")).encode()))
    if tls_ctx is not None or snappy or deflate:
        upgrade.upgrade(c, tls_ctx, snappy, deflate_level if deflate else 0)


def auth_line(c: Conn, cmd: Command) -> Line:
    if len(cmd.params) != 1:
        raise Invalid("AUTH invalid number of parameters")
    return NO_LINE


def auth(c: Conn, line: Line, body: bytes) -> None:
    if c.auth_state is not None and c.auth_state.authorizations:
        raise Invalid("AUTH already set")
    if c.loop.runtime.auth is None:
        raise AuthDisabled("AUTH disabled")  # matches nsqd without --auth-http-address
    authd.start_auth(c, body.decode("utf-8", "replace"))


# -- SUB -------------------------------------------------------------------------------------
def sub_line(c: Conn, cmd: Command) -> Line:
    if c.heartbeat_interval_ns <= 0:
        raise Invalid("cannot SUB with heartbeats disabled")
    p = cmd.params
    if len(p) < 3:
        raise Invalid("SUB insufficient number of parameters")
    if not is_valid_name(p[1]):
        raise BadTopic(f"SUB topic name {go_quote(p[1])} is not valid")
    if not is_valid_name(p[2]):
        raise BadChannel(f"SUB channel name {go_quote(p[2])} is not valid")
    return p[1].decode(), p[2].decode(), 0


def sub(c: Conn, line: Line, body: bytes) -> None:
    cluster = c.loop.runtime.cluster
    if cluster is not None:
        why = cluster.sub_refusal(line[0])
        if why is not None:
            raise SubFailed(f"SUB failed {why}")
        loop = c.loop
        if cluster.sub_after_takeover(
                line[0], lambda led: loop.call_soon_threadsafe(_sub_taken_over, c, line, led)):
            # this node leads the topic but is still building the channels it took over
            # (pybroker.cluster.takeover): no command runs, and nothing more is read,
            # until they are in place
            c.hold_input()
            return
    _subscribe(c, line)


def _subscribe(c: Conn, line: Line) -> None:
    broker = c.loop.runtime.broker
    try:
        topic = broker.get_topic(line[0])
        ch = broker.get_channel(topic, line[1])
    except Exiting:
        raise SubFailed("SUB failed exiting") from None
    c.session.move("subscribe")  # no more commands until the subscription completes
    c.begin_subscribe(ch)


def _sub_taken_over(c: Conn, line: Line, led: bool) -> None:
    """On c's loop: the SUB that waited for the topic's takeover goes on (``led``: the
    node still leads it, its channels in place) or fails."""
    if c.io is not HELD:
        return      # closed (or draining) meanwhile
    c.release_input()
    try:
        if not led:
            raise SubFailed(f"SUB failed topic {line[0]} is not led by this node any more; "
                            "subscribe again (nsqlookupd lists the leader)")
        _subscribe(c, line)
    except ClientError as err:
        c.fail(err)


# -- publishing ------------------------------------------------------------------------------
def pub_line(c: Conn, cmd: Command) -> Line:
    return _topic_name(cmd.params, "PUB", 2), "", 0


def pub(c: Conn, line: Line, body: bytes) -> None:
    _publish(c, line[0], [body], 0, PubFailed, "PUB")


def dpub_line(c: Conn, cmd: Command) -> Line:
    p = cmd.params
    name = _topic_name(p, "DPUB", 3)
    ms = _base10(p[2])
    if ms is None:
        raise Invalid(f"DPUB could not parse timeout {raw_text(p[2])}")
    max_ms = c.opts.max_req_timeout // MS
    defer_ns = _ms_duration(ms)
    if not 0 <= defer_ns <= c.opts.max_req_timeout:
        raise Invalid(f"DPUB timeout {ms} out of range 0-{max_ms}")
    return name, "", defer_ns


def dpub(c: Conn, line: Line, body: bytes) -> None:
    _publish(c, line[0], [body], line[2], DpubFailed, "DPUB")


def mpub_line(c: Conn, cmd: Command) -> Line:
    return _topic_name(cmd.params, "MPUB", 2), "", 0


def mpub(c: Conn, line: Line, body: bytes) -> None:
    name = line[0]
    o = c.opts
    try:
        offs, lens = _native.mpub_parts(body, o.max_msg_size, (o.max_body_size - 4) // 5)
    except _native.ScanError as e:
        raise mpub_body_error(e, o.max_msg_size, len(body)) from None
    # more than SLICE messages are appended a slice per loop turn (server/publish.py),
    # so other clients wait for none
    _publish(c, name, (body, offs, lens), 0, MpubFailed, "MPUB")


def _publish(c: Conn, name: str, bodies: "list[bytes] | Parts", defer_ns: int,
             failed: type[ClientError], verb: str) -> None:
    """Hand the publish to the loop's Publisher: appended by the topic's owner loop,
    answered once the write (and in fsync mode the fsync) that carried it worked.
    bodies: the messages, or an MPUB body with its parts' offsets and lengths."""
    c.loop.publisher.publish_conn(c, name, bodies, defer_ns, failed, verb)
    n = len(bodies[2]) if isinstance(bodies, tuple) else len(bodies)
    c.pub_counts[name] = c.pub_counts.get(name, 0) + n


# -- consuming -------------------------------------------------------------------------------
def rdy(c: Conn, cmd: Command) -> None:
    p = cmd.params
    count = 1
    if len(p) > 1:
        n = _base10(p[1])
        if n is None:
            raise Invalid(f"RDY could not parse count {raw_text(p[1])}")
        count = _int64(n)
    if not 0 <= count <= c.opts.max_rdy_count:
        # matches nsqd: fatal, or client and server would disagree about the count
        raise Invalid(f"RDY count {count} out of range 0-{c.opts.max_rdy_count}")
    c.rdy = count
    if c.channel is not None:
        c.loop.mark_dirty(c.channel)


def fin(c: Conn, cmd: Command) -> None:
    if cmd.fin_offsets is not None:
        _fin_batch(c, cmd, cmd.fin_offsets)
        return
    mid = _msg_id(c, cmd.params, "FIN", 2)
    ch = c.channel
    assert ch is not None
    try:
        off = ch.finish(c, mid)
    except BrokerError as e:
        raise FinFailed(f"FIN {raw_text(mid)} failed {e}") from None
    c.finish_count += 1
    if c.opts.e2e_processing_latency_percentiles:
        _record_e2e(c, ch, [off])
    c.loop.mark_dirty(ch)


def fins_read(ch: "Channel", runs: list[tuple[Conn, Sequence[int], int]],
              raw: memoryview) -> None:
    """FINs the lane read (server/lane.py) for connections subscribed to ``ch``: each
    run is (connection, offsets, start), its input ``raw[start:]``, 21 bytes a FIN;
    handled as a run of FINs from the decoder is, all of them at once."""
    failures = ch.finish_runs([(c, offsets) for c, offsets, _ in runs])
    for (c, offsets, start), failed in zip(runs, failures):
        _finished(c, ch, offsets, failed)
        for i, e in failed:
            _fin_failed(c, _fin_line_id(raw, start, i), e)
    runs[0][0].loop.mark_dirty(ch)


def acks_read(c: Conn, offsets: Sequence[int], ms: Sequence[int], data: memoryview) -> None:
    """FIN and REQ lines the lane read for one connection (``data``, its input; ms[i]:
    line i's REQ timeout, -1 for a FIN), run in their order as the general path runs
    them, a run of each kind at once: FINs as the decoder's FIN runs, REQs as ``req``
    runs each once parsed; an E_FIN_FAILED or E_REQ_FAILED for each failure, naming
    its line's id."""
    ids = _LineIds(data)
    i = 0
    n = len(offsets)
    while i < n and c.io is OPEN:
        fin = ms[i] < 0
        j = i + 1
        while j < n and (ms[j] < 0) == fin:
            j += 1
        if fin:
            _fin_run(c, offsets[i:j], partial(ids.at, i))
        else:
            _requeue_run(c, offsets[i:j], ms[i:j], partial(ids.at, i))
        i = j


class _LineIds:
    """The ids of a connection's FIN and REQ lines, by line (split once, when a
    failure first needs one)."""

    __slots__ = ("data", "lines")

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.lines: list[bytes] | None = None

    def at(self, first: int, k: int) -> bytes:
        if self.lines is None:
            self.lines = bytes(self.data).split(b"\n")
        return self.lines[first + k][4:20]


def _requeue_run(c: Conn, offsets: Sequence[int], ms: Sequence[int],
                 mid_of: Callable[[int], bytes]) -> None:
    """REQs, parsed (offsets and timeouts; one from ``req``, a run the lane read): the
    clamp, the deferral, the checkpoint asked for, the counters; E_REQ_FAILED (not
    fatal) for each failure, in order, naming REQ i's id (``mid_of(i)``)."""
    ch = c.channel
    assert ch is not None
    cap = c.opts.max_req_timeout
    # matches nsqd: a REQ timeout out of 0..max_req_timeout is clamped, not rejected
    delays = [min(max(_ms_duration(t), 0), cap) if t else 0 for t in ms]
    failed = ch.requeue_run(c, offsets, delays, monotonic_ns(), time.time_ns())
    done = len(offsets) - len(failed)
    if done:
        bad = {i for i, _ in failed}
        if c.loop.durable and any(d for i, d in enumerate(delays) if i not in bad):
            c.loop.runtime.storage.request_checkpoint()   # the due times, saved soon
        c.requeue_count += done
        c.loop.mark_dirty(ch)
    for i, e in failed:
        err = ReqFailed(f"REQ {raw_text(mid_of(i))} failed {e}")
        c.log_nonfatal(err)
        c.send_frame(encode_error(err.payload()))


def _fin_line_id(raw: memoryview, at: int, k: int) -> bytes:
    """The id of the k-th of the 21-byte FIN lines at raw[at:]."""
    return bytes(raw[at + 21 * k + 4:at + 21 * k + 20])


def fins_read_singles(ch: "Channel", conns: list[Conn], offsets: Sequence[int],
                      starts: Sequence[int], raw: memoryview) -> None:
    """fins_read when each connection sent one FIN (a turn's consumers at RDY 1):
    connection i's FIN is ``raw[starts[i]:]``, of offset ``offsets[i]``."""
    failed = ch.finish_singles(conns, offsets)
    bad = {i for i, _ in failed}
    e2e = conns[0].opts.e2e_processing_latency_percentiles
    for i, c in enumerate(conns):
        if i not in bad:
            c.finish_count += 1
            if e2e:
                _record_e2e(c, ch, [offsets[i]])
    for i, e in failed:
        _fin_failed(conns[i], _fin_line_id(raw, starts[i], 0), e)
    conns[0].loop.mark_dirty(ch)


def _fin_batch(c: Conn, cmd: Command, offsets: Sequence[int]) -> None:
    """Consecutive well-formed FINs: one pass over their offsets; E_FIN_FAILED for
    each failure, in order."""
    _fin_run(c, offsets, cmd.fin_id)


def _fin_run(c: Conn, offsets: Sequence[int], mid_of: Callable[[int], bytes]) -> None:
    """A run of FINs (from the decoder or the lane) finished at once; E_FIN_FAILED for
    each failure, in order, naming FIN i's id (``mid_of(i)``)."""
    ch = c.channel
    assert ch is not None
    failed = ch.finish_offsets(c, offsets)
    _finished(c, ch, offsets, failed)
    c.loop.mark_dirty(ch)
    for i, e in failed:
        _fin_failed(c, mid_of(i), e)


def _finished(c: Conn, ch: "Channel", offsets: Sequence[int],
              failed: list[tuple[int, BrokerError]]) -> None:
    c.finish_count += len(offsets) - len(failed)
    if c.opts.e2e_processing_latency_percentiles:
        bad = {i for i, _ in failed}
        _record_e2e(c, ch, [off for i, off in enumerate(offsets) if i not in bad])


def _fin_failed(c: Conn, mid: bytes, e: BrokerError) -> None:
    err = FinFailed(f"FIN {raw_text(mid)} failed {e}")
    c.log_nonfatal(err)
    c.send_frame(encode_error(err.payload()))


def _record_e2e(c: Conn, ch: "Channel", offsets: list[int]) -> None:
    """matches nsqd: FIN feeds the channel's publish-to-finish latency percentiles (the
    publish times are read back from the log: only when percentiles are configured)."""
    now_ns, wall_ns = monotonic_ns(), time.time_ns()
    window = c.opts.e2e_processing_latency_window_time
    for ts in ch.topic.log.timestamps(offsets):
        record_latency(ch, wall_ns - ts, now_ns, window)


def req(c: Conn, cmd: Command) -> None:
    p = cmd.params
    mid = _msg_id(c, p, "REQ", 3)
    ms = _base10(p[2])
    if ms is None:
        raise Invalid(f"REQ could not parse timeout {raw_text(p[2])}")
    _requeue_run(c, (offset_of(mid),), (ms,), lambda _: mid)


def touch(c: Conn, cmd: Command) -> None:
    mid = _msg_id(c, cmd.params, "TOUCH", 2)
    assert c.channel is not None
    try:
        c.channel.touch(c, mid, monotonic_ns(), c.opts.max_msg_timeout)
    except BrokerError as e:
        raise TouchFailed(f"TOUCH {raw_text(mid)} failed {e}") from None


def cls(c: Conn, cmd: Command) -> None:
    c.rdy = 0
    c.session.move("close_wait")
    c.send_frame(CLOSE_WAIT_FRAME)


def nop(c: Conn, cmd: Command) -> None:
    return None
