"""pyserve on Ray Serve: a real local Ray cluster of two nodes, ``pyserve ray-deploy``, and
tritonclient over Serve's HTTP and gRPC proxies.

The cluster is two ``ray start`` nodes on this machine with one logical CPU each; the ``echo``
model asks for two replicas of one CPU, so Serve places one on each node, and so takes every
CPU: the ``pipeline`` ensemble over it deploys only because an ensemble reserves none (the
ingress runs it). One replica is killed while requests flow (clients retry, as against any
replicated service), and a sequence-batched model with two replicas keeps each sequence's state
across requests sent on fresh connections, over both protocols. The deployment is made from a
folder holding a ``pyserve/`` folder that is not the package (as the folder above a checkout
does): the workers import the installed package all the same. A repository that needs more
CPUs than the cluster has is refused before anything is deployed, with the numbers.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'pyserve-server[ray]')")
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from suite_support import ACCUMULATE_PY, accumulate_config, echo_config  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from pyserve import protocol as pb  # noqa: E402
from pyserve.testing import write_model  # noqa: E402
from pyserve.tools.ray_serve import RayConfigError, deployment_options  # noqa: E402

BIN = Path(sys.executable).parent

ECHO = echo_config("""
parameters { key: "ray_num_replicas" value { string_value: "2" } }
parameters { key: "ray_num_cpus" value { string_value: "1" } }
""")

ACCUMULATE = accumulate_config("""
parameters { key: "ray_num_replicas" value { string_value: "2" } }
parameters { key: "ray_num_cpus" value { string_value: "0" } }
""")

PIPELINE = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "echo" model_version: -1 input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "MID" } },
  { model_name: "echo" model_version: -1 input_map { key: "INPUT0" value: "MID" } output_map { key: "OUTPUT0" value: "OUT" } }
] }
"""


# Starting two Ray nodes and deploying takes minutes on a loaded machine: the module-scoped
# cluster is set up within the first test's time.
pytestmark = pytest.mark.timeout(900)

# Serve kills a proxy that is not ready within 5 s (its default), which a loaded
# machine exceeds while a worker process starts: the cluster's waits are made generous.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray(*args: str, env: dict[str, str]) -> None:
    subprocess.run([str(BIN / "ray"), *args], check=True, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE, timeout=180)


class Cluster:
    def __init__(self, address: str, http: int, grpc: int, repo: Path, deploy: list[str], cwd: Path) -> None:
        self.address = address
        self.repo = repo
        self.http = f"127.0.0.1:{http}"
        self.grpc = f"127.0.0.1:{grpc}"
        self.deploy = deploy  # the per-model ray-deploy command the cluster started with
        self.cwd = cwd

    def run_deploy(self, command: list[str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command or self.deploy, env=dict(os.environ, **RAY_ENV), capture_output=True,
                              text=True, timeout=300, cwd=self.cwd)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    env = dict(os.environ, **RAY_ENV)
    repo = tmp_path_factory.mktemp("ray") / "repo"
    write_model(repo, "echo", ECHO)
    write_model(repo, "accumulate", ACCUMULATE, {"1/model.py": ACCUMULATE_PY})
    write_model(repo, "pipeline", PIPELINE)
    elsewhere = tmp_path_factory.mktemp("above_a_checkout")  # like the folder holding a clone
    (elsewhere / "pyserve" / "plugins").mkdir(parents=True)  # a namespace package "pyserve" here
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = ["--include-dashboard", "false", "--object-store-memory", str(100 * 1024 * 1024), "--disable-usage-stats"]
    try:
        _ray("start", "--head", "--port", str(port), "--num-cpus", "1", *common, env=env)
        _ray("start", "--address", address, "--num-cpus", "1", "--resources", json.dumps({"second_node": 1}),
             "--object-store-memory", str(100 * 1024 * 1024), "--disable-usage-stats", env=env)
        http, grpc = _free_port(), _free_port()
        command = [str(BIN / "pyserve"), "ray-deploy", "--model-repository", str(repo), "--address", address,
                   "--http-host", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc), "--timeout", "240"]
        started = Cluster(address, http, grpc, repo, command, elsewhere)
        deploy = started.run_deploy()
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr
        assert "RUNNING" in deploy.stdout
        ray.init(address=address, namespace="serve", log_to_driver=False)
        yield started
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


def _replica_actors(deployment: str) -> list[dict[str, str]]:
    """The ALIVE replica actors of a deployment and their nodes (from the GCS actor table;
    the state API would need the dashboard, which the test cluster does not run)."""
    from ray._private import state

    return [
        {"name": a["Name"], "node": a["Address"]["NodeID"]}
        for a in state.actors().values()
        if a.get("State") == "ALIVE" and a.get("Name", "").startswith("SERVE_REPLICA::")
        and f"#{deployment}#" in a["Name"]
    ]


@pytest.fixture
def per_model(cluster: Cluster) -> Cluster:
    """The cluster serving one deployment per model, with two replicas of each (deployed
    again if ``--per-repository`` replaced it, so that no test depends on the order)."""
    if len(_replica_actors("pyserve-echo")) < 2:
        deploy = cluster.run_deploy()
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
                len(_replica_actors("pyserve-echo")) == 2 and len(_replica_actors("pyserve-accumulate")) == 2):
            time.sleep(1)
    return cluster


def _fp32(values: np.ndarray, module: object) -> object:
    tensor = module.InferInput("INPUT0", list(values.shape), "FP32")  # type: ignore[attr-defined]
    tensor.set_data_from_numpy(values)
    return tensor


# -- serving -----------------------------------------------------------------------------------


def test_tritonclient_over_serve_http_and_grpc(cluster: Cluster) -> None:
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    with httpclient.InferenceServerClient(cluster.http) as http:
        assert http.is_server_live() and http.is_server_ready()
        assert http.is_model_ready("echo") and not http.is_model_ready("nope")
        meta = http.get_model_metadata("echo")
        assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, -1]}]
        assert http.get_model_config("echo")["max_batch_size"] == 8
        assert np.array_equal(http.infer("echo", [_fp32(values, httpclient)]).as_numpy("OUTPUT0"), values)
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found"):
            http.infer("nope", [_fp32(values, httpclient)])
        with pytest.raises(InferenceServerException, match="batch-size must be <= 8"):
            http.infer("echo", [_fp32(np.ones((9, 1), dtype=np.float32), httpclient)])
    grpc = grpcclient.InferenceServerClient(cluster.grpc)
    try:
        assert grpc.is_server_live() and grpc.is_server_ready() and grpc.is_model_ready("echo")
        assert grpc.get_model_metadata("echo").name == "echo"
        assert grpc.get_model_config("echo").config.max_batch_size == 8
        assert np.array_equal(grpc.infer("echo", [_fp32(values, grpcclient)]).as_numpy("OUTPUT0"), values)
        with pytest.raises(InferenceServerException) as missing:
            grpc.infer("nope", [_fp32(values, grpcclient)])
        assert missing.value.status() == "StatusCode.NOT_FOUND"
        assert "Request for unknown model: 'nope' is not found" in str(missing.value)
    finally:
        grpc.close()


def test_an_ensemble_runs_in_the_ingress_and_reserves_no_cpu(per_model: Cluster) -> None:
    """Its steps go to the echo deployment; it has no deployment of its own (the cluster's two
    CPUs are echo's)."""
    cluster = per_model
    assert not _replica_actors("pyserve-pipeline")
    values = np.arange(4, dtype=np.float32).reshape(1, 4)
    with httpclient.InferenceServerClient(cluster.http) as http:
        assert http.is_model_ready("pipeline")
        assert http.get_model_metadata("pipeline")["platform"] == "ensemble"
        tensor = httpclient.InferInput("IN", [1, 4], "FP32")
        tensor.set_data_from_numpy(values)
        assert np.array_equal(http.infer("pipeline", [tensor]).as_numpy("OUT"), values)
        wrong = httpclient.InferInput("IN", [1, 4], "INT32")
        wrong.set_data_from_numpy(values.astype(np.int32))
        with pytest.raises(InferenceServerException, match="INT32"):
            http.infer("pipeline", [wrong])
    grpc = grpcclient.InferenceServerClient(cluster.grpc)
    try:
        tensor = grpcclient.InferInput("IN", [1, 4], "FP32")
        tensor.set_data_from_numpy(values)
        assert np.array_equal(grpc.infer("pipeline", [tensor]).as_numpy("OUT"), values)
        assert grpc.get_model_config("pipeline").config.platform == "ensemble"
    finally:
        grpc.close()


def test_a_repository_too_big_for_the_cluster_is_refused_with_the_numbers(cluster: Cluster, tmp_path: Path) -> None:
    """Three models of one CPU and one of three, on two nodes of one CPU: nothing is deployed,
    the command says what is needed, what there is, and how to make it fit."""
    repo = tmp_path / "repo"
    for name in ("a", "b", "c"):
        write_model(repo, name, echo_config().replace('name: "echo"', f'name: "{name}"'))
    write_model(repo, "big", echo_config("instance_group [ { count: 3 kind: KIND_CPU } ]").replace(
        'name: "echo"', 'name: "big"'))
    env = dict(os.environ, **RAY_ENV)
    deploy = subprocess.run(
        [str(BIN / "pyserve"), "ray-deploy", "--model-repository", str(repo), "--address", cluster.address,
         "--name", "too_big", "--http-host", "127.0.0.1", "--timeout", "240"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert deploy.returncode == 1, deploy.stdout + deploy.stderr
    error = deploy.stderr
    assert "the application reserves 6 CPUs (pyserve-a 1, pyserve-b 1, pyserve-big 3, pyserve-c 1) " \
           "but the Ray cluster has 2" in error, error
    assert "a replica of pyserve-big reserves 3 CPUs but the largest Ray node has 1" in error, error
    assert "--per-repository" in error and "--num-cpus 0.5 " in error and "--skip-resource-check" in error, error
    assert "RUNNING" not in deploy.stdout
    assert not _replica_actors("pyserve-big") and not _replica_actors("pyserve-a")  # nothing was deployed


def test_replicas_run_on_both_nodes(per_model: Cluster) -> None:
    replicas = _replica_actors("pyserve-echo")
    assert len(replicas) == 2, replicas
    assert len({r["node"] for r in replicas}) == 2, replicas


def test_a_sequence_stays_on_one_replica(per_model: Cluster) -> None:
    cluster = per_model
    assert len(_replica_actors("pyserve-accumulate")) == 2
    for sequence_id in (101, 202, 303, 404):
        sums = []
        for step in range(6):
            data = np.array([step + 1], dtype=np.int32)
            kwargs = {"sequence_id": sequence_id, "sequence_start": step == 0, "sequence_end": step == 5}
            if step % 2:
                client = grpcclient.InferenceServerClient(cluster.grpc)
                tensor = grpcclient.InferInput("INPUT0", [1], "INT32")
                tensor.set_data_from_numpy(data)
                try:
                    answer = client.infer("accumulate", [tensor], **kwargs)
                finally:
                    client.close()
            else:
                with httpclient.InferenceServerClient(cluster.http) as http:
                    tensor = httpclient.InferInput("INPUT0", [1], "INT32")
                    tensor.set_data_from_numpy(data)
                    answer = http.infer("accumulate", [tensor], **kwargs)
            sums.append(int(answer.as_numpy("OUTPUT0")[0]))
        assert sums == [1, 3, 6, 10, 15, 21], (sequence_id, sums)


def test_requests_keep_succeeding_when_a_replica_is_killed(per_model: Cluster) -> None:
    cluster = per_model
    stop = threading.Event()
    outcomes = {"ok": 0, "retried": 0, "failed": 0}
    values = np.ones((1, 4), dtype=np.float32)

    def load() -> None:
        client = httpclient.InferenceServerClient(cluster.http, connection_timeout=10, network_timeout=30)
        while not stop.is_set():
            for _attempt in range(5):  # a client of a replicated service retries
                try:
                    answer = client.infer("echo", [_fp32(values, httpclient)])
                    assert np.array_equal(answer.as_numpy("OUTPUT0"), values)
                    outcomes["ok"] += 1
                    break
                except Exception:  # noqa: BLE001 - the killed replica's requests fail
                    outcomes["retried"] += 1
                    client.close()
                    client = httpclient.InferenceServerClient(cluster.http, connection_timeout=10, network_timeout=30)
                    time.sleep(0.2)
            else:
                outcomes["failed"] += 1
        client.close()

    threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.5)
        before = outcomes["ok"]
        victim = _replica_actors("pyserve-echo")[0]["name"]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        time.sleep(4)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert outcomes["failed"] == 0, outcomes
    assert outcomes["ok"] > before + 10, outcomes
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # Serve replaces the killed replica
        replicas = _replica_actors("pyserve-echo")
        if len(replicas) == 2 and victim not in {r["name"] for r in replicas}:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"the killed replica was not replaced: {_replica_actors('pyserve-echo')}")


def test_one_deployment_for_the_whole_repository(cluster: Cluster) -> None:
    """``--per-repository`` serves every model from one deployment (it replaces the per-model
    application; the tests that need that one deploy it again, ``per_model``)."""
    deploy = cluster.run_deploy([*cluster.deploy, "--per-repository"])
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (_replica_actors("pyserve-echo") or not _replica_actors("pyserve-repository")):
        time.sleep(1)
    assert len(_replica_actors("pyserve-repository")) == 1 and not _replica_actors("pyserve-echo")
    values = np.ones((1, 3), dtype=np.float32)
    with httpclient.InferenceServerClient(cluster.http) as http:
        assert np.array_equal(http.infer("echo", [_fp32(values, httpclient)]).as_numpy("OUTPUT0"), values)
        tensor = httpclient.InferInput("INPUT0", [1], "INT32")
        tensor.set_data_from_numpy(np.array([5], dtype=np.int32))
        answer = http.infer("accumulate", [tensor], sequence_id=77, sequence_start=True, sequence_end=True)
        assert int(answer.as_numpy("OUTPUT0")[0]) == 5


# -- options and the command line ---------------------------------------------------------------


def _config(text: str) -> pb.ModelConfig:
    return text_format.Parse(text, pb.ModelConfig())


def test_deployment_options_follow_instance_groups_and_parameters() -> None:
    cpu = deployment_options(_config('instance_group [ { count: 3 kind: KIND_CPU } ]'))
    assert cpu["ray_actor_options"] == {"num_cpus": 3.0, "num_gpus": 0.0} and cpu["num_replicas"] == 1
    gpu = deployment_options(_config('instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]'), num_replicas=3)
    assert gpu["ray_actor_options"]["num_gpus"] == 1.0 and gpu["num_replicas"] == 3
    fractional = deployment_options(_config(
        'instance_group [ { kind: KIND_GPU } ] '
        'parameters { key: "ray_num_gpus" value { string_value: "0.5" } } '
        'parameters { key: "ray_min_replicas" value { string_value: "1" } } '
        'parameters { key: "ray_max_replicas" value { string_value: "4" } }'
    ))
    assert fractional["ray_actor_options"]["num_gpus"] == 0.5
    assert fractional["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2.0}
    assert "num_replicas" not in fractional
    with pytest.raises(RayConfigError, match="m/config.pbtxt: parameter 'ray_num_replicas' must be a number"):
        deployment_options(_config('parameters { key: "ray_num_replicas" value { string_value: "two" } }'),
                           "m/config.pbtxt")
    with pytest.raises(RayConfigError, match="below 'ray_min_replicas'"):
        deployment_options(_config(
            'parameters { key: "ray_min_replicas" value { string_value: "3" } } '
            'parameters { key: "ray_max_replicas" value { string_value: "2" } }'))


def test_plans_and_shortfalls_without_ray(tmp_path: Path) -> None:
    """``plan_app`` and ``shortfall`` on their own: ensembles get no deployment, ``--num-cpus``
    sets the default CPUs (not a ``ray_num_cpus`` parameter), ``--per-repository`` reserves one
    CPU per replica, and a cluster short of CPUs or GPUs is told with the numbers."""
    from pyserve.tools.ray_serve import plan_app
    from pyserve.tools.ray_serve.resources import shortfall

    repo = tmp_path / "repo"
    write_model(repo, "echo", echo_config())
    write_model(repo, "accumulate", ACCUMULATE, {"1/model.py": ACCUMULATE_PY})
    write_model(repo, "pipeline", PIPELINE)
    write_model(repo, "gpu", echo_config("instance_group [ { kind: KIND_GPU } ]").replace('name: "echo"', 'name: "gpu"'))
    plan = plan_app([repo], num_cpus=0.25)
    by_name = {d.name: d for d in plan.deployments}
    assert sorted(by_name) == ["pyserve-accumulate", "pyserve-echo", "pyserve-gpu"]
    assert [e.name for e in plan.ensembles] == ["pipeline"] and plan.ensembles[0].versions == (1,)
    assert by_name["pyserve-echo"].cpus == 0.25 and by_name["pyserve-gpu"].gpus == 1.0
    assert by_name["pyserve-accumulate"].cpus == 0.0 and by_name["pyserve-accumulate"].replicas == 2
    assert not by_name["pyserve-accumulate"].cpus_from_default
    assert shortfall(plan, {"CPU": 1.0, "GPU": 1.0}, [{"CPU": 1.0, "GPU": 1.0}], False) == []
    problems = shortfall(plan, {"CPU": 1.0}, [{"CPU": 1.0}], False)
    assert problems[0] == "the application reserves 1 GPUs (pyserve-gpu 1) but the Ray cluster has 0"
    assert problems[1] == "a replica of pyserve-gpu reserves 1 GPUs but the largest Ray node has 0"
    one = plan_app([repo], per_repository=True, num_replicas=3)
    assert [(d.name, d.cpus, d.replicas) for d in one.deployments] == [("pyserve-repository", 1.0, 3)]
    assert one.ensembles == []
    short = shortfall(one, {"CPU": 2.0}, [{"CPU": 1.0}, {"CPU": 1.0}], True)
    assert short[0] == "the application reserves 3 CPUs (pyserve-repository 3 x 1) but the Ray cluster has 2"
    assert "--per-repository" not in short[-1] and "--num-cpus 0.66 " in short[-1]


def test_ray_deploy_refuses_a_bad_repository(tmp_path: Path) -> None:
    write_model(tmp_path / "repo", "m", 'name: "m" backend: "identity" parameters { key: "ray_num_cpus" '
                                        'value { string_value: "lots" } }')
    result = subprocess.run([str(BIN / "pyserve"), "ray-deploy", "--model-repository", str(tmp_path / "repo")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "config.pbtxt: parameter 'ray_num_cpus' must be a number, got 'lots'" in result.stderr
    missing = subprocess.run([str(BIN / "pyserve"), "ray-deploy", "--model-repository", str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "is not a directory" in missing.stderr


def test_no_ray_cluster_is_left_running_by_the_bad_cases() -> None:
    assert shutil.which("ray") or (BIN / "ray").exists()
