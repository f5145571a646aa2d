"""Loading and unloading one model: its versions, built by the ``VersionBuilder``, are swapped
into the ``ModelRegistry``; the versions they replace are retired, drained and finalized.

One failing model never stops the others: its versions become UNAVAILABLE with a reason
naming the file, field, backend or exception. Unloading finalizes instances, then the model,
each in reverse order of creation.

A reload never interrupts serving: the new versions are built (and warmed up) on the side
while the old ones serve; then, on the event loop, the record's versions are swapped in one
assignment and the replaced versions stop taking requests, finish what they have queued and
are finalized. A reload that fails keeps the old versions serving.

Retired versions (replaced or unloaded) drain on a thread of their own: the load or unload that
retired them waits for that at most ``unload_wait_secs`` (the server's ``--exit-timeout-secs``),
then returns while an execute that does not end keeps its instance (it is finalized when it ends,
or abandoned at exit); the model's lock is not held meanwhile, so other repository calls go on.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyserve.repository.scan import ModelSource, fingerprint
from pyserve.runtime import load_reasons
from pyserve.runtime.builder import Built, NotForkSafe, Preparing, VersionBuilder, join_workers
from pyserve.runtime.ensemble_checks import EnsembleChecks
from pyserve.runtime.event_loop import LoopRunner
from pyserve.runtime.registry import ModelRegistry
from pyserve.runtime.versions import ModelRecord, ModelState, ModelVersion

__all__ = ["ModelLoader", "Preparing"]

log = logging.getLogger("pyserve.runtime")

#: At shutdown, finalizes may run this long past the exit timeout (so that idle models are
#: finalized also with ``--exit-timeout-secs 0``); one still running then is left to its thread.
FINALIZE_GRACE_SECS = 5.0


@dataclass
class _Swap:
    """What committing a built model changes: the record's new versions, the versions they
    retire, and which override directory the record keeps (``record_dir``) or drops (``stale_dir``)."""

    versions: dict[int, ModelVersion]
    retired: list[ModelVersion]
    record_dir: Path | None = None
    stale_dir: Path | None = None


class ModelLoader:
    """Loads, reloads and unloads one model at a time into ``registry`` (the caller holds
    the model's lock); ``shutdown`` unloads everything.

    :param registry: where loaded models are visible (the loader is its only writer).
    :param builder: builds, starts and finalizes the versions.
    :param loop: where swaps happen (the server's event loop, once attached).
    :param repositories: the model repositories: reasons name files relative to them.
    :param unload_wait_secs: how long a load or unload waits for the versions it retired.
    """

    def __init__(
        self,
        registry: ModelRegistry,
        builder: VersionBuilder,
        loop: LoopRunner,
        repositories: Sequence[Path],
        unload_wait_secs: float,
    ) -> None:
        self._registry = registry
        self._builder = builder
        self._loop = loop
        self._repositories = list(repositories)
        self._unload_wait_secs = unload_wait_secs
        self._ensembles = EnsembleChecks(registry, loop)
        self._lock = threading.Lock()
        self._load_order: list[ModelVersion] = []
        self._leftover_dirs: list[Path] = []
        self._draining: dict[threading.Thread, list[ModelVersion]] = {}  # retired versions still draining
        self.prepared: dict[str, Built] = {}
        """Models ``prepare`` built, waiting for ``start_prepared``."""
        self.retire_listeners: list[Callable[[], None]] = []
        """Called on the event loop as soon as a READY version stops taking requests (its
        unload begins; its executes may still run): the hand-off server tells frontends then,
        so that their replicas stop answering too, not once the owner's executes drained."""

    def read_config(self, source: ModelSource) -> Any:
        """``VersionBuilder.read_config``: a model's parsed and normalized config.

        :raises ModelConfigError: the config cannot be read.
        """
        return self._builder.read_config(source)

    # -- loading before a fork -----------------------------------------------------------------
    def prepare(self, name: str, source: ModelSource, rules: Preparing) -> str | None:
        """Build a model's versions without starting them, for a process that forks next.

        Call on the main thread while no other thread runs. Failures are not recorded: a model
        that cannot be prepared (or fails) is loaded again, normally, after the fork.

        :returns: None when every selected version is prepared (kept in ``prepared``), else
            why the model is left for after the fork: ``NotForkSafe``'s reason, or "" when it
            failed to load (the load after the fork reports that).
        """
        built = Built(source, fingerprint(source.path))
        try:
            with self._builder.preparing(rules):
                self._builder.build(built, None)
        except NotForkSafe as exc:
            self.discard_prepared(built)
            return str(exc)
        except Exception:  # a bug in one model's load: the normal load reports it
            self.discard_prepared(built)
            return ""
        if built.error or not built.versions or not all(v.prepared for v in built.versions.values()):
            self.discard_prepared(built)
            return ""
        built.prepared_fingerprint = fingerprint(source.path)
        self.prepared[name] = built
        return None

    def discard_prepared(self, built: Built) -> None:
        """Finalize the versions of ``built`` that were prepared and never started."""
        for version in built.versions.values():
            if version.prepared and version.backend is not None:
                version.prepared = False
                self._builder.finalize(version)

    def start_prepared(self, name: str, config: Any = None) -> bool:
        """Start and swap in the prepared versions of ``name`` (the model's lock is held).

        :param config: the config the caller expects (a replica: the owner's); the prepared
            model is used only if its config is the same. None: any.
        :returns: False when nothing is prepared for ``name`` (or it differs): load it normally.
        """
        built = self.prepared.pop(name, None)
        if built is None:
            return False
        configs = [v.config for v in built.versions.values()]
        if (config is not None and any(c != config for c in configs)) or (
                config is None and built.prepared_fingerprint != fingerprint(built.source.path)):
            self.discard_prepared(built)  # changed since: a normal load reads it again
            return False
        for version in built.versions.values():
            self._builder.start_version(version, built.source.path)
        self.commit(name, built)
        return True

    # -- loading one model -------------------------------------------------------------------
    def load(
        self, name: str, source: ModelSource, override_config: Any = None, override_dir: Path | None = None
    ) -> str:
        """Build a model from ``source`` and swap it in (the model's lock is held).

        :param override_config: a config to use instead of the model's own (a load request's).
        :param override_dir: the private directory ``source`` lies in (files of a load
            request); the record keeps it while versions loaded from it serve.
        :returns: "" on success, else why the load failed (a model-level reason, or the
            reasons of the versions that did not load).
        """
        built = Built(source, None if override_dir is not None else fingerprint(source.path), override_dir)
        try:
            self._builder.build(built, override_config)
        except Exception as exc:  # a bug in one model's load must not stop the others
            log.exception("model '%s' failed to load", name)
            built.error = f"{type(exc).__name__}: {exc}"
        return self.commit(name, built)

    def commit(self, name: str, built: Built) -> str:
        """Make a built model visible: swap its versions in, retire the ones they replace.

        A version that failed to load where the previous one of the same number is READY
        leaves the previous one serving; a model-level failure leaves every READY version
        serving. Runs the swap on the event loop, then drains the retired versions here.

        :returns: "" on success, else why the load failed.
        """
        record = self._registry.records.get(name)
        old = dict(record.versions) if record is not None else {}
        old_ready = {n: v for n, v in old.items() if v.ready}
        failures = [v for v in built.versions.values() if not v.ready]
        error_detail = self._report_failures(name, built, failures)
        if built.error and old_ready:
            log.error("model '%s': the reload failed; the loaded versions keep serving", name)
            assert record is not None
            record.fingerprint = built.fingerprint
            record.clean_load = False
            _remove_override(built.override_dir)
            return built.error
        change = self._plan_swap(name, built, record, old, old_ready)
        target = record if record is not None else ModelRecord(name, built.source)
        ready_now = [v for v in change.versions.values() if v.ready]

        def swap() -> None:
            target.source = built.source
            target.fingerprint = built.fingerprint
            target.clean_load = not (built.error or failures)
            target.config_refused = built.config_refused
            target.override_dir = change.record_dir
            target.versions = change.versions
            if built.error:
                target.fail(built.error, error_detail)
            else:
                target.state = ModelState.READY if ready_now else ModelState.UNAVAILABLE
                target.reason = ""
            for version in change.retired:
                version.successor = _successor(version, ready_now)
                self._retire(version)
            self._registry.records[name] = target

        with self._lock:
            self._load_order.extend(v for v in built.versions.values() if v.ready and v in ready_now)
        self._loop.call(swap)
        self._drain_retired(name, change.retired, lambda: _remove_override(change.stale_dir))
        self._ensembles.recheck(name)
        if built.error:
            return built.error
        if failures:
            return "; ".join(f"version {v.version} is at UNAVAILABLE state: {v.reason}" for v in failures)
        return ""

    def _report_failures(self, name: str, built: Built, failures: list[ModelVersion]) -> str:
        """Log the failures in full; keep for clients the reasons ``load_reasons.public`` makes
        of them. :returns: the full text of the model-level error ("" when none)."""
        roots = self._repositories
        for version in failures:
            full = version.detail or version.reason
            log.error("failed to load '%s' version %d: %s", name, version.version, full)  # Triton's words
            version.reason, version.detail = load_reasons.public(version.reason, roots), full
        error_detail = built.error
        if built.error:
            log.error("failed to load '%s': %s", name, built.error)
            built.error = load_reasons.public(built.error, roots)
        return error_detail

    def _plan_swap(
        self, name: str, built: Built, record: ModelRecord | None,
        old: dict[int, ModelVersion], old_ready: dict[int, ModelVersion],
    ) -> _Swap:
        """The versions the record holds after the swap, and the ones it retires."""
        change = _Swap({}, [])
        for number, version in sorted(built.versions.items()):
            previous = old_ready.get(number)
            if previous is not None and not version.ready:
                log.error("model '%s' version %d: the reload failed; the loaded version keeps serving", name, number)
                change.versions[number] = previous
                continue
            change.versions[number] = version
            if previous is not None:
                change.retired.append(previous)
        if not built.error:
            for number, previous in sorted(old.items()):
                if number in built.versions:
                    continue
                if previous.ready:
                    change.retired.append(previous)
                    change.versions[number] = previous  # listed as unloaded once drained
                elif previous.reason == "unloaded":
                    change.versions[number] = previous
        self._place_override_dirs(change, built, record, old_ready)
        return change

    def _place_override_dirs(
        self, change: _Swap, built: Built, record: ModelRecord | None, old_ready: dict[int, ModelVersion]
    ) -> None:
        """Which override directory the record keeps: the previous one while versions loaded
        from it still serve (the new one is then removed at shutdown at the latest)."""
        previous_dir = record.override_dir if record is not None else None
        keeps_previous_dir = previous_dir is not None and any(
            v in old_ready.values() for v in change.versions.values() if v.ready
        )
        change.record_dir = previous_dir if keeps_previous_dir else built.override_dir
        change.stale_dir = None if keeps_previous_dir or previous_dir == built.override_dir else previous_dir
        if keeps_previous_dir and built.override_dir is not None:
            with self._lock:  # both copies serve now
                self._leftover_dirs.append(built.override_dir)

    # -- unloading ---------------------------------------------------------------------------
    def unload_record(self, record: ModelRecord, forget: bool) -> None:
        """Unload every READY version of ``record`` (the model's lock is held); they stay
        listed as UNAVAILABLE ``unloaded`` unless ``forget`` (or none is left) drops the record."""
        retiring = [v for v in record.versions.values() if v.ready]
        records = self._registry.records

        def swap() -> None:
            kept = {n: v for n, v in record.versions.items() if v.ready or v.reason == "unloaded"}
            record.versions = kept
            record.state = ModelState.UNAVAILABLE
            record.reason = "unloaded" if not kept else ""
            for version in retiring:
                self._retire(version)
            if forget or not kept:
                records.pop(record.name, None)

        self._loop.call(swap)
        override_dir, record.override_dir = record.override_dir, None
        if self._drain_retired(record.name, retiring, lambda: _remove_override(override_dir)) and retiring:
            log.info("model '%s' unloaded", record.name)
        self._ensembles.recheck(record.name)

    def unload_version(self, version: ModelVersion, deadline: float | None = None,
                       finalize_by: float | None = None) -> bool:
        """Stop a version's workers after queued work, then finalize instances and model.

        :param deadline: ``time.monotonic()`` value after which running executes are not
            waited for any more; ``None`` waits for them.
        :param finalize_by: the same for a finalize (it is then left to its own thread).
        :returns: False if an instance was still executing at the deadline, or the finalize
            at ``finalize_by``; the version is then not (fully) finalized.
        """
        if version.state is not ModelState.READY:
            return True
        self._loop.call(lambda: self._retire(version))
        return self._drain(version, deadline, finalize_by)

    def _retire(self, version: ModelVersion) -> None:
        """Stop a READY version taking requests and let its workers finish what is queued.

        Called on the event loop, where requests are enqueued, so no request can reach the
        scheduler after it was told to stop.
        """
        if version.state is not ModelState.READY:
            return
        version.state = ModelState.UNLOADING
        if version.scheduler is not None:
            version.scheduler.stop(len(version.workers))
        with self._lock:
            with contextlib.suppress(ValueError):
                self._load_order.remove(version)
        for listener in self.retire_listeners:
            listener()

    def _drain(self, version: ModelVersion, deadline: float | None = None,
               finalize_by: float | None = None) -> bool:
        """Wait for a retired version's workers, then finalize its instances and model.

        :param finalize_by: ``time.monotonic()`` value after which a finalize still running is
            left to its thread (shutdown); ``None`` waits for it.
        :returns: False if an instance was still executing at the deadline (not finalized), or
            the finalize was still running at ``finalize_by``.
        """
        if not join_workers(version, deadline):
            return False
        if version.backend is not None:  # ensembles have no backend
            if finalize_by is None:
                self._builder.finalize(version)
            elif not self._finalize_before(version, finalize_by):
                return False
        version.state = ModelState.UNAVAILABLE
        version.reason = "unloaded"
        if version.context is not None:
            self._builder.notify("pyserve_model_unloaded", version.context)
        return True

    def _finalize_before(self, version: ModelVersion, finalize_by: float) -> bool:
        """Finalize ``version`` on a thread of its own and wait for it until ``finalize_by``;
        False (logged) if it is still running then: a ``finalize`` that never returns must not
        hold the server's exit past its timeout."""
        thread = threading.Thread(target=self._builder.finalize, args=(version,),
                                  name=f"pyserve-finalize-{version.name}", daemon=True)
        thread.start()
        thread.join(max(finalize_by - time.monotonic(), 0.0))
        if thread.is_alive():
            log.error("model '%s' version %d: finalize still running at the exit timeout",
                      version.name, version.version)
            return False
        return True

    def _drain_retired(self, name: str, versions: list[ModelVersion], then: Callable[[], None]) -> bool:
        """Drain retired ``versions`` (then run ``then``) on a thread of their own; wait for it
        ``unload_wait_secs`` at most. True if it finished in that time.

        An execute that never ends keeps only its own version and the thread: the caller returns
        and the model's lock is free for the next load or unload.
        """
        if not versions:
            then()
            return True

        def drain() -> None:
            try:
                for version in versions:
                    self._drain(version)
                then()
            except Exception:  # finalize errors are logged by _drain's hooks; anything else too
                log.exception("model '%s': draining its retired versions failed", name)
            finally:
                with self._lock:
                    self._draining.pop(thread, None)

        thread = threading.Thread(target=drain, name=f"pyserve-drain-{name}", daemon=True)
        with self._lock:
            self._draining[thread] = list(versions)
        thread.start()
        thread.join(self._unload_wait_secs)
        if thread.is_alive():
            log.warning("model '%s': %s still executing after %g s; they stop taking requests, and are "
                        "finalized once their executes end", name,
                        ", ".join(f"version {v.version}" for v in versions), self._unload_wait_secs)
            return False
        return True

    # -- shutdown ----------------------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """Shutdown began: ensembles are no longer re-checked as their step models go."""
        self._ensembles.stop()

    def shutdown(self, deadline: float | None, loads_running: bool) -> list[str]:
        """Unload every READY version (reverse load order), wait for the versions still draining,
        remove the override directories, then finalize the backends.

        :param deadline: ``time.monotonic()`` value after which executes are not waited for.
        :param loads_running: loads are still running: no backend is finalized.
        :returns: the versions left executing at the deadline (not finalized, nor their backends).
        """
        with self._lock:
            order = list(reversed(self._load_order))
            self._load_order.clear()
        unfinished: list[str] = []
        stuck: set[str] = set()
        # idle models are finalized also when the exit timeout is spent (or 0), in a short window
        finalize_by = None if deadline is None else max(deadline, time.monotonic() + FINALIZE_GRACE_SECS)
        for version in order:
            if not self.unload_version(version, deadline, finalize_by) and version.backend is not None:
                stuck.add(version.backend.info.name)
                unfinished.append(f"model '{version.name}' version {version.version}")
        with self._lock:
            draining = list(self._draining.items())
        for thread, versions in draining:  # versions retired by an unload or reload earlier
            thread.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            if thread.is_alive():
                for version in versions:
                    unfinished.append(f"model '{version.name}' version {version.version}")
                    if version.backend is not None:
                        stuck.add(version.backend.info.name)
        for record in list(self._registry.records.values()):
            _remove_override(record.override_dir)
            record.override_dir = None
        with self._lock:
            leftovers, self._leftover_dirs = self._leftover_dirs, []
        for path in leftovers:
            _remove_override(path)
        self._builder.finalize_backends(stuck, all_stuck=loads_running)
        return unfinished


def _remove_override(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def _successor(version: ModelVersion, ready: Sequence[ModelVersion]) -> ModelVersion | None:
    """The new version that takes requests still holding a replaced ``version``: the one
    with the same number, else the latest, provided it has the same inputs, outputs and
    transaction policy (those requests were checked against the old ones)."""
    candidates = [v for v in ready if v is not version]
    same = [v for v in candidates if v.version == version.version]
    chosen = same[0] if same else (max(candidates, key=lambda v: v.version) if candidates else None)
    if chosen is None or chosen.io != version.io or chosen.decoupled != version.decoupled:
        return None
    return chosen
