"""nsqadmin in front of one broker (pybroker or nsqd, directly or through nsqlookupd),
with a topic populated the same way for both: what the nsqadmin tests share."""
from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from pybroker.client import Consumer, Message, Producer
from tests.support.broker import BrokerProcess, wait_until
from tests.support.http import http_json
from tests.support.nsqtools import NsqDaemon, start_nsqadmin, start_nsqlookupd
from tests.support.programs import require_nsqd, require_program


@dataclass
class Cluster:
    broker: BrokerProcess
    admin: NsqDaemon
    lookupd: NsqDaemon | None
    consumers: list[Consumer] = field(default_factory=list)

    @property
    def api(self) -> str:
        return f"http://{self.admin.hostport()}"

    @property
    def node(self) -> str:
        """nsqadmin's name for the broker: broadcast address and HTTP port."""
        return f"127.0.0.1:{self.broker.http_address[1]}"  # type: ignore[index]

    def admin_get(self, path: str) -> Any:
        status, body = http_json("GET", self.api + path)
        assert status == 200, (path, status, body, self.admin.text()[-2000:])
        return body

    def admin_do(self, method: str, path: str, body: Any = None) -> None:
        status, answer = http_json(method, self.api + path, body)
        assert status == 200, (method, path, status, answer, self.admin.text()[-2000:])
        assert answer == {"message": ""}

    def stats(self, topic: str) -> dict[str, Any] | None:
        """The broker's own /stats for one topic (None when it has no such topic)."""
        with urllib.request.urlopen(f"{self.broker.http_url}/stats?format=json&topic={topic}",
                                    timeout=5) as r:
            doc = json.load(r)
        # matches nsqd: "topics" is null when the topic filter names no topic
        topics = [t for t in doc["topics"] or [] if t["topic_name"] == topic]
        return topics[0] if topics else None

    def channel(self, topic: str, name: str) -> dict[str, Any] | None:
        t = self.stats(topic)
        chans = [c for c in (t["channels"] if t else []) if c["channel_name"] == name]
        return chans[0] if chans else None


def start_admin(kind: str, mode: str) -> Cluster:
    require_program("nsqadmin")       # before anything is started
    nsqd_path = require_nsqd() if kind == "nsqd" else None
    lookupd = None
    args = ["--broadcast-address=127.0.0.1"]
    if mode == "lookupd":
        lookupd = start_nsqlookupd()
        args.append(f"--lookupd-tcp-address={lookupd.hostport('TCP')}")
    broker = BrokerProcess(kind, args, nsqd_path=nsqd_path).start()
    source = (f"--nsqd-http-address={broker.http_hostport}" if lookupd is None
              else f"--lookupd-http-address={lookupd.hostport()}")
    admin = start_nsqadmin(source)
    return Cluster(broker, admin, lookupd)


def stop_admin(c: Cluster) -> None:
    for consumer in c.consumers:
        consumer.close(5)
    c.admin.stop()
    code = c.broker.stop()
    text = c.broker.stderr_text()
    c.broker.cleanup()
    if c.lookupd is not None:
        c.lookupd.stop()
    assert code == 0 and "Traceback" not in text, text


def populate(c: Cluster, topic: str) -> None:
    """A topic with 5 messages; channel c1 (made first, so it also got the message
    published before any channel existed) with a consumer holding one in flight, and
    channel c2 with a backlog of the 4 published after it was made."""
    with Producer(c.broker.tcp_hostport) as p:
        p.publish(topic, b"first")          # makes the topic
        for name in ("c1", "c2"):
            req = urllib.request.Request(
                f"{c.broker.http_url}/channel/create?topic={topic}&channel={name}",
                data=b"", method="POST")
            urllib.request.urlopen(req, timeout=5).close()
        p.multi_publish(topic, [b"m%d" % i for i in range(4)])
    held: list[Message] = []

    def hold(m: Message) -> None:
        m.disable_auto_response()
        held.append(m)

    consumer = Consumer(topic, "c1", hold, max_in_flight=1)
    consumer.connect_to_nsqd(c.broker.tcp_hostport)
    c.consumers.append(consumer)
    wait_until(lambda: held, 10, what="a message in flight")
    if c.lookupd is not None:           # nsqadmin reads topics from nsqlookupd
        def registered() -> bool:
            status, body = http_json("GET", f"http://{c.lookupd.hostport()}/lookup"  # type: ignore[union-attr]
                                     f"?topic={topic}")
            return status == 200 and sorted(body.get("channels", [])) == ["c1", "c2"]
        wait_until(registered, 10, what="the topic and channels in nsqlookupd")
