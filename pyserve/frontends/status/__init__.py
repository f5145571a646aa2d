"""The status page: what an operator looks at (``GET /status`` on the HTTP port).

``data`` builds the JSON the page shows (models, their settings and recent numbers, within the
``--http-restricted-api`` rules); ``routes`` serves the page, its script and style (package
files under ``assets/``) and that JSON.
"""

from pyserve.frontends.status.data import StatsHistory, StatusReport
from pyserve.frontends.status.routes import status_routes

__all__ = ["StatsHistory", "StatusReport", "status_routes"]
