"""nsqadmin's pages in a real browser (headless Chromium, driven through Selenium) against
pybroker, and the same steps against nsqd 1.3: the pages render every table from
pybroker's answers with the figures they render from nsqd's, the buttons a user clicks
(pause, empty, delete, with nsqadmin's confirmation dialog) act on the broker, and the
browser logs no error and nsqadmin shows no error box on any page."""
from __future__ import annotations

import re
from typing import Any

import pytest

from tests.support.broker import unique_name, wait_until
from tests.support.browser import (buttons, chromium, click_confirmed, console_errors,
                                   open_page, shown_errors)
from tests.support.nsqadmin import Cluster, populate, start_admin, stop_admin

pytestmark = pytest.mark.timeout(180)

Pages = dict[str, Any]


def normalized(c: Cluster, pages: Pages) -> Pages:
    """What differs between two brokers started alike and is not the broker's doing:
    its ports, the client's port and how long it has been connected."""
    tcp, http = str(c.broker.tcp_address[1]), str(c.broker.http_address[1])  # type: ignore[index]

    def cell(text: str) -> str:
        if text in (tcp, http):                     # the nodes page's port columns
            return "TCP" if text == tcp else "HTTP"
        text = text.replace(f":{http}", ":HTTP").replace(f":{tcp}", ":TCP")
        text = re.sub(r"^(\S+):\d+$", r"\1:PORT", text)          # a client's address
        return re.sub(r"^(\d+(\.\d+)?(ns|µs|us|ms|s|m|h))+$", "DURATION", text)

    def walk(x: Any) -> Any:
        if isinstance(x, str):
            return cell(x)
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x

    return dict(walk(pages))


def browse(driver: Any, c: Cluster, topic: str) -> Pages:
    """The populated topic through nsqadmin's pages as a user clicks through them, then
    its buttons; returns the tables each page showed."""
    api = c.api
    pages: Pages = {}
    pages["streams"] = open_page(driver, api + "/", topic)
    pages["topic_page"] = open_page(driver, f"{api}/topics/{topic}", "c2")
    pages["channel"] = open_page(driver, f"{api}/topics/{topic}/c1", "Client Host")
    pages["nodes"] = open_page(driver, api + "/nodes", c.node.split(":")[0])
    pages["node"] = open_page(driver, f"{api}/nodes/{c.node}", "c1")
    pages["errors_shown"] = shown_errors(driver)

    # the buttons: each asks for confirmation, calls nsqadmin's API, which calls the broker
    driver.get(f"{api}/topics/{topic}")
    click_confirmed(driver, "Pause Topic")
    wait_until(lambda: (c.stats(topic) or {}).get("paused") is True, 10, 0.05,
               what="the topic paused on the broker")
    # nsqadmin reloads the page: the button now offers the opposite
    wait_until(lambda: "UnPause Topic" in buttons(driver), 15, 0.05,
               what="the reloaded page to offer UnPause Topic")
    click_confirmed(driver, "UnPause Topic")
    wait_until(lambda: (c.stats(topic) or {}).get("paused") is False, 10, 0.05,
               what="the topic unpaused on the broker")
    # and reloads the topic's page again: a reload still to come would take the place
    # of the channel's page opened next, and "Empty Queue" there empties the topic
    wait_until(lambda: "Pause Topic" in buttons(driver), 15, 0.05,
               what="the reloaded page to offer Pause Topic")

    open_page(driver, f"{api}/topics/{topic}/c2", "NSQd Host")
    click_confirmed(driver, "Empty Queue")
    wait_until(lambda: (c.channel(topic, "c2") or {}).get("depth") == 0, 10, 0.05,
               what="channel c2 emptied on the broker")
    open_page(driver, f"{api}/topics/{topic}/c2", "NSQd Host")
    click_confirmed(driver, "Delete Channel")
    wait_until(lambda: c.channel(topic, "c2") is None, 10, 0.05,
               what="channel c2 deleted on the broker")
    # after a delete nsqadmin goes to the topic's page, which lists c1 alone
    pages["after"] = open_page(driver, f"{api}/topics/{topic}", "c1")
    pages["errors_shown_after"] = shown_errors(driver)
    pages["console"] = console_errors(driver)
    assert c.channel(topic, "c1") is not None
    return pages


def visit(driver: Any, kind: str) -> Pages:
    """Start ``kind`` behind nsqadmin, populate a topic, browse it; the pages normalized."""
    c = start_admin(kind, "direct")
    try:
        topic = unique_name("browser")
        populate(c, topic)
        pages = browse(driver, c, topic)
        console = pages.pop("console")
        return normalized(c, pages) | {"topic": topic, "console": console}
    finally:
        stop_admin(c)


def test_nsqadmin_pages_in_a_browser_show_and_act_on_pybroker_as_on_nsqd() -> None:
    with chromium() as driver:
        mine = visit(driver, "pybroker")
        # what the pages show of pybroker, cell by cell
        assert mine["console"] == [] and mine["errors_shown"] == [] \
            and mine["errors_shown_after"] == [], mine
        assert [mine["topic"]] in mine["streams"][0]
        [c1] = rows_starting(mine["topic_page"], "c1")
        [c2] = rows_starting(mine["topic_page"], "c2")
        # Channel, Depth, Memory + Disk, In-Flight, Deferred, Requeued, Timed Out,
        # Messages, Connections
        assert (c1[1], c1[3], c1[7], c1[8]) == ("4", "1", "5", "1"), c1
        assert (c2[1], c2[3], c2[7], c2[8]) == ("4", "0", "4", "0"), c2
        # Client Host (the client's name and port), User-Agent, Attributes, NSQd Host,
        # In-Flight, Ready Count, Finished, Requeued, Messages, Connected
        [client] = [row for row in mine["channel"][-1][1:]]
        assert client[0].endswith(":PORT") and client[1].startswith("pybroker-client/"), client
        assert (client[3], client[4], client[5], client[8]) == ("127.0.0.1:HTTP", "1", "1",
                                                                 "1"), client
        assert rows_starting(mine["after"], "c2") == []

        theirs = visit(driver, "nsqd")      # skips (fails in CI) without an nsqd binary
    # the same tables as nsqd's, page by page (the topic name aside)
    assert theirs["console"] == [], theirs["console"]
    for page in ("streams", "topic_page", "channel", "nodes", "node", "after"):
        assert _without(mine[page], mine["topic"]) == \
            _without(theirs[page], theirs["topic"]), page


def rows_starting(tables: list[list[list[str]]], first: str) -> list[list[str]]:
    return [row for t in tables for row in t if row and row[0] == first]


def _without(tables: Any, topic: str) -> Any:
    if isinstance(tables, str):
        return tables.replace(topic, "TOPIC")
    return [_without(t, topic) for t in tables]
