"""URL routing with the rules of nsqd's router (julienschmidt/httprouter v1.3.0).

Exact paths plus one parameter route (``/config/:opt``); a known path with another method
gets 405 ``METHOD_NOT_ALLOWED`` and an ``Allow`` header; OPTIONS on a known path gets 200
and ``Allow``; a path that only differs by a trailing slash, case or ``//``/``..`` gets a
redirect (301 for GET, 307 otherwise); anything else is 404 ``NOT_FOUND``.
"""
from __future__ import annotations

import posixpath
from collections.abc import Callable

from pybroker.http.gather import Gather
from pybroker.http.request import Request
from pybroker.http.response import HTML, Response, error

Handler = Callable[[Request], Response | Gather[Response]]


# (largest body kept, the answer past it); None for the answer: the handler never reads
# the body, so past the size it is dropped unread and the request answered as usual,
# then the connection closed (nsqd's handlers for these routes never read it; Go's
# server closes a connection that leaves a large body unread)
Limit = tuple[int, "Response | None"]


class Route:
    """The methods of one path, and how much body each may carry (checked as soon as
    the headers arrive, so an oversized body is refused before it is read)."""

    __slots__ = ("allow", "handlers", "limits", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self.handlers: dict[bytes, Handler] = {}
        self.limits: dict[bytes, Limit] = {}
        self.allow = b""

    def add(self, method: bytes, handler: Handler, limit: Limit | None) -> None:
        self.handlers[method] = handler
        if limit is not None:
            self.limits[method] = limit
        # matches httprouter: the Allow list is sorted and includes OPTIONS
        names = sorted({m.decode() for m in self.handlers} | {"OPTIONS"})
        self.allow = b"Allow: " + ", ".join(names).encode() + b"\r\n"


class Router:
    PARAM_PREFIX = "/config/"

    def __init__(self, default_limit: Limit) -> None:
        self.static: dict[str, Route] = {}
        self.param: Route | None = None  # /config/:opt
        self.default_limit = default_limit

    def add(self, method: str, path: str, handler: Handler,
            limit: Limit | None = None) -> None:
        if path.endswith("/:opt"):
            if self.param is None:
                self.param = Route(path)
            route = self.param
        else:
            route = self.static.setdefault(path, Route(path))
        route.add(method.encode(), handler, limit)

    def _match(self, path: str) -> tuple[Route | None, str]:
        route = self.static.get(path)
        if route is not None:
            return route, ""
        if self.param is not None and path.startswith(self.PARAM_PREFIX):
            opt = path[len(self.PARAM_PREFIX):]
            if opt and "/" not in opt:
                return self.param, opt
        return None, ""

    def limit(self, method: bytes, path: str) -> Limit:
        """(largest body, response when it is exceeded) for a request's headers; the
        response None: the handler never reads the body (see ``Limit``)."""
        route, _ = self._match(path)
        if route is None:
            return self.default_limit[0], self.resolve(method, path, b"")[1] or error(404, "NOT_FOUND")
        handler_limit = route.limits.get(method)
        if handler_limit is not None:
            return handler_limit
        if method not in route.handlers and method != b"OPTIONS":
            return self.default_limit[0], self._not_allowed(route)
        return self.default_limit

    def resolve(self, method: bytes, path: str, query: bytes
                ) -> tuple[Handler | None, Response | None, str]:
        """(handler, None, param) for a routed request, else (None, response, "")."""
        route, param = self._match(path)
        if route is not None:
            handler = route.handlers.get(method)
            if handler is not None:
                return handler, None, param
        redirect = self._redirect(method, path, query)
        if redirect is not None:
            return None, redirect, ""
        if route is not None:
            if method == b"OPTIONS":
                return None, Response(200, nsq=False, headers=(route.allow,)), ""
            return None, self._not_allowed(route), ""
        return None, error(404, "NOT_FOUND"), ""

    @staticmethod
    def _not_allowed(route: Route) -> Response:
        r = error(405, "METHOD_NOT_ALLOWED")
        r.headers = (route.allow,)
        return r

    def _has(self, method: bytes, path: str) -> bool:
        route, _ = self._match(path)
        return route is not None and method in route.handlers

    def _redirect(self, method: bytes, path: str, query: bytes) -> Response | None:
        """httprouter's RedirectTrailingSlash and RedirectFixedPath, for methods that
        have routes at all."""
        if path == "/" or not path or method not in (b"GET", b"POST", b"PUT"):
            return None
        fixed = None
        if path.endswith("/") and self._has(method, path.rstrip("/")):
            fixed = path.rstrip("/")
        else:
            clean = posixpath.normpath("/" + path.lstrip("/"))
            if clean.endswith("/") and clean != "/":
                clean = clean.rstrip("/")
            fixed = self._case_insensitive(method, clean)
        if fixed is None or fixed == path:
            return None
        location = fixed + ("?" + query.decode("latin-1") if query else "")
        loc = location.encode()
        if method == b"GET":
            body = b'<a href="' + loc + b'">Moved Permanently</a>.\n\n'
            return Response(301, body, HTML, nsq=False, headers=(b"Location: " + loc + b"\r\n",))
        return Response(307, nsq=False, headers=(b"Location: " + loc + b"\r\n",))

    def _case_insensitive(self, method: bytes, path: str) -> str | None:
        low = path.lower()
        for p, route in self.static.items():
            if p.lower() == low and method in route.handlers:
                return p
        prefix = self.PARAM_PREFIX
        if (self.param is not None and low.startswith(prefix) and method in self.param.handlers
                and "/" not in path[len(prefix):] and len(path) > len(prefix)):
            return prefix + path[len(prefix):]
        return None
