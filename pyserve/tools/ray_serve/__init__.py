"""Run pyserve on Ray Serve: the same model repository, KServe v2 over Serve's proxies.

``pyserve ray-deploy --model-repository REPO`` (or a Serve config whose ``import_path`` is
``pyserve.tools.ray_serve:app_builder``) builds one Serve application:

* one deployment per model (``pyserve-<model>``), or one for the whole repository
  (``per_repository``), each replica running pyserve's in-process core
  (``pyserve.tools.ray_serve.replica``) with its dynamic and sequence batchers; ensembles get no
  deployment: the ingress runs them, sending each step to its model's deployment
  (``pyserve.tools.ray_serve.ensembles``), so they reserve no CPU;
* an ingress deployment (``pyserve.tools.ray_serve.ingress``) answering KServe v2 over Serve's HTTP
  proxy and ``inference.GRPCInferenceService`` over Serve's gRPC proxy (started with
  ``add_inference_servicer``), so tritonclient talks to Serve as to Triton.

Deployment options come from each model's ``config.pbtxt``: ``ray_actor_options.num_cpus``
is the number of its CPU instances (``num_cpus``, ``--num-cpus``, sets another default, fractions
allowed), ``num_gpus`` 1 when it has GPU instances; config
``parameters`` override them and add replica settings: ``ray_num_replicas``,
``ray_num_cpus``, ``ray_num_gpus`` (fractions allowed), ``ray_min_replicas`` /
``ray_max_replicas`` / ``ray_target_ongoing_requests`` (autoscaling) and
``ray_max_ongoing_requests``.

Ray is imported only here (``pip install 'pyserve-server[ray]'``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from pyserve import protocol as pb
from pyserve.api.errors import ModelConfigError
from pyserve.repository import model_config
from pyserve.repository.model_config import ENSEMBLE_PLATFORM
from pyserve.repository.scan import select_versions, version_numbers

ROUTER = "pyserve.tools.ray_serve.routing:SequenceAffinityRouter"
"""The request router of model deployments: a sequence's requests stay on one replica."""

DEFAULT_MAX_ONGOING = 64
"""Requests in flight per replica unless ``ray_max_ongoing_requests`` says otherwise: enough for
the dynamic batcher to form batches."""

_INT_PARAMETERS = ("ray_num_replicas", "ray_min_replicas", "ray_max_replicas", "ray_max_ongoing_requests")
_FLOAT_PARAMETERS = ("ray_num_cpus", "ray_num_gpus", "ray_target_ongoing_requests")


class RayConfigError(ValueError):
    """A model's ``ray_*`` parameter is malformed (the message names file and parameter)."""


def _models(repositories: list[Path]) -> dict[str, Any]:
    """Model name → its parsed ``config.pbtxt`` (an empty config when there is none)."""
    found: dict[str, Any] = {}
    for repository in repositories:
        for folder in sorted(p for p in repository.iterdir() if p.is_dir() and not p.name.startswith(".")):
            config = pb.ModelConfig()
            path = folder / "config.pbtxt"
            if path.exists():
                try:
                    text_format.Parse(path.read_text(encoding="utf-8"), config)
                except text_format.ParseError as exc:
                    raise RayConfigError(f"{path}: {exc}") from None
            found.setdefault(folder.name, (config, path))
    return found


def deployment_options(config: Any, path: Path | str = "config.pbtxt", num_replicas: int | None = None,
                       num_cpus: float | None = None) -> dict[str, Any]:
    """Serve deployment options for one model's config (see the module docstring).

    :param num_cpus: CPUs per replica when the config sets no ``ray_num_cpus`` (``--num-cpus``);
        None: the model's CPU instance count (at least 1).
    :raises RayConfigError: a ``ray_*`` parameter that is not a number.
    """
    values = _parameters(config, path)
    cpu_instances = sum(max(g.count, 1) for g in config.instance_group if g.kind in (0, 2))  # AUTO, CPU
    gpu_groups = [g for g in config.instance_group if g.kind == 1]
    default_cpus = num_cpus if num_cpus is not None else float(cpu_instances or 1)
    actor: dict[str, Any] = {
        "num_cpus": values.get("ray_num_cpus", default_cpus),
        "num_gpus": values.get("ray_num_gpus", 1.0 if gpu_groups else 0.0),
    }
    options: dict[str, Any] = {
        "ray_actor_options": actor,
        "max_ongoing_requests": int(values.get("ray_max_ongoing_requests", DEFAULT_MAX_ONGOING)),
    }
    if "ray_min_replicas" in values or "ray_max_replicas" in values:
        low = int(values.get("ray_min_replicas", 1))
        high = int(values.get("ray_max_replicas", max(low, 1)))
        if high < low:
            raise RayConfigError(f"{path}: 'ray_max_replicas' ({high}) is below 'ray_min_replicas' ({low})")
        options["autoscaling_config"] = {
            "min_replicas": low, "max_replicas": high,
            "target_ongoing_requests": values.get("ray_target_ongoing_requests", 2.0),
        }
    else:
        options["num_replicas"] = int(values.get("ray_num_replicas", num_replicas or 1))
    return options


def _parameters(config: Any, path: Path | str) -> dict[str, float]:
    values: dict[str, float] = {}
    for key in _INT_PARAMETERS + _FLOAT_PARAMETERS:
        parameter = config.parameters.get(key)
        if parameter is None:
            continue
        text = parameter.string_value.strip()
        try:
            values[key] = int(text) if key in _INT_PARAMETERS else float(text)
        except ValueError:
            raise RayConfigError(f"{path}: parameter '{key}' must be a number, got '{text}'") from None
        if values[key] < 0:
            raise RayConfigError(f"{path}: parameter '{key}' must not be negative, got '{text}'")
    return values


@dataclass(frozen=True)
class EnsembleSpec:
    """An ensemble the ingress runs, as the driver read it (plain data, sent to the ingress):
    its normalized config, its model directory (for label files; every node reaches the
    repository at the same path) and the versions it serves."""

    name: str
    config: bytes
    folder: str
    versions: tuple[int, ...]


@dataclass(frozen=True)
class DeploymentPlan:
    """One model deployment of the application, before Ray is asked for anything.

    :ivar cpus_from_default: its CPUs per replica come from ``--num-cpus`` or the instance count,
        not from a ``ray_num_cpus`` parameter (``--num-cpus`` changes them).
    """

    name: str
    models: tuple[str, ...]
    options: dict[str, Any]
    cpus_from_default: bool = True

    @property
    def replicas(self) -> int:
        """The replicas Serve starts with (an autoscaling deployment: its minimum)."""
        autoscaling = self.options.get("autoscaling_config")
        if autoscaling is not None:
            return int(autoscaling["min_replicas"])
        return int(self.options.get("num_replicas", 1))

    @property
    def cpus(self) -> float:
        """CPUs one replica reserves."""
        return float(self.options["ray_actor_options"]["num_cpus"])

    @property
    def gpus(self) -> float:
        """GPUs one replica reserves."""
        return float(self.options["ray_actor_options"].get("num_gpus", 0.0))


@dataclass(frozen=True)
class AppPlan:
    """What ``build_app`` deploys: the model deployments and the ensembles the ingress runs."""

    deployments: list[DeploymentPlan]
    ensembles: list[EnsembleSpec]
    settings: dict[str, Any] = field(default_factory=dict)
    """The model deployments' constructor arguments besides ``models``."""


def plan_app(
    repositories: list[str | Path],
    *,
    per_repository: bool = False,
    num_replicas: int | None = None,
    backend_config: dict[str, dict[str, str]] | None = None,
    num_cpus: float | None = None,
) -> AppPlan:
    """The application for a model repository, as plain data (no Ray needed).

    Every model gets a deployment (``pyserve-<model>``) but ensembles, which the ingress runs;
    with ``per_repository``, one deployment (``pyserve-repository``) serves every model,
    ensembles included, reserving ``num_cpus`` (default 1) per replica.

    :param num_cpus: CPUs per model replica where the config sets no ``ray_num_cpus``.
    :raises RayConfigError: a bad config or ``ray_*`` parameter; no model found.
    """
    folders = [Path(r).resolve() for r in repositories]
    for folder in folders:
        if not folder.is_dir():
            raise RayConfigError(f"model repository '{folder}' is not a directory")
    models = _models(folders)
    if not models:
        raise RayConfigError("no models found in " + ", ".join(str(f) for f in folders))
    if num_cpus is not None and num_cpus < 0:
        raise RayConfigError(f"--num-cpus must not be negative, got {num_cpus:g}")
    settings = {"repositories": [str(f) for f in folders], "backend_config": backend_config or {}}
    if per_repository:
        options = {"num_replicas": num_replicas or 1, "max_ongoing_requests": DEFAULT_MAX_ONGOING,
                   "ray_actor_options": {"num_cpus": 1.0 if num_cpus is None else num_cpus}}
        return AppPlan([DeploymentPlan("pyserve-repository", ("*",), options)], [], settings)
    deployments: list[DeploymentPlan] = []
    ensembles: list[EnsembleSpec] = []
    for name, (config, path) in models.items():
        if config.platform == ENSEMBLE_PLATFORM:
            ensembles.append(_ensemble_spec(name, config, path))
            continue
        options = deployment_options(config, path, num_replicas, num_cpus)
        deployments.append(DeploymentPlan(f"pyserve-{name}", (name,), options,
                                          cpus_from_default="ray_num_cpus" not in config.parameters))
    return AppPlan(deployments, ensembles, settings)


def _ensemble_spec(name: str, config: Any, path: Path) -> EnsembleSpec:
    folder = path.parent
    try:
        model_config.normalize(config, folder, None, path)
    except ModelConfigError as exc:
        raise RayConfigError(str(exc)) from None
    problems = model_config.validate(config, folder)
    if problems:
        raise RayConfigError(f"{path}: " + "; ".join(problems))
    selected, problems = select_versions(config.version_policy, version_numbers(folder))
    if not selected:
        raise RayConfigError(f"{path}: " + ("; ".join(problems) or "no version directory (a numeric folder such as '1')"))
    return EnsembleSpec(name, config.SerializeToString(), str(folder), tuple(selected))


def build_app(
    repositories: list[str | Path],
    *,
    per_repository: bool = False,
    num_replicas: int | None = None,
    backend_config: dict[str, dict[str, str]] | None = None,
    num_cpus: float | None = None,
    plan: AppPlan | None = None,
) -> Any:
    """The Serve application (a bound ingress) for a model repository (see ``plan_app``).

    :param plan: an ``AppPlan`` already made (the other arguments are then not read).
    :raises RayConfigError: a bad config or ``ray_*`` parameter; no model found.
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from pyserve.tools.ray_serve.ingress import PyserveIngress
    from pyserve.tools.ray_serve.replica import PyserveModel

    if plan is None:
        plan = plan_app(repositories, per_repository=per_repository, num_replicas=num_replicas,
                        backend_config=backend_config, num_cpus=num_cpus)
    model_deployment = serve.deployment(PyserveModel).options(  # type: ignore[attr-defined]
        request_router_config=RequestRouterConfig(request_router_class=ROUTER),  # type: ignore[arg-type]
    )
    handles: dict[str, Any] = {}
    for deployment in plan.deployments:
        bound = model_deployment.options(name=deployment.name, **deployment.options).bind(
            models=list(deployment.models), **plan.settings)
        if deployment.models == ("*",):
            handles.update({name: bound for name in _models([Path(r) for r in plan.settings["repositories"]])})
        else:
            handles.update({name: bound for name in deployment.models})
    ingress = serve.deployment(PyserveIngress).options(  # type: ignore[attr-defined]
        name="pyserve-ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
    )
    return ingress.bind(handles=handles, ensembles=plan.ensembles)


def app_builder(args: dict[str, Any]) -> Any:
    """For Serve config files: ``import_path: pyserve.tools.ray_serve:app_builder`` with ``args``
    ``model_repository`` (a path or a list), ``per_repository``, ``num_replicas``, ``num_cpus``."""
    repositories = args["model_repository"]
    if isinstance(repositories, str):
        repositories = [repositories]
    num_cpus = args.get("num_cpus")
    return build_app(repositories, per_repository=bool(args.get("per_repository", False)),
                     num_replicas=args.get("num_replicas"), num_cpus=None if num_cpus is None else float(num_cpus))


def add_inference_servicer(servicer: Any, server: Any) -> None:
    """Register ``inference.GRPCInferenceService`` with a gRPC server (Serve's gRPC proxy).

    Pass ``"pyserve.tools.ray_serve:add_inference_servicer"`` in ``grpc_servicer_functions``; Serve
    routes each RPC to the ingress method of the same name.
    """
    from pyserve.frontends.grpc.server import _handlers

    server.add_generic_rpc_handlers((_handlers(pb.SERVICE_DESCRIPTOR, servicer),))


GRPC_SERVICER_FUNCTION = "pyserve.tools.ray_serve:add_inference_servicer"
"""The import path to give Serve's ``grpc_options.grpc_servicer_functions``."""
