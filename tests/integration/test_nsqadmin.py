"""A real nsqadmin pointed at pybroker, directly (--nsqd-http-address) and through a real
nsqlookupd: its pages load, its API (the endpoints its UI calls) reads pybroker's topics,
channels, clients and nodes, and its actions (pause, unpause, empty, delete a topic and a
channel, create through nsqlookupd, tombstone) act on pybroker.

Where an nsqd binary is found, the same steps run against it too, and nsqadmin's answers
must have the same shape (keys and value types) for both brokers."""
from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.broker import unique_name, wait_until
from tests.support.http import http_json
from tests.support.nsqadmin import Cluster, populate, start_admin, stop_admin

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["direct", "lookupd"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def cluster(mode: str) -> Iterator[Cluster]:
    c = start_admin("pybroker", mode)
    yield c
    stop_admin(c)


def read_pages(c: Cluster, topic: str) -> dict[str, Any]:
    """What nsqadmin's UI loads: its pages and the API calls behind them."""
    for page in ("/", "/topics", f"/topics/{topic}", f"/topics/{topic}/c1", "/nodes",
                 f"/nodes/{c.node}", "/counter", "/static/main.js"):
        with urllib.request.urlopen(c.api + page, timeout=10) as r:
            assert r.status == 200 and r.read(), page
    return {
        "topics": c.admin_get("/api/topics"),
        "topic": c.admin_get(f"/api/topics/{topic}"),
        "channel": c.admin_get(f"/api/topics/{topic}/c1"),
        "nodes": c.admin_get("/api/nodes"),
        "node": c.admin_get(f"/api/nodes/{c.node}"),
        # keyed by topic:channel:node; the records are what counts
        "counter": sorted(c.admin_get("/api/counter")["stats"].values(),
                          key=lambda s: (s["topic_name"], s["channel_name"])),
    }


def test_pages_show_pybrokers_topics_channels_and_clients(cluster: Cluster) -> None:
    topic = unique_name("admin")
    populate(cluster, topic)
    api = read_pages(cluster, topic)
    assert topic in api["topics"]["topics"]
    t = api["topic"]
    assert t["message_count"] == 5 and [n["node"] for n in t["nodes"]] == [cluster.node]
    assert sorted(ch["channel_name"] for ch in t["channels"]) == ["c1", "c2"]
    ch = api["channel"]
    assert (ch["in_flight_count"], ch["depth"], ch["client_count"]) == (1, 4, 1)
    [client] = ch["nodes"][0]["clients"]
    assert client["user_agent"].startswith("pybroker-client/")
    assert (client["in_flight_count"], client["ready_count"]) == (1, 1)
    [node] = api["nodes"]["nodes"]
    assert (node["tcp_port"], node["http_port"]) == (cluster.broker.tcp_address[1],  # type: ignore[index]
                                                     cluster.broker.http_address[1])  # type: ignore[index]
    assert node["version"] == "1.3.0" and not node["out_of_date"]
    assert api["node"]["total_messages"] == 5 and api["node"]["total_clients"] == 1
    counts = {(s["topic_name"], s["channel_name"]): s["message_count"]
              for s in api["counter"]}
    assert counts == {(topic, "c1"): 5, (topic, "c2"): 4}


def test_actions_act_on_pybroker(cluster: Cluster) -> None:
    topic = unique_name("admin")
    populate(cluster, topic)
    base = f"/api/topics/{topic}"

    cluster.admin_do("POST", base, {"action": "pause"})
    assert cluster.stats(topic)["paused"] is True                    # type: ignore[index]
    cluster.admin_do("POST", base, {"action": "unpause"})
    assert cluster.stats(topic)["paused"] is False                   # type: ignore[index]

    cluster.admin_do("POST", f"{base}/c2", {"action": "pause"})
    assert cluster.channel(topic, "c2")["paused"] is True            # type: ignore[index]
    assert cluster.admin_get(f"{base}/c2")["paused"] is True         # nsqadmin sees it
    cluster.admin_do("POST", f"{base}/c2", {"action": "unpause"})
    assert cluster.channel(topic, "c2")["paused"] is False           # type: ignore[index]

    assert cluster.channel(topic, "c2")["depth"] == 4                # type: ignore[index]
    cluster.admin_do("POST", f"{base}/c2", {"action": "empty"})
    assert cluster.channel(topic, "c2")["depth"] == 0                # type: ignore[index]
    cluster.admin_do("POST", base, {"action": "empty"})
    assert cluster.stats(topic)["depth"] == 0                        # type: ignore[index]

    cluster.admin_do("DELETE", f"{base}/c2")
    assert cluster.channel(topic, "c2") is None
    assert cluster.channel(topic, "c1") is not None
    cluster.admin_do("DELETE", base)
    assert cluster.stats(topic) is None
    wait_until(lambda: topic not in (cluster.admin_get("/api/topics")["topics"] or []), 10,
               what="the deleted topic to leave nsqadmin's list")


def test_create_and_tombstone_through_nsqlookupd() -> None:
    """nsqadmin creates topics in nsqlookupd, and tombstones a producer of a topic there
    before deleting the topic on the producer itself."""
    c = start_admin("pybroker", "lookupd")
    try:
        lookupd = f"http://{c.lookupd.hostport()}"                    # type: ignore[union-attr]
        made = unique_name("made")
        c.admin_do("POST", "/api/topics", {"topic": made, "channel": "fresh"})
        status, body = http_json("GET", f"{lookupd}/channels?topic={made}")
        assert status == 200 and body["channels"] == ["fresh"]

        topic = unique_name("tomb")
        populate(c, topic)
        c.admin_do("DELETE", f"/api/nodes/{c.node}", {"topic": topic})
        assert c.stats(topic) is None                   # deleted on pybroker
        assert f"DB: setting tombstone for producer@{c.node} of topic({topic})" \
            in c.lookupd.text()                                  # type: ignore[union-attr]
        [node] = c.admin_get("/api/nodes")["nodes"]
        # null once the node has no topic left: pybroker unregisters at once, as nsqd
        assert {"topic": topic, "tombstoned": False} not in (node["topics"] or [])
        # pybroker unregistered the deleted topic: nsqlookupd has no producer for it left

        def no_producers() -> bool:
            status, body = http_json("GET", f"{lookupd}/lookup?topic={topic}")
            return status == 200 and body["producers"] == []

        wait_until(no_producers, 10, what="nsqlookupd to list no producer of the topic")
    finally:
        stop_admin(c)


def shape(x: Any) -> Any:
    """The keys and JSON types of a document, without its values."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [shape(x[0])] if x else []
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return type(x).__name__
    if isinstance(x, (int, float)):
        return "number"
    return type(x).__name__


def test_nsqadmin_reads_pybroker_as_it_reads_nsqd(mode: str) -> None:
    """nsqadmin parses /stats, /info and nsqlookupd's records into its own structs: the
    same shape for both brokers means it found every field it looks for."""
    pages = {}
    for kind in ("nsqd", "pybroker"):
        c = start_admin(kind, mode)
        try:
            topic = unique_name("shape")
            populate(c, topic)
            pages[kind] = shape(read_pages(c, topic))
        finally:
            stop_admin(c)
    for name in pages["nsqd"]:
        assert pages["pybroker"][name] == pages["nsqd"][name], name
