"""deploy/: the container image recipe and the Kubernetes / KServe manifests.

* every Kubernetes manifest validates against the Kubernetes OpenAPI schemas (kubernetes-validate,
  strict: unknown fields fail); the KServe ones against deploy/kserve/schema/ (a minimal schema of
  the KServe CRD fields we use) plus, for their embedded core/v1 parts, the Kubernetes schemas;
* the manifests agree with each other and with pyserve (ports, probes, CLI args, metric names);
* the Dockerfile has a builder and a slim non-root runtime stage, and its ENTRYPOINT + CMD is
  run here for real: ``pyserve run --model-repository <tmp>`` answers ready and serves an infer.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pyserve.cli.main import build_parser
from pyserve.testing import write_model

# PyYAML comes with kubernetes-validate (the `test` extra).
yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install -e '.[test]')")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"
KSERVE = DEPLOY / "kserve"
KUBERNETES = DEPLOY / "kubernetes"
PORTS = {8000, 8001, 8002}
IMAGE_COMMAND = ["pyserve", "run", "--model-repository", "/mnt/models"]
KUBERNETES_VERSION = "1.30.0"  # the oldest Kubernetes these manifests are meant for


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _one(path: Path) -> dict[str, Any]:
    (doc,) = _documents(path)
    return doc


def _kubernetes_validate() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.skip("kubernetes-validate is not installed (pip install -e '.[test]')")
    return kubernetes_validate


def _validate_k8s(doc: dict[str, Any]) -> None:
    kubernetes_validate = _kubernetes_validate()
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        pytest.fail(f"{doc['kind']} {doc['metadata'].get('name')}: {error.message} at {list(error.path)}")


def _pod_with(containers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": {"containers": containers}}


# ---------------------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("path", sorted(KUBERNETES.glob("*.yaml")), ids=lambda p: p.name)
def test_kubernetes_manifest_is_valid(path: Path) -> None:
    docs = _documents(path)
    assert docs, f"{path.name} holds no manifest"
    for doc in docs:
        _validate_k8s(doc)


@pytest.mark.parametrize(
    ("manifest", "schema"),
    [("cluster-serving-runtime.yaml", "clusterservingruntime.json"), ("inference-service.yaml", "inferenceservice.json")],
)
def test_kserve_manifest_is_valid(manifest: str, schema: str) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (pip install -e '.[test]')")
    doc = _one(KSERVE / manifest)
    validator = jsonschema.Draft202012Validator(json.loads((KSERVE / "schema" / schema).read_text()))
    errors = [f"{e.message} at {list(e.path)}" for e in validator.iter_errors(doc)]
    assert not errors, errors
    # The core/v1 parts KServe embeds, against the real Kubernetes schemas.
    if doc["kind"] == "ClusterServingRuntime":
        _validate_k8s(_pod_with(doc["spec"]["containers"]))
    else:
        model = doc["spec"]["predictor"]["model"]
        _validate_k8s(_pod_with([{"name": "kserve-container", "image": "x", "resources": model["resources"]}]))


def test_kserve_schemas_reject_a_typo() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (pip install -e '.[test]')")
    doc = _one(KSERVE / "cluster-serving-runtime.yaml")
    doc["spec"]["supportedModelFormats"][0]["autoselect"] = True
    schema = json.loads((KSERVE / "schema" / "clusterservingruntime.json").read_text())
    assert not jsonschema.Draft202012Validator(schema).is_valid(doc)


# ------------------------------------------------------------------------------------ consistency


def _run_args(args: list[str]) -> Any:
    return build_parser().parse_args(["run", *args])


def _container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container["ports"]}


def _probe_port(probe: dict[str, Any], ports: dict[str, int]) -> int:
    port = probe["httpGet"]["port"]
    return ports[port] if isinstance(port, str) else port


def test_serving_runtime_matches_pyserve() -> None:
    runtime = _one(KSERVE / "cluster-serving-runtime.yaml")
    assert runtime["metadata"]["name"] == "pyserve"
    assert runtime["spec"]["protocolVersions"] == ["v2", "grpc-v2"]
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"
    args = _run_args(container["args"])  # the args are pyserve run's own flags
    assert args.model_repository == ["/mnt/models"]
    ports = _container_ports(container)
    assert ports["http1"] == args.http_port == 8000
    assert ports["h2c"] == args.grpc_port == 8001
    assert set(ports.values()) == PORTS
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == str(args.metrics_port)
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert _probe_port(container["readinessProbe"], ports) == _probe_port(container["livenessProbe"], ports) == 8000
    _check_startup_probe(container, ports)


def _check_startup_probe(container: dict[str, Any], ports: dict[str, int]) -> None:
    """HTTP answers only once every model loaded: a startup probe holds the liveness probe off
    for minutes (Kubernetes runs liveness only after startup succeeded), so that a repository
    that loads slowly does not restart its pod in a loop."""
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/v2/health/ready" and _probe_port(startup, ports) == 8000
    allowed = startup.get("initialDelaySeconds", 0) + startup.get("periodSeconds", 10) * startup["failureThreshold"]
    liveness = container["livenessProbe"]
    assert allowed >= 300, startup  # minutes, not the liveness probe's seconds
    assert allowed > liveness.get("initialDelaySeconds", 0) + liveness.get("periodSeconds", 10) * liveness["failureThreshold"]


def test_serving_runtime_formats_have_backends() -> None:
    runtime = _one(KSERVE / "cluster-serving-runtime.yaml")
    plugin_of = {"onnx": "onnxruntime", "pytorch": "pytorch", "tensorflow": "tensorflow", "triton": "python"}
    formats = {fmt["name"] for fmt in runtime["spec"]["supportedModelFormats"]}
    assert formats == set(plugin_of)
    for fmt in formats:
        assert (REPO_ROOT / "plugins" / f"pyserve-backend-{plugin_of[fmt]}").is_dir(), fmt


def test_inference_service_uses_the_runtime() -> None:
    service = _one(KSERVE / "inference-service.yaml")
    model = service["spec"]["predictor"]["model"]
    runtime = _one(KSERVE / "cluster-serving-runtime.yaml")
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"] in [
        {"name": f["name"], "version": f["version"]} for f in runtime["spec"]["supportedModelFormats"]
    ]
    assert model["modelFormat"]["name"] == "onnx"


def test_deployment_service_and_hpa_agree() -> None:
    deployment = _one(KUBERNETES / "deployment.yaml")
    service = _one(KUBERNETES / "service.yaml")
    hpa = _one(KUBERNETES / "hpa.yaml")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = _run_args(container["args"])
    assert args.model_repository == ["/mnt/models"]
    ports = _container_ports(container)
    assert set(ports.values()) == PORTS == {args.http_port, args.grpc_port, args.metrics_port}
    assert {p["port"] for p in service["spec"]["ports"]} == PORTS
    for port in service["spec"]["ports"]:
        assert ports[port["targetPort"]] == port["port"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for probe, path in (("readinessProbe", "/v2/health/ready"), ("livenessProbe", "/v2/health/live")):
        assert container[probe]["httpGet"]["path"] == path
        assert _probe_port(container[probe], ports) == 8000
    _check_startup_probe(container, ports)
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "8002"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(args.exit_timeout_secs)


def _adapter_rules() -> list[dict[str, Any]]:
    config = _one(KUBERNETES / "prometheus-adapter-rules.yaml")
    return yaml.safe_load(config["data"]["config.yaml"])["rules"]


def test_hpa_metric_comes_from_the_adapter_rule() -> None:
    hpa = _one(KUBERNETES / "hpa.yaml")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    (rule,) = [r for r in _adapter_rules() if r["name"]["as"] == metric["pods"]["metric"]["name"]]
    assert rule["seriesQuery"].startswith("nv_inference_queue_duration_us{")
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    query = rule["metricsQuery"]
    assert "delta(nv_inference_queue_duration_us{<<.LabelMatchers>>}[30s])" in query
    assert "(1+delta(nv_inference_request_success{<<.LabelMatchers>>}[30s]))" in query
    assert query.count("(") == query.count(")")


# ------------------------------------------------------------------------------------- Dockerfile


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continuation line"
    return result


def _stages() -> list[tuple[str, list[tuple[str, str]]]]:
    stages: list[tuple[str, list[tuple[str, str]]]] = []
    for keyword, rest in _instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest, re.IGNORECASE)
            assert match, f"unnamed stage: FROM {rest}"
            stages.append((match.group(2), []))
        elif stages:
            stages[-1][1].append((keyword, rest))
    return stages


def _last(stage: list[tuple[str, str]], keyword: str) -> str:
    values = [rest for kw, rest in stage if kw == keyword]
    assert values, f"no {keyword} in the stage"
    return values[-1]


def _arg_defaults() -> dict[str, str]:
    defaults = {}
    for keyword, rest in _instructions(DOCKERFILE.read_text()):
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            defaults[name] = value.strip('"')
    return defaults


def test_dockerfile_stages() -> None:
    stages = _stages()
    assert [name for name, _ in stages] == ["builder", "runtime"]
    builder, runtime = stages[0][1], stages[1][1]
    assert any(kw == "RUN" and "pip wheel" in rest for kw, rest in builder)
    assert any(kw == "COPY" and rest.startswith("--from=builder ") for kw, rest in runtime)
    assert not any(kw == "RUN" and "pip install" in rest for kw, rest in runtime), "runtime must stay slim"
    base = [rest for kw, rest in _instructions(DOCKERFILE.read_text()) if kw == "FROM"]
    assert all("-slim" in line for line in base)


def test_dockerfile_runtime_is_non_root_and_exposes_triton_ports() -> None:
    runtime = _stages()[-1][1]
    user = _last(runtime, "USER").split(":")[0]
    assert user not in {"root", "0"}
    assert user.isdigit(), "a numeric UID lets Kubernetes' runAsNonRoot check it"
    exposed = {int(port.split("/")[0]) for kw, rest in runtime if kw == "EXPOSE" for port in rest.split()}
    assert exposed == PORTS


def test_dockerfile_command_line() -> None:
    runtime = _stages()[-1][1]
    entrypoint = json.loads(_last(runtime, "ENTRYPOINT"))
    cmd = json.loads(_last(runtime, "CMD"))
    assert entrypoint + cmd == IMAGE_COMMAND


def test_dockerfile_build_args() -> None:
    defaults = _arg_defaults()
    for backend in defaults["BACKENDS"].split():
        assert (REPO_ROOT / "plugins" / f"pyserve-backend-{backend}").is_dir(), backend
    assert set(defaults["BACKENDS"].split()) >= {"identity", "python", "onnxruntime"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", defaults["TORCH_VERSION"]), "torch must be pinned exactly"
    make = re.search(r"^TORCH_VERSION \?= (\S+)$", (REPO_ROOT / "Makefile").read_text(), re.MULTILINE)
    assert make and make.group(1) == defaults["TORCH_VERSION"], "the image pins the torch `make test` uses"
    assert defaults["ACCELERATOR"] in {"cpu", "gpu"}


def test_dockerignore_keeps_what_the_build_copies() -> None:
    lines = [line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert lines[0] == "*"
    kept = {line[1:] for line in lines if line.startswith("!")}
    builder = _stages()[0][1]
    for keyword, rest in builder:
        if keyword == "COPY" and not rest.startswith("--"):
            *sources, _ = rest.split()
            for source in sources:
                assert source.rstrip("/") in kept, source
                assert (REPO_ROOT / source).exists(), source


# --------------------------------------------------------------- the image's command line, run


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, b""


@pytest.fixture
def image_command_server(tmp_path: Path) -> Iterator[tuple[int, int, int]]:
    repo = tmp_path / "models"
    write_model(repo, "identity_fp32", """
        name: "identity_fp32"
        backend: "identity"
        max_batch_size: 8
        input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
        dynamic_batching { }
        instance_group [ { count: 1 kind: KIND_CPU } ]
    """)
    runtime = _stages()[-1][1]
    command = json.loads(_last(runtime, "ENTRYPOINT")) + json.loads(_last(runtime, "CMD"))
    assert command[0] == "pyserve" and command.count("/mnt/models") == 1
    executable = Path(sys.executable).with_name("pyserve")
    http, grpc, metrics = _free_port(), _free_port(), _free_port()
    argv = [str(executable), *[str(repo) if a == "/mnt/models" else a for a in command[1:]],
            "--host", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1",
            "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    log = tmp_path / "server.log"
    with log.open("w") as stream:
        process = subprocess.Popen(argv, stdout=stream, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "server exited:\n" + log.read_text()
            try:
                if _get(f"http://127.0.0.1:{http}/v2/health/ready")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "not ready after 60 s:\n" + log.read_text()
            time.sleep(0.1)
        yield http, grpc, metrics
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def test_image_command_line_serves(image_command_server: tuple[int, int, int]) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    http, grpc, metrics = image_command_server
    assert _get(f"http://127.0.0.1:{http}/v2/health/ready")[0] == 200
    assert _get(f"http://127.0.0.1:{http}/v2/health/live")[0] == 200
    data = np.arange(6, dtype=np.float32).reshape(2, 3)

    client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
    try:
        inputs = [httpclient.InferInput("INPUT0", list(data.shape), "FP32")]
        inputs[0].set_data_from_numpy(data)
        result = client.infer("identity_fp32", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)
    finally:
        client.close()

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
    try:
        inputs = [grpcclient.InferInput("INPUT0", list(data.shape), "FP32")]
        inputs[0].set_data_from_numpy(data)
        result = client.infer("identity_fp32", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)
    finally:
        client.close()

    # The two series the prometheus-adapter rule (and so the HPA) is computed from.
    status, body = _get(f"http://127.0.0.1:{metrics}/metrics")
    assert status == 200
    text = body.decode()
    for name in ("nv_inference_queue_duration_us", "nv_inference_request_success"):
        assert re.search(rf'^{name}\{{.*model="identity_fp32".*\}} \S+$', text, re.MULTILINE), name
    success = re.search(r'^nv_inference_request_success\{.*model="identity_fp32".*\} (\S+)$', text, re.MULTILINE)
    assert success and float(success.group(1)) == 2


def test_image_gets_grpcio_from_the_core() -> None:
    """pyserve.frontends.grpc imports grpc: the core's dependencies name grpcio, so the image needs no
    extra requirement for it (and its comments do not say otherwise)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")

    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"grpcio\b", dep) for dep in dependencies), dependencies
    recipe = DOCKERFILE.read_text()
    assert "GRPCIO" not in recipe and "do not name grpcio" not in recipe
