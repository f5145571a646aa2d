"""The response cache: hits skip the scheduler, keys cover inputs and requested outputs, LRU
eviction by bytes, hit/miss accounting for metrics, and configs the cache cannot serve."""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from pyserve import InferRequest, InferResponse, InstanceContext
from pyserve.api.backend import Backend
from pyserve.dataplane.cache import (
    CacheConfigError,
    LocalCache,
    ResponseCache,
    create_cache,
    deserialize_response,
    parse_cache_config,
    request_key,
    serialize_response,
)
from pyserve.server.core import ServerThread

CONFIG = """
name: "{name}"
backend: "counting"
max_batch_size: 8
{extra}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }},
         {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""


def config(name: str, extra: str = "response_cache { enable: true }") -> str:
    return CONFIG.format(name=name, extra=extra)


ANY_SHAPE = """
backend: "counting"
max_batch_size: 0
response_cache { enable: true }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1, -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1, -1 ] },
         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ -1, -1 ] } ]
"""


class Counting(Backend):
    """``OUTPUT0 = 2 * INPUT0``, ``OUTPUT1 = INPUT0 + 1``; counts executes per model. An
    execute of the model ``held`` waits for ``release``, setting ``holding`` meanwhile."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.executes: dict[str, int] = {}
        self.holding = threading.Event()
        self.release = threading.Event()

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        if instance.model.name == "held":
            self.holding.set()
            self.release.wait(60)
        with self.lock:
            self.executes[instance.model.name] = self.executes.get(instance.model.name, 0) + len(requests)
        return [
            InferResponse({"OUTPUT0": r.inputs["INPUT0"] * 2, "OUTPUT1": r.inputs["INPUT0"] + 1}) for r in requests
        ]


@pytest.fixture
def backend() -> Counting:
    return Counting()


@pytest.fixture
def server(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path], backend: Counting) -> ServerThread:
    repo = make_repo({"cached": config("cached"), "plain": config("plain", ""), "held": config("held"),
                      "any_shape": ANY_SHAPE})
    return start_server(repo, backends={"counting": backend}, cache_config=("local", {"size": str(1 << 20)}))


def http_infer(url: str, model: str, data: np.ndarray, outputs: tuple[str, ...] = ()) -> httpclient.InferResult:
    with httpclient.InferenceServerClient(url) as client:
        tensor = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        requested = [httpclient.InferRequestedOutput(o) for o in outputs] or None
        return client.infer(model, [tensor], outputs=requested)


def test_hits_skip_the_backend(server: ServerThread, backend: Counting) -> None:
    events: list[tuple[str, int, bool, int]] = []
    cache = server.server.dataplane.cache
    assert cache is not None
    cache.add_listener(lambda *event: events.append(event))
    data = np.arange(4, dtype=np.float32).reshape(1, 4)

    first = http_infer(server.url, "cached", data)
    second = http_infer(server.url, "cached", data)
    np.testing.assert_array_equal(first.as_numpy("OUTPUT0"), data * 2)
    np.testing.assert_array_equal(second.as_numpy("OUTPUT0"), data * 2)
    np.testing.assert_array_equal(second.as_numpy("OUTPUT1"), data + 1)
    assert backend.executes["cached"] == 1
    counts = cache.counts("cached", 1)
    assert (counts.hits, counts.misses) == (1, 1)
    assert [(m, v, hit) for m, v, hit, _ in events] == [("cached", 1, False), ("cached", 1, True)]
    assert all(ns >= 0 for *_, ns in events)

    # other input bytes, other shapes and other requested outputs are other entries
    http_infer(server.url, "cached", data + 1)
    http_infer(server.url, "cached", np.concatenate([data, data]))
    only_one = http_infer(server.url, "cached", data, outputs=("OUTPUT1",))
    assert only_one.as_numpy("OUTPUT0") is None
    assert backend.executes["cached"] == 4
    http_infer(server.url, "cached", data, outputs=("OUTPUT1",))
    assert backend.executes["cached"] == 4

    # gRPC shares the cache
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        tensor.set_data_from_numpy(data)
        result = client.infer("cached", [tensor])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data * 2)
    assert backend.executes["cached"] == 4
    assert cache.counts("cached", 1).hits == 3


@pytest.mark.parametrize("shape", [(0, 3), (3, 0)])
def test_empty_tensors_are_cached_too(server: ServerThread, backend: Counting, shape: tuple[int, int]) -> None:
    data = np.zeros(shape, dtype=np.float32)
    for _ in range(2):
        result = http_infer(server.url, "any_shape", data)
        assert result.as_numpy("OUTPUT0").shape == shape
    assert backend.executes["any_shape"] == 1
    other = np.zeros(shape[::-1], dtype=np.float32)  # the same (no) bytes, another shape
    assert http_infer(server.url, "any_shape", other).as_numpy("OUTPUT0").shape == shape[::-1]
    assert backend.executes["any_shape"] == 2


def test_a_miss_counts_the_lookup_and_insert_not_the_execute(server: ServerThread, backend: Counting) -> None:
    """As Triton counts it: a miss's duration is its lookup plus storing the response."""
    cache = server.server.dataplane.cache
    assert cache is not None
    done = threading.Thread(target=http_infer, args=(server.url, "held", np.ones((1, 4), dtype=np.float32)))
    done.start()
    assert backend.holding.wait(60)
    held_from = time.perf_counter_ns()
    time.sleep(0.5)  # the execute lasts at least this long
    held_ns = time.perf_counter_ns() - held_from
    backend.release.set()
    done.join(60)
    counts = cache.counts("held", 1)
    assert counts.misses == 1
    assert 0 < counts.miss_ns < held_ns
    totals = cache.totals()
    assert totals.misses >= 1 and totals.lookups == totals.hits + totals.misses
    assert totals.insert_ns > 0


def test_models_without_the_flag_are_not_cached(server: ServerThread, backend: Counting) -> None:
    data = np.ones((1, 4), dtype=np.float32)
    http_infer(server.url, "plain", data)
    http_infer(server.url, "plain", data)
    assert backend.executes["plain"] == 2
    assert server.server.dataplane.cache is not None
    assert server.server.dataplane.cache.counts("plain", 1).misses == 0


def test_without_cache_config_nothing_is_cached(
    start_server: Callable[..., ServerThread], make_repo: Callable[..., Path], backend: Counting
) -> None:
    server = start_server(make_repo({"cached": config("cached")}), backends={"counting": backend})
    data = np.ones((1, 4), dtype=np.float32)
    http_infer(server.url, "cached", data)
    http_infer(server.url, "cached", data)
    assert backend.executes["cached"] == 2


def test_decoupled_and_sequence_models_refuse_the_cache(
    start_server: Callable[..., ServerThread], make_repo: Callable[..., Path], backend: Counting
) -> None:
    repo = make_repo({
        "decoupled": config("decoupled", "response_cache { enable: true }\nmodel_transaction_policy { decoupled: true }"),
        "sequence": config("sequence", "response_cache { enable: true }\nsequence_batching { }"),
    })
    server = start_server(repo, backends={"counting": backend}, cache_config=("local", {"size": "1000"}))
    with httpclient.InferenceServerClient(server.url) as client:
        index = {e["name"]: e for e in client.get_model_repository_index()}
    assert index["decoupled"]["state"] == "UNAVAILABLE"
    assert "response cache is not supported for decoupled models" in index["decoupled"]["reason"]
    assert index["sequence"]["state"] == "UNAVAILABLE"
    assert "not supported with the sequence batcher" in index["sequence"]["reason"]


def _response(n: int) -> InferResponse:
    return InferResponse({"OUT": np.zeros(n, dtype=np.uint8)})


def test_lru_eviction_by_bytes() -> None:
    cache = LocalCache(size=3 * (1000 + 64 + 32))
    for key in (b"a" * 32, b"b" * 32, b"c" * 32):
        cache.put(key, _response(1000))
    assert len(cache) == 3
    assert cache.get(b"a" * 32) is not None  # a is now the most recently used
    cache.put(b"d" * 32, _response(1000))  # evicts b, the least recently used
    assert cache.get(b"b" * 32) is None
    assert all(cache.get(k * 32) is not None for k in (b"a", b"c", b"d"))
    assert cache.used <= cache.size
    cache.put(b"e" * 32, _response(2000))  # needs two slots: c and a go (d was used after them)
    assert cache.get(b"e" * 32) is not None
    assert cache.used <= cache.size
    cache.put(b"huge", _response(10_000))  # larger than the cache: never stored
    assert cache.get(b"huge") is None
    assert cache.evictions == 3  # b, then c and a


def test_cached_arrays_are_copies_and_read_only() -> None:
    cache = LocalCache(size=1 << 20)
    source = np.arange(4, dtype=np.float32)
    cache.put(b"k", InferResponse({"OUT": source}))
    source[:] = -1
    hit = cache.get(b"k")
    assert hit is not None
    np.testing.assert_array_equal(hit.outputs["OUT"], np.arange(4))
    assert not hit.outputs["OUT"].flags.writeable


def test_cache_is_thread_safe() -> None:
    cache = LocalCache(size=50 * 200)

    def work(offset: int) -> None:
        for i in range(300):
            key = b"%d" % ((i + offset) % 80)
            if cache.get(key) is None:
                cache.put(key, _response(100))

    threads = [threading.Thread(target=work, args=(n * 7,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.used == sum(cost for _, cost in cache._entries.values())
    assert cache.used <= cache.size


def test_keys_cover_names_dtypes_shapes_and_outputs() -> None:
    data = np.arange(4, dtype=np.int32)
    base = InferRequest("m", 1, {"A": data}, ("OUT",))
    assert request_key(base) == request_key(InferRequest("m", 1, {"A": data.copy()}, ("OUT",)))
    others = [
        InferRequest("m", 2, {"A": data}, ("OUT",)),
        InferRequest("n", 1, {"A": data}, ("OUT",)),
        InferRequest("m", 1, {"B": data}, ("OUT",)),
        InferRequest("m", 1, {"A": data.view(np.float32)}, ("OUT",)),
        InferRequest("m", 1, {"A": data.reshape(2, 2)}, ("OUT",)),
        InferRequest("m", 1, {"A": data}, ("OUT", "OUT2")),
        InferRequest("m", 1, {"A": np.array([b"ab", b"c"], dtype=object)}, ("OUT",)),
        InferRequest("m", 1, {"A": np.zeros((0, 3), dtype=np.int32)}, ("OUT",)),
        InferRequest("m", 1, {"A": np.zeros((3, 0), dtype=np.int32)}, ("OUT",)),
    ]
    keys = {request_key(r) for r in others}
    assert len(keys) == len(others) and request_key(base) not in keys


def test_serialized_form_round_trips() -> None:
    response = InferResponse(
        {"F": np.arange(6, dtype=np.float16).reshape(2, 3), "S": np.array([b"x", b"yz"], dtype=object)},
        {"p": 1, "q": "s"},
    )
    back = deserialize_response(serialize_response(response))
    np.testing.assert_array_equal(back.outputs["F"], response.outputs["F"])
    assert back.outputs["F"].dtype == np.float16
    assert list(back.outputs["S"]) == [b"x", b"yz"]
    assert back.parameters == {"p": 1, "q": "s"}


def test_cache_config_parsing() -> None:
    assert parse_cache_config([]) is None
    assert parse_cache_config([("local", "size", "10")]) == ("local", {"size": "10"})
    with pytest.raises(CacheConfigError, match="only one response cache"):
        parse_cache_config([("local", "size", "10"), ("redis", "host", "h")])
    with pytest.raises(CacheConfigError):
        parse_cache_config([("", "size", "10")])
    with pytest.raises(CacheConfigError, match="unknown response cache"):
        create_cache("memcached", {})
    with pytest.raises(CacheConfigError, match="greater than 0"):
        create_cache("local", {"size": "0"})
    with pytest.raises(CacheConfigError, match="integer"):
        create_cache("local", {"size": "big"})
    assert isinstance(create_cache("local", {"size": "100"}), ResponseCache)


@pytest.mark.skipif(importlib.util.find_spec("redis") is not None, reason="redis is installed")
def test_redis_without_the_package_is_a_clear_error() -> None:
    with pytest.raises(CacheConfigError, match="pip install redis"):
        create_cache("redis", {"host": "localhost", "port": "6379"})


def test_bad_cache_config_stops_the_server(make_repo: Callable[..., Path], backend: Any) -> None:
    from pyserve.host.plugins import PluginHost
    from pyserve.server.core import Server, ServerOptions, StartupError

    options = ServerOptions(model_repositories=[make_repo({})], cache_config=("local", {"size": "-1"}))
    with pytest.raises(StartupError, match="--cache-config"):
        Server(options, PluginHost(use_entry_points=False))
