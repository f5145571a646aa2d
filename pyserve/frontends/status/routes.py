"""The status page's HTTP routes (``--status-page``, on by default in ``pyserve run``).

* ``GET /status``: the page (static HTML; its script fills it in and refreshes it);
* ``GET /status/json``: what it shows (``pyserve.frontends.status.data``), polled by the page;
* ``GET /status/status.js`` and ``/status/status.css``: the page's script and style, shipped
  in the package (no CDN);
* ``GET /`` from a browser (``Accept`` naming ``text/html``): the page too. Anything else on
  ``/`` keeps its answer, 404 ``Not Found`` as Triton gives it.

The page and its assets carry no data; the JSON leaves out what ``--http-restricted-api``
withholds from the request. Every answer forbids framing and inline scripts (a
Content-Security-Policy that allows only this server's own script, style and JSON), and the
script writes every name and reason with ``textContent``, never as HTML.

With frontend processes these routes are answered by the process that owns the models (the
frontends relay every non-infer route to it), after it pulled the replicas' counts, so every
connection sees the same page and the same numbers.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.frontends.http.errors import status_error
from pyserve.frontends.restricted import Restrictions
from pyserve.frontends.status.data import StatusReport

_ASSETS = ("index.html", "status.js", "status.css")
_TYPES = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8",
          "css": "text/css; charset=utf-8"}
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
}
"""Sent with the page, its assets and its JSON."""


def _asset(name: str) -> bytes:
    return resources.files("pyserve.frontends.status").joinpath("assets", name).read_bytes()


def wants_html(request: Request) -> bool:
    """Whether the request's ``Accept`` header names ``text/html`` (a browser's page load)."""
    accept = request.headers.get("accept", "")
    return any(part.split(";", 1)[0].strip().lower() == "text/html" for part in accept.split(","))


def status_routes(dataplane: Any, restrictions: Restrictions | None = None) -> list[Route]:
    """The routes of the status page for ``dataplane``'s server.

    :param restrictions: ``--http-restricted-api``: what the JSON may show each request.
    :raises OSError: the page's files are missing from the installation.
    """
    assets = {name: _asset(name) for name in _ASSETS}
    report = StatusReport(dataplane, restrictions)

    def static(name: str, cache: str = "no-cache") -> Response:
        headers = {**SECURITY_HEADERS, "cache-control": cache}
        return Response(assets[name], 200, headers=headers, media_type=_TYPES[name.rsplit(".", 1)[1]])

    async def page(request: Request) -> Response:
        return static("index.html", "no-store")

    async def root(request: Request) -> Response:
        if request.method in ("GET", "HEAD") and wants_html(request):
            return static("index.html", "no-store")
        return status_error(404, "Not Found")  # what "/" answers without the page

    async def script(request: Request) -> Response:
        return static("status.js")

    async def style(request: Request) -> Response:
        return static("status.css")

    async def data(request: Request) -> Response:
        headers = request.scope["headers"]
        if report.needs_statistics(headers):
            await dataplane.collect_statistics()  # the replicas' counts, as a statistics request
        body = orjson.dumps(await report.build(headers), option=orjson.OPT_SERIALIZE_NUMPY)
        return Response(body, 200, headers={**SECURITY_HEADERS, "cache-control": "no-store"},
                        media_type="application/json")

    return [
        # every method (Starlette would make None mean GET): only a browser's GET gets the page
        Route("/", root, methods=["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
        Route("/status", page, methods=["GET"]),
        Route("/status/json", data, methods=["GET"]),
        Route("/status/status.js", script, methods=["GET"]),
        Route("/status/status.css", style, methods=["GET"]),
    ]
