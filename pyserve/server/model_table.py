"""The start-up tables the server logs: one line per model version with its state and the
backend serving it, then the backends loaded."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pyserve import logs
from pyserve.host.plugins import PluginHost
from pyserve.runtime import load_reasons
from pyserve.runtime.manager import ModelManager

log = logging.getLogger("pyserve.server")  # the server's own start-up lines, under its name


def log_startup_tables(models: ModelManager, plugins: PluginHost) -> None:
    """Log the model table, a reason by its first line, then the full text of each reason the
    table cut, then the table of loaded backends (when any)."""
    rows = []  # Triton's columns first (scripts match "| <model> | <version> | READY |"), then ours
    cut: list[str] = []
    for e in models.index():
        if "state" not in e:  # models on disk that were not loaded (explicit mode) have no state
            continue
        reason = e.get("reason", "")
        shown = load_reasons.first_line(reason)
        rows.append([e["name"], e.get("version", "-"), e["state"] + (f": {shown}" if reason else ""),
                     served_by(models, e)])
        if shown != reason:
            where = f"model '{e['name']}'" + (f" version {e['version']}" if "version" in e else "")
            cut.append(f"{where}: {detail(models, e) or reason}")
    log.info("\n%s", logs.table(["Model", "Version", "Status", "Backend"], rows))
    for text in cut:
        log.info("%s", text)
    backends = [[b.info.name, b.info.distribution, b.info.version] for b in plugins.loaded_backends()]
    if backends:
        log.info("\n%s", logs.table(["Backend", "Distribution", "Version"], backends))


def detail(models: ModelManager, entry: Mapping[str, str]) -> str:
    """The full text (for the log) of an index entry's reason; "" when it has none."""
    record = models.records.get(entry["name"])
    if record is None:
        return ""
    if "version" not in entry:
        return record.detail or record.reason
    version = record.versions.get(int(entry["version"]))
    return (version.detail or version.reason) if version is not None else ""


def served_by(models: ModelManager, entry: Mapping[str, str]) -> str:
    """The model table's Backend cell: which backend serves a model version and where it comes
    from (an installed plugin, or a native library's path); ``-`` when none."""
    record = models.records.get(entry["name"])
    version = record.versions.get(int(entry["version"])) if record is not None and "version" in entry else None
    if version is None or version.backend is None:
        platform = version.config.platform if version is not None and version.config is not None else ""
        return platform or "-"
    info = version.backend.info
    return f"{info.name} ({info.origin()})"
