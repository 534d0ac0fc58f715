"""A small etcd v3 client over etcd's JSON gateway (``/v3/...``), stdlib only.

What it owns: the few calls clustering needs (lease grant / keep-alive / revoke, range,
put, delete, and a compare-and-swap transaction), each one HTTP request with a total
deadline (``timeout_s``: the connect, the request and the whole response; a peer that
trickles its answer is cut off at the deadline, not per read) and a bounded answer
(``MAX_RESPONSE``). Keys and values are ``str`` here and base64 on the wire, as the
gateway wants. etcd 3.4 (Debian's ``etcd-server``) serves the gateway at ``/v3/``.

Why not a client library: etcd3gw (the maintained gateway client) brings requests,
futurist and pbr, and sets only a per-read socket timeout; clustering needs a handful of
calls with a deadline each, and this module is what it needs in ~150 lines.
Used only by the cluster's coordinator thread (never an event loop).
"""
from __future__ import annotations

import base64
import http.client
import json
import socket
import time
import urllib.parse

from pybroker.cluster.ports import Json, JsonObj, as_int, as_list, as_obj, as_str

MAX_RESPONSE = 4 * 1024 * 1024


class EtcdError(Exception):
    """etcd could not be reached, answered an error, or did not answer in time."""


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _unb64(s: str) -> str:
    try:
        return base64.b64decode(s).decode("utf-8", "replace")
    except ValueError:
        return ""


def prefix_end(prefix: str) -> str:
    """The range end that selects every key starting with prefix (etcd's rule)."""
    b = bytearray(prefix.encode())
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b).decode("latin-1")
        b.pop()
    return "\0"


class KV:
    __slots__ = ("key", "value", "create_revision", "mod_revision", "lease")

    def __init__(self, raw: JsonObj) -> None:
        self.key = _unb64(as_str(raw.get("key")))
        self.value = _unb64(as_str(raw.get("value")))
        self.create_revision = as_int(raw.get("create_revision"))
        self.mod_revision = as_int(raw.get("mod_revision"))
        self.lease = as_int(raw.get("lease"))

    def json(self) -> Json:
        try:
            doc: Json = json.loads(self.value)
            return doc
        except ValueError:
            return None


class Compare:
    """One condition of a transaction: ``target`` of ``key`` compared with ``value``."""

    def __init__(self, key: str, target: str, value: str | int,
                 result: str = "EQUAL") -> None:
        field = {"CREATE": "create_revision", "MOD": "mod_revision", "VALUE": "value",
                 "LEASE": "lease", "VERSION": "version"}[target]
        v = _b64(str(value)) if target == "VALUE" else str(value)
        self.raw: JsonObj = {"key": _b64(key), "target": target, "result": result, field: v}


def put_op(key: str, value: str, lease: int = 0) -> JsonObj:
    req: JsonObj = {"key": _b64(key), "value": _b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}


def delete_op(key: str) -> JsonObj:
    return {"request_delete_range": {"key": _b64(key)}}


class Etcd:
    """One etcd endpoint (``http://host:port``); one request at a time (one thread)."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        u = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"cluster_etcd: {url!r} is not http://host:port")
        self.host = u.hostname
        self.port = u.port or 2379
        self.timeout_s = timeout_s

    def close(self) -> None:
        """Nothing is kept between calls (each call opens its own connection)."""

    def call(self, path: str, body: JsonObj, timeout_s: float | None = None) -> JsonObj:
        """POST one gateway request on a connection of its own (never retried: a
        transaction must not run twice); returns the decoded JSON answer. Raises
        EtcdError."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        data = json.dumps(body).encode()
        conn = http.client.HTTPConnection(self.host, self.port,
                                          timeout=max(0.001, deadline - time.monotonic()))
        try:
            return self._once(conn, path, data, deadline)
        except (OSError, http.client.HTTPException) as e:
            raise EtcdError(f"etcd {self.host}:{self.port}{path}: {e}") from None
        finally:
            conn.close()

    def _once(self, conn: http.client.HTTPConnection, path: str, data: bytes,
              deadline: float) -> JsonObj:
        conn.request("POST", "/v3" + path, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        chunks: list[bytes] = []
        got = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("deadline passed while reading the answer")
            if conn.sock is not None:
                conn.sock.settimeout(left)
            chunk = resp.read1(65536)
            if not chunk:
                break
            got += len(chunk)
            if got > MAX_RESPONSE:
                raise http.client.HTTPException(f"answer over {MAX_RESPONSE} bytes")
            chunks.append(chunk)
        text = b"".join(chunks)
        try:
            doc: Json = json.loads(text) if text else {}
        except ValueError:
            raise http.client.HTTPException(f"not JSON: {text[:100]!r}") from None
        if resp.status != 200:
            msg = doc.get("error") or doc.get("message") if isinstance(doc, dict) else doc
            raise EtcdError(f"etcd {path}: HTTP {resp.status}: {msg}")
        if isinstance(doc, dict) and "result" in doc and len(doc) == 1:
            doc = doc["result"]    # a streamed call (keep-alive) wraps its one answer
        if not isinstance(doc, dict):
            raise EtcdError(f"etcd {path}: the answer is not a JSON object")
        return doc

    # -- leases ----------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        doc = self.call("/lease/grant", {"TTL": str(ttl_s)})
        lease = as_int(doc.get("ID"))
        if not lease:
            raise EtcdError(f"etcd granted no lease: {str(doc)[:100]}")
        return lease

    def keepalive(self, lease: int) -> int:
        """Renew a lease; returns its TTL now (0: it has expired)."""
        doc = self.call("/lease/keepalive", {"ID": str(lease)})
        return as_int(doc.get("TTL"))

    def revoke(self, lease: int) -> None:
        try:
            self.call("/lease/revoke", {"ID": str(lease)})
        except EtcdError:
            pass

    # -- keys ------------------------------------------------------------------------
    def get_prefix(self, prefix: str) -> tuple[int, list[KV]]:
        """(the store's revision, every key under prefix)."""
        doc = self.call("/kv/range", {"key": _b64(prefix), "range_end": _b64(
            prefix_end(prefix).encode("latin-1"))})
        rev = as_int(as_obj(doc.get("header")).get("revision"))
        return rev, [KV(as_obj(kv)) for kv in as_list(doc.get("kvs"))]

    def get(self, key: str) -> KV | None:
        doc = self.call("/kv/range", {"key": _b64(key)})
        kvs = as_list(doc.get("kvs"))
        return KV(as_obj(kvs[0])) if kvs else None

    def put(self, key: str, value: str, lease: int = 0) -> None:
        self.call("/kv/put", as_obj(put_op(key, value, lease)["request_put"]))

    def delete(self, key: str) -> None:
        self.call("/kv/deleterange", {"key": _b64(key)})

    def txn(self, compare: list[Compare], success: list[JsonObj],
            failure: list[JsonObj] | None = None) -> bool:
        """Run success if every compare holds (else failure); True if they held."""
        return self.txn_at(compare, success, failure) > 0

    def txn_at(self, compare: list[Compare], success: list[JsonObj],
               failure: list[JsonObj] | None = None) -> int:
        """``txn``, returning the store's revision after it when the compares held (the
        ``mod_revision`` of every key its success puts: a transaction writes at one
        revision), else 0: no read after it to learn that."""
        doc = self.call("/kv/txn", {"compare": [c.raw for c in compare],
                                    "success": list(success), "failure": list(failure or [])})
        if not doc.get("succeeded", False):
            return 0
        return max(1, as_int(as_obj(doc.get("header")).get("revision")))


__all__ = ["KV", "Compare", "Etcd", "EtcdError", "delete_op", "prefix_end", "put_op"]
