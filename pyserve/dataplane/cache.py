"""The response cache (``--cache-config``, model config ``response_cache { enable: true }``).

A request to a model with the cache enabled is looked up by a key made of the model name and
version, each input's name, datatype, shape and bytes, and the requested output names. A hit
is answered at once, without reaching the scheduler; a miss runs normally and its successful
response is stored.

Two stores: ``local`` (in-process LRU bounded by bytes) and ``redis`` (needs the ``redis``
package). Decoupled and sequence-batched models cannot use the cache; their configs are
refused at load (see ``pyserve.repository.model_config.validate``).

Counts for metrics and statistics: ``ResponseCache.add_listener(fn)`` registers
``fn(model_name, model_version, hit, duration_ns)``, called once per lookup of a cached
model: on a hit with the lookup time, on a miss (when the response is stored, or failed)
with lookup + insert time (not the execute between them, as Triton counts it).
``ResponseCache.counts(model, version)`` returns running totals per model version,
``ResponseCache.totals()`` the server's (lookups, hits, misses, lookup and insert time) and
``ResponseCache.occupancy()`` the store's entries, utilization and evictions (Triton's
``nv_cache_*`` gauges). Listeners run on the event loop (hits) or on instance threads (misses)
and must be quick.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import orjson

from pyserve.api.errors import InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.repository.tensor_checks import decode_bytes_elements, encode_bytes_elements

CacheListener = Callable[[str, int, bool, int], None]
"""``(model_name, model_version, hit, duration_ns)``, called per lookup."""


class CacheConfigError(ValueError):
    """``--cache-config`` names an unknown cache, a bad setting, or a store that cannot be used."""


@dataclass
class CacheCounts:
    """Running totals for one model version."""

    hits: int = 0
    misses: int = 0
    hit_ns: int = 0
    miss_ns: int = 0


@dataclass(frozen=True)
class CacheTotals:
    """The whole cache's totals (every model): lookups are its hits plus its misses."""

    hits: int
    misses: int
    lookup_ns: int
    insert_ns: int

    @property
    def lookups(self) -> int:
        return self.hits + self.misses


@dataclass(frozen=True)
class CacheOccupancy:
    """What a store holds: entries, the share of its byte budget used, entries evicted so far."""

    entries: int
    utilization: float
    evictions: int


class CacheStore(Protocol):
    """Where entries live: bytes keys → ``InferResponse`` values."""

    def get(self, key: bytes) -> InferResponse | None: ...

    def put(self, key: bytes, response: InferResponse) -> None: ...


def _frozen_copy(array: Any) -> np.ndarray:
    copy = np.array(array, copy=True)
    copy.flags.writeable = False
    return copy


def _nbytes(array: np.ndarray) -> int:
    if array.dtype == object:
        return sum(len(x) if isinstance(x, (bytes, str)) else 8 for x in array.reshape(-1)) + 8 * array.size
    return int(array.nbytes)


class LocalCache:
    """An in-process LRU of responses bounded by their total bytes. Thread-safe.

    :param size: the byte budget; an entry larger than it is never stored.
    """

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise CacheConfigError("the local cache needs size=<bytes> greater than 0")
        self.size = size
        self.used = 0
        self.evictions = 0
        self._entries: OrderedDict[bytes, tuple[InferResponse, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> InferResponse | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
        return InferResponse(entry[0].outputs, entry[0].parameters)

    def put(self, key: bytes, response: InferResponse) -> None:
        outputs = {name: _frozen_copy(array) for name, array in response.outputs.items()}
        cost = len(key) + sum(_nbytes(a) for a in outputs.values()) + 64
        if cost > self.size:
            return
        stored = InferResponse(outputs, response.parameters)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.used -= old[1]
            while self._entries and self.used + cost > self.size:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.used -= evicted
                self.evictions += 1
            self._entries[key] = (stored, cost)
            self.used += cost


_LEN = struct.Struct("<Q")


def serialize_response(response: InferResponse) -> bytes:
    """A self-describing byte form of a response (no pickle): JSON header + tensor bytes."""
    header: list[Any] = []
    blobs: list[bytes] = []
    for name, value in response.outputs.items():
        array = np.asarray(value)
        if array.dtype == object:
            blob = encode_bytes_elements(array)
            dtype = "object"
        else:
            blob = np.ascontiguousarray(array).tobytes()
            dtype = array.dtype.str
        header.append([name, dtype, list(array.shape), len(blob)])
        blobs.append(blob)
    head = orjson.dumps({"outputs": header, "parameters": response.parameters})
    return b"".join([_LEN.pack(len(head)), head, *blobs])


def deserialize_response(data: bytes) -> InferResponse:
    """The inverse of ``serialize_response``."""
    (length,) = _LEN.unpack_from(data, 0)
    head = orjson.loads(data[8 : 8 + length])
    offset = 8 + length
    outputs: dict[str, np.ndarray] = {}
    for name, dtype, shape, size in head["outputs"]:
        blob = data[offset : offset + size]
        offset += size
        count = int(np.prod(shape)) if shape else 1
        if dtype == "object":
            array = decode_bytes_elements(blob, count, name)
        else:
            array = np.frombuffer(blob, dtype=np.dtype(dtype), count=count)
        outputs[name] = array.reshape(shape)
    return InferResponse(outputs, head["parameters"])


class RedisCache:
    """Responses in Redis (``--cache-config redis,host=...,port=...``).

    Settings: ``host`` (default localhost), ``port`` (6379), ``db`` (0), ``password``,
    ``username``, ``ttl`` (seconds, 0 = none), ``prefix`` (``pyserve:``).
    """

    def __init__(self, settings: Mapping[str, str]) -> None:
        try:
            import redis
        except ImportError:
            raise CacheConfigError(
                "the redis response cache needs the 'redis' package: pip install redis"
            ) from None
        try:
            self._client = redis.Redis(
                host=settings.get("host", "localhost"),
                port=int(settings.get("port", "6379")),
                db=int(settings.get("db", "0")),
                username=settings.get("username") or None,
                password=settings.get("password") or None,
            )
            self._ttl = int(settings.get("ttl", "0"))
        except ValueError as exc:
            raise CacheConfigError(f"bad redis cache setting: {exc}") from None
        self._prefix = settings.get("prefix", "pyserve:").encode()

    def get(self, key: bytes) -> InferResponse | None:
        try:
            data = self._client.get(self._prefix + key.hex().encode())
        except Exception:  # a cache outage must not fail inference
            return None
        return None if data is None else deserialize_response(data)

    def put(self, key: bytes, response: InferResponse) -> None:
        try:
            self._client.set(self._prefix + key.hex().encode(), serialize_response(response), ex=self._ttl or None)
        except Exception:
            pass


def request_key(request: InferRequest) -> bytes:
    """The cache key: model, version, inputs (name, dtype, shape, bytes), requested outputs."""
    digest = hashlib.blake2b(digest_size=32)
    update = digest.update
    update(request.model_name.encode())
    update(b"\0%d\0" % request.model_version)
    for name in sorted(request.inputs):
        array = request.inputs[name]
        update(name.encode())
        update(b"\0")
        update(array.dtype.str.encode())
        update(repr(array.shape).encode())
        if array.dtype == object:
            update(encode_bytes_elements(array))
        else:  # its bytes as a flat byte view (also of an empty array, e.g. shape [0, 3])
            update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    update(b"\1")
    for name in request.requested_outputs:
        update(name.encode())
        update(b"\0")
    return digest.digest()


class _StoringSender:
    """Wraps a request's sender: stores its successful final response, reports the miss with
    the lookup and insert time."""

    __slots__ = ("_cache", "_inner", "_key", "_lookup_ns", "_request")

    def __init__(self, cache: ResponseCache, request: InferRequest, key: bytes, lookup_ns: int) -> None:
        self._cache = cache
        self._inner = request.attached_sender()
        self._request = request
        self._key = key
        self._lookup_ns = lookup_ns

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        if final:
            insert_ns = 0
            if isinstance(response, InferResponse):
                start = time.perf_counter_ns()
                self._cache.store.put(self._key, response)
                insert_ns = time.perf_counter_ns() - start
            request = self._request
            self._cache._report(request.model_name, request.model_version, False, self._lookup_ns, insert_ns)
        self._inner.send(response, final)

    def is_cancelled(self) -> bool:
        return self._inner.is_cancelled()


class ResponseCache:
    """The server's response cache: a store plus hit/miss accounting.

    Thread-safety: ``serve`` runs on the event loop; the stored responses' senders report from
    instance threads; ``counts``, ``totals`` and ``occupancy`` may be called from any thread.

    :param store: where entries are kept (``LocalCache`` or ``RedisCache``).
    """

    def __init__(self, store: CacheStore) -> None:
        self.store = store
        self._listeners: list[CacheListener] = []
        self._counts: dict[tuple[str, int], CacheCounts] = {}
        self._lookup_ns = 0  # every lookup's, and every insert's: the per-model times hold both
        self._insert_ns = 0
        self._lock = threading.Lock()

    def add_listener(self, listener: CacheListener) -> None:
        """Call ``listener(model, version, hit, duration_ns)`` after every lookup."""
        self._listeners.append(listener)

    def counts(self, model: str, version: int) -> CacheCounts:
        """Totals for one model version (zeros if it never used the cache)."""
        with self._lock:
            counts = self._counts.get((model, version))
            return CacheCounts(**vars(counts)) if counts is not None else CacheCounts()

    def totals(self) -> CacheTotals:
        """The server's totals over every model (the per-model counts summed)."""
        with self._lock:
            counts = list(self._counts.values())
            return CacheTotals(sum(c.hits for c in counts), sum(c.misses for c in counts),
                               self._lookup_ns, self._insert_ns)

    def occupancy(self) -> CacheOccupancy | None:
        """The local store's entries, utilization and evictions; None for a store that does not
        keep them here (redis)."""
        store = self.store
        if not isinstance(store, LocalCache):
            return None
        return CacheOccupancy(len(store), store.used / store.size, store.evictions)

    def serve(self, request: InferRequest) -> bool:
        """Answer ``request`` from the cache if possible (its sender must be attached).

        :returns: True on a hit (the response was sent); on a miss the request's sender is
            wrapped so that its response is stored, and the caller schedules it as usual.
        """
        start = time.perf_counter_ns()
        key = request_key(request)
        response = self.store.get(key)
        lookup_ns = time.perf_counter_ns() - start
        if response is not None:
            self._report(request.model_name, request.model_version, True, lookup_ns, 0)
            request.reply(response)
            return True
        request.attach_sender(_StoringSender(self, request, key, lookup_ns))
        return False

    def _report(self, model: str, version: int, hit: bool, lookup_ns: int, insert_ns: int) -> None:
        duration_ns = lookup_ns + insert_ns
        with self._lock:
            counts = self._counts.get((model, version))
            if counts is None:
                counts = self._counts[(model, version)] = CacheCounts()
            self._lookup_ns += lookup_ns
            self._insert_ns += insert_ns
            if hit:
                counts.hits += 1
                counts.hit_ns += duration_ns
            else:
                counts.misses += 1
                counts.miss_ns += duration_ns
        for listener in self._listeners:
            listener(model, version, hit, duration_ns)


def parse_cache_config(items: list[tuple[str, str, str]]) -> tuple[str, dict[str, str]] | None:
    """``--cache-config`` values (``(cache, key, value)`` triples) → ``(cache, settings)``.

    :raises CacheConfigError: more than one cache named, or a setting without a cache name.
    """
    if not items:
        return None
    names = {cache for cache, _, _ in items}
    if "" in names:
        raise CacheConfigError("--cache-config must be <cache>,<key>=<value>, e.g. local,size=1048576")
    if len(names) > 1:
        raise CacheConfigError(f"only one response cache can be configured, got {sorted(names)}")
    return names.pop(), {key: value for _, key, value in items}


def create_cache(name: str, settings: Mapping[str, str]) -> ResponseCache:
    """The cache ``--cache-config`` asks for.

    :raises CacheConfigError: unknown cache, bad size, or a missing ``redis`` package.
    """
    if name == "local":
        unknown = set(settings) - {"size"}
        if unknown:
            raise CacheConfigError(f"unknown local cache setting(s): {sorted(unknown)}")
        try:
            size = int(settings.get("size", "0"))
        except ValueError:
            raise CacheConfigError(f"local cache size must be an integer, got '{settings.get('size')}'") from None
        return ResponseCache(LocalCache(size))
    if name == "redis":
        return ResponseCache(RedisCache(settings))
    raise CacheConfigError(f"unknown response cache '{name}' (expected 'local' or 'redis')")


def cache_enabled(model: Any) -> bool:
    """Whether a loaded model version's config turns the response cache on."""
    config = getattr(model, "config", None)
    return bool(config is not None and config.response_cache.enable)
