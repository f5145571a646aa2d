"""The server as one object: its options (``pyserve.server.options``, every setting declared
once with its flags), the composition of runtime, data plane and frontends, and the metrics port.

``Server`` and ``ServerOptions`` are importable from here (``from pyserve.server import Server``,
as before the layout had folders); they are loaded on first use, so importing a module of this
package (``pyserve.server.options``) does not start the whole server's imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyserve.server.core import Server
    from pyserve.server.options import ServerOptions

__all__ = ["Server", "ServerOptions"]


def __getattr__(name: str) -> Any:
    if name == "ServerOptions":  # light: the option declarations only
        from pyserve.server import options

        return options.ServerOptions
    if name in __all__:
        from pyserve.server import core

        return getattr(core, name)
    raise AttributeError(f"module 'pyserve.server' has no attribute '{name}'")
