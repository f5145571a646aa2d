"""``--rate-limit execution_count``: instances execute only while their ``rate_limiter`` resources
are free (Triton's rate limiter), in the pool itself and in a real server."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from pyserve import InferRequest, InferResponse, InstanceContext
from pyserve.api.backend import Backend
from pyserve.runtime.scheduling.rate_limiter import (
    GLOBAL,
    HOST,
    RateLimiter,
    RateLimitError,
    ResourceClaim,
    parse_resource,
)
from pyserve.testing import serve, write_model


def _claim(name: str, priority: int = 1, **needs: int) -> ResourceClaim:
    return ResourceClaim(name, {(resource, HOST): count for resource, count in needs.items()}, priority)


def _wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _acquire_in_thread(limiter: RateLimiter, claim: ResourceClaim) -> threading.Event:
    granted = threading.Event()

    def take() -> None:
        limiter.acquire(claim)
        granted.set()

    threading.Thread(target=take, daemon=True).start()
    return granted


# -- the pool ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "parsed"), [("R1:4", ("R1", 4, None)), ("gpu_mem:2:1", ("gpu_mem", 2, 1))])
def test_resource_values_parse(value: str, parsed: tuple[str, int, int | None]) -> None:
    assert parse_resource(value) == parsed


@pytest.mark.parametrize("value", ["R1", "R1:x", ":4", "R1:4:0:1", "R1:-1", "R1:2:-1"])
def test_bad_resource_values_are_refused(value: str) -> None:
    with pytest.raises(RateLimitError, match="--rate-limit-resource"):
        parse_resource(value)


def test_capacity_is_the_most_any_instance_needs_unless_given() -> None:
    limiter = RateLimiter(["GIVEN:5", "ON1:3:1"])
    limiter.register([_claim("a", R=2), _claim("b", R=3, GIVEN=1)])
    assert limiter.capacity(("R", HOST)) == 3
    assert limiter.capacity(("GIVEN", HOST)) == 5
    assert limiter.capacity(("ON1", 1)) == 3 and limiter.capacity(("ON1", 0)) == 0
    with pytest.raises(RateLimitError, match="needs 6 unit\\(s\\) of resource 'GIVEN' on the host, but "
                                             "--rate-limit-resource gives 5"):
        limiter.register([_claim("c", GIVEN=6)])


def test_an_instance_waits_until_the_units_it_needs_are_free() -> None:
    limiter = RateLimiter()
    first, second = _claim("first", R=1), _claim("second", R=1)
    limiter.register([first, second])
    limiter.acquire(first)
    waiting = _acquire_in_thread(limiter, second)
    assert not waiting.wait(0.2)  # one unit, taken
    limiter.release(first)
    assert waiting.wait(60)
    assert limiter.in_use(("R", HOST)) == 1
    limiter.release(second)
    assert limiter.in_use(("R", HOST)) == 0


def test_one_that_fits_goes_before_an_earlier_one_that_does_not() -> None:
    limiter = RateLimiter()
    holder, big, small = _claim("holder", R=1), _claim("big", R=2), _claim("small", R=1)
    limiter.register([holder, big, small])  # two units: the most one instance needs
    limiter.acquire(holder)
    big_granted = _acquire_in_thread(limiter, big)
    _wait_until(lambda: len(limiter._waiting) == 1)
    small_granted = _acquire_in_thread(limiter, small)
    assert small_granted.wait(60) and not big_granted.is_set()
    limiter.release(holder)
    limiter.release(small)
    assert big_granted.wait(60)


def test_global_resources_are_shared_across_devices() -> None:
    limiter = RateLimiter()
    on0 = ResourceClaim("on0", {("G", GLOBAL): 1, ("L", 0): 1})
    on1 = ResourceClaim("on1", {("G", GLOBAL): 1, ("L", 1): 1})
    limiter.register([on0, on1])
    limiter.acquire(on0)
    waiting = _acquire_in_thread(limiter, on1)
    assert not waiting.wait(0.2)  # L differs per device, but G is one pool
    limiter.release(on0)
    assert waiting.wait(60)
    limiter.release(on1)


def test_the_instance_with_fewer_weighted_turns_goes_first() -> None:
    """Priority is a weight: while both wait, priority 1 is chosen before priority 2 once it has
    had as many turns as the other's doubled count."""
    limiter = RateLimiter()
    blocker, light, heavy = _claim("blocker", R=1), _claim("light", 1, R=1), _claim("heavy", 2, R=1)
    limiter.register([blocker, light, heavy])
    first_turns: list[str] = []
    for _ in range(8):
        limiter.acquire(blocker)
        order: list[str] = []

        def take(claim: ResourceClaim, order: list[str]) -> None:
            limiter.acquire(claim)
            order.append(claim.instance)
            limiter.release(claim)

        threads = [threading.Thread(target=take, args=(c, order)) for c in (heavy, light)]
        for thread in threads:
            thread.start()
        _wait_until(lambda: len(limiter._waiting) == 2)
        limiter.release(blocker)
        for thread in threads:
            thread.join(60)
        first_turns.append(order[0])
        blocker.turns = min(light.turns, heavy.turns)  # the blocker never competes
    assert first_turns.count("light") >= 7, first_turns


# -- a real server -------------------------------------------------------------------------------

DELAY_MS = 400


def _model(repo: Path, name: str, resources: str, backend: str = "identity") -> None:
    """An echo model of one instance with ``rate_limiter { resources }``: ``identity``, whose
    execute takes ``DELAY_MS``, or ``meet`` (``Meet``)."""
    write_model(repo, name, f"""
        backend: "{backend}"
        max_batch_size: 0
        input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
        output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
        instance_group [ {{ count: 1 kind: KIND_CPU rate_limiter {{ {resources} }} }} ]
        parameters {{ key: "execute_delay_ms" value {{ string_value: "{DELAY_MS}" }} }}
    """)


class Meet(Backend):
    """Echoes ``INPUT0`` once two executes are under way at once: executes that take turns fail
    (each waits for the other, for up to 60 s)."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=60)

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        self.barrier.wait()
        return [InferResponse({"OUTPUT0": r.inputs["INPUT0"]}) for r in requests]


def _both_at_once(url: str) -> float:
    """Seconds until one request to each of models a and b, sent together, are answered."""
    def ask(model: str) -> None:
        with httpclient.InferenceServerClient(url, network_timeout=120) as client:
            data = httpclient.InferInput("INPUT0", [2], "FP32")
            data.set_data_from_numpy(np.array([1, 2], dtype=np.float32))
            assert client.infer(model, [data]).as_numpy("OUTPUT0").tolist() == [1, 2]

    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(ask, ["a", "b"]))
    return time.monotonic() - start


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    _model(root, "a", 'resources [ { name: "R" count: 1 } ]')
    _model(root, "b", 'resources [ { name: "R" count: 1 } ] priority: 2')
    return root


@pytest.fixture
def meeting_repo(tmp_path: Path) -> Path:
    """The models of ``repo`` on ``Meet``: answered only if their executes overlap."""
    root = tmp_path / "meeting"
    _model(root, "a", 'resources [ { name: "R" count: 1 } ]', backend="meet")
    _model(root, "b", 'resources [ { name: "R" count: 1 } ] priority: 2', backend="meet")
    return root


def test_instances_sharing_a_resource_take_turns(repo: Path) -> None:
    with serve(repo, rate_limit="execution_count") as server:
        elapsed = _both_at_once(server.url)
    assert elapsed >= 2 * DELAY_MS / 1000 * 0.95, elapsed  # one unit of R: one execute at a time


def test_without_rate_limiting_they_overlap(meeting_repo: Path) -> None:
    with serve(meeting_repo, backends={"meet": Meet()}) as server:  # --rate-limit off (the default) ignores rate_limiter
        _both_at_once(server.url)  # answered: the two executes were under way together


def test_more_units_let_them_run_together(meeting_repo: Path) -> None:
    with serve(meeting_repo, backends={"meet": Meet()}, rate_limit="execution_count",
               rate_limit_resources=["R:2"]) as server:
        _both_at_once(server.url)  # answered: the two executes were under way together


def test_too_few_units_leave_the_model_unavailable(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    _model(root, "greedy", 'resources [ { name: "R" count: 3 } ]')
    _model(root, "modest", 'resources [ { name: "R" count: 1 } ]')
    with serve(root, rate_limit="execution_count", rate_limit_resources=["R:2"]) as server:
        with httpclient.InferenceServerClient(server.url) as client:
            index = {e["name"]: e for e in client.get_model_repository_index()}
            assert client.is_model_ready("modest")
    assert index["greedy"]["state"] == "UNAVAILABLE"
    assert ("rate limiter: instance 'greedy_0_0' needs 3 unit(s) of resource 'R' on the host, but "
            "--rate-limit-resource gives 2") in index["greedy"]["reason"]


@pytest.mark.parametrize(("options", "message"), [
    ({"rate_limit": "always"}, "--rate-limit must be off or execution_count, got 'always'"),
    ({"rate_limit": "execution_count", "rate_limit_resources": ["R"]}, "expected NAME:COUNT or NAME:COUNT:DEVICE"),
])
def test_bad_settings_stop_the_server(tmp_path: Path, options: dict[str, object], message: str) -> None:
    from pyserve.server.core import StartupError

    with pytest.raises(StartupError, match=message):
        with serve(tmp_path, **options):
            pass


def test_inline_execution_gives_way_to_the_rate_limiter(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "repo"
    for name in ("a", "b"):
        _model(root, name, 'resources [ { name: "R" count: 1 } ]')
        config = root / name / "config.pbtxt"
        config.write_text(config.read_text()
                          + 'parameters { key: "pyserve_inline_execute" value { string_value: "true" } }\n')
    with serve(root, rate_limit="execution_count") as server:
        elapsed = _both_at_once(server.url)
    assert elapsed >= 2 * DELAY_MS / 1000 * 0.95, elapsed  # on instance threads, taking turns
    assert "pyserve_inline_execute is ignored: its instances wait for rate-limiter resources" in caplog.text
