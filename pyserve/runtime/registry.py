"""The registry: every model record the server knows, and the lookups requests make on them.

The loader (``pyserve.runtime.loader``) is the only writer: it swaps records and versions in on
the event loop. Everything here only reads, so it is safe on the event loop at any time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pyserve.api.errors import InferError
from pyserve.repository import model_config
from pyserve.repository.scan import is_version_number
from pyserve.runtime.versions import ModelRecord, ModelState, ModelVersion


def _counts_as_ready(version: ModelVersion) -> bool:
    """READY, or UNAVAILABLE because it was unloaded (strict readiness tolerates those)."""
    return version.state is ModelState.READY or (
        version.state is ModelState.UNAVAILABLE and version.reason == "unloaded"
    )


def composing(record: ModelRecord) -> set[str]:
    """The models the versions of an ensemble use (empty for other models)."""
    names: set[str] = set()
    for v in list(record.versions.values()):
        if v.config is not None and v.config.platform == model_config.ENSEMBLE_PLATFORM:
            names.update(step.model_name for step in v.config.ensemble_scheduling.step)
    return names


class ModelRegistry:
    """The model records by name (``records``) and the questions asked about them.

    ``records`` is the live mapping: the metrics and status pages read it at every scrape,
    and the loader replaces entries in it (on the event loop) as models load and unload.
    """

    def __init__(self) -> None:
        self.records: dict[str, ModelRecord] = {}

    def get(self, name: str, version: str | int | None = None) -> ModelVersion:
        """The version that serves a request, as Triton picks it.

        :param version: a version number, or None / "" for the latest READY version.
        :raises InferError: NOT_FOUND for an unknown model or version, UNAVAILABLE for a
            version that is not READY.
        """
        record = self.records.get(name)
        if record is None:
            raise InferError.not_found(f"Request for unknown model: '{name}' is not found")
        if version is None or version == "":
            latest = record.latest_ready()
            if latest is not None:
                return latest
            reason = record.reason or "; ".join(
                f"version {v.version}: {v.reason}" for _, v in sorted(record.versions.items()) if v.reason
            )
            suffix = f" ({reason})" if reason else ""
            raise InferError.not_found(f"Request for unknown model: '{name}' has no available versions{suffix}")
        if isinstance(version, int):
            number = version
        elif is_version_number(version):
            number = int(version)
        else:
            raise InferError.not_found(f"Request for unknown model: '{name}' version '{version}' is not found")
        found = record.versions.get(number)
        if found is None:
            raise InferError.not_found(f"Request for unknown model: '{name}' version {number} is not found")
        if not found.ready:
            detail = f": {found.reason}" if found.reason else ""
            raise InferError.unavailable(
                f"Request for unknown model: '{name}' version {number} is not at ready state{detail}"
            )
        return found

    def all_ready(self) -> bool:
        """Triton's strict readiness: every model has a version and every version is READY
        (versions UNAVAILABLE because they were unloaded are tolerated). A model whose config was
        refused counts for nothing, as Triton never registers it (checked side by side)."""
        for record in list(self.records.values()):
            if not record.versions:
                if record.config_refused:
                    continue
                return False
            for v in list(record.versions.values()):
                if not _counts_as_ready(v):
                    return False
        return True

    def startup_failures(self, missing: Sequence[str] = ()) -> list[str]:
        """One line per model (version) that is not READY, with its reason, after one line per
        name in ``missing`` (``--load-model`` names the repositories lack)."""
        lines = [f"  '{name}': not found in the model repositories" for name in missing]
        for name, record in sorted(self.records.items()):
            if not record.versions:
                lines.append(f"  '{name}': {record.reason or record.state.value}")
            for number, v in sorted(record.versions.items()):
                if not _counts_as_ready(v):
                    lines.append(f"  '{name}' version {number}: {v.reason or v.state.value}")
        return lines

    def index(self, ready_only: bool = False, on_disk: Iterable[str] = ()) -> list[dict[str, str]]:
        """The repository index: one entry per model version (or per model with no version),
        and, unless ``ready_only``, the name of every model in ``on_disk`` never loaded."""
        entries: list[dict[str, str]] = []
        names = set(self.records)
        if not ready_only:
            names.update(on_disk)
        for name in sorted(names):
            record = self.records.get(name)
            if record is None:
                entries.append({"name": name})
            elif not record.versions:
                if not ready_only:
                    entries.append(_model_entry(name, record))
            else:
                entries.extend(_version_entry(name, number, v)
                               for number, v in sorted(record.versions.items()) if v.ready or not ready_only)
        return entries

    def in_use(self) -> set[str]:
        """The models that ensembles with a READY version use."""
        used: set[str] = set()
        for record in list(self.records.values()):
            if record.ready_versions():
                used |= composing(record)
        return used


def _model_entry(name: str, record: ModelRecord) -> dict[str, str]:
    entry = {"name": name, "state": record.state.value}
    if record.reason:
        entry["reason"] = record.reason
    return entry


def _version_entry(name: str, number: int, version: ModelVersion) -> dict[str, str]:
    entry = {"name": name, "version": str(number), "state": version.state.value}
    if version.reason:
        entry["reason"] = version.reason
    return entry
