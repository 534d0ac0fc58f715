"""pybroker.http.api.leader_only: on a node of a cluster, an HTTP action that changes a
replicated topic or its channels is answered 307 to the leader's HTTP address (same path
and query), 503 NO_LEADER while the topic has no leader, and served here otherwise (a
topic this node leads or that is not replicated, a single node, a missing or invalid
topic name, whose 400 the handler gives). The cluster's answer (``leader_http``) is
given by a stand-in; the whole path, with curl -L and nsqadmin following the redirect,
is tests/integration/test_replication.py::
test_actions_on_a_followers_http_port_are_sent_to_the_leader."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from pybroker.http.api import leader_only
from pybroker.http.request import Request
from pybroker.http.response import Response


class _Cluster:
    def __init__(self, where: str | None) -> None:
        self.where = where
        self.asked: list[str] = []

    def leader_http(self, name: str) -> str | None:
        self.asked.append(name)
        return self.where


def _call(cluster: _Cluster | None, path: str, query: bytes) -> tuple[Response, list[str]]:
    served: list[str] = []

    def handler(req: Request) -> Response:
        served.append(req.path)
        return Response(200)

    api: Any = SimpleNamespace(rt=SimpleNamespace(cluster=cluster))
    req = Request(0)
    req.method, req.path, req.query = b"POST", path, query
    r = leader_only(api, handler)(req)
    assert isinstance(r, Response)
    return r, served


def test_a_follower_redirects_to_the_leader_with_the_same_path_and_query() -> None:
    cl = _Cluster("10.0.0.2:4151")
    r, served = _call(cl, "/channel/pause", b"topic=orders&channel=c1")
    assert (r.status, served, cl.asked) == (307, [], ["orders"])
    assert r.headers == (b"Location: http://10.0.0.2:4151/channel/pause?topic=orders"
                         b"&channel=c1\r\n",)
    assert json.loads(r.body) == {"message": "NOT_LEADER"}


def test_no_leader_now_is_503() -> None:
    r, served = _call(_Cluster(""), "/topic/pause", b"topic=orders")
    assert (r.status, json.loads(r.body), served) == (503, {"message": "NO_LEADER"}, [])


@pytest.mark.parametrize("cluster,query", [
    (None, b"topic=orders"),                       # a single node
    (_Cluster(None), b"topic=orders"),             # led here, or not replicated
    (_Cluster("10.0.0.2:4151"), b""),              # no topic: the handler's 400
    (_Cluster("10.0.0.2:4151"), b"topic=bad!name"),  # invalid: the handler's 400
    (_Cluster("10.0.0.2:4151"), b"topic=%zz"),     # a query nsqd refuses: the handler's
])
def test_served_here(cluster: _Cluster | None, query: bytes) -> None:
    r, served = _call(cluster, "/channel/empty", query)
    assert (r.status, served) == (200, ["/channel/empty"])
