"""Does the Ray cluster have what the application's deployments reserve? Checked before
deploying: Serve itself waits without a word for resources that never come.

``shortfall`` compares an ``AppPlan`` with the cluster's resources (``ray.cluster_resources()``
and the nodes' ``Resources``) and returns what does not fit, with the numbers and the ways to
make it fit; pure functions, no Ray needed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from pyserve.tools.ray_serve import AppPlan, DeploymentPlan


def _number(value: float) -> str:
    return f"{value:g}"


def _needs(deployments: Sequence[DeploymentPlan], resource: str) -> tuple[float, list[str]]:
    total = 0.0
    parts = []
    for deployment in deployments:
        each = deployment.cpus if resource == "CPU" else deployment.gpus
        if each <= 0 or deployment.replicas <= 0:
            continue
        total += each * deployment.replicas
        count = f"{deployment.replicas} x " if deployment.replicas > 1 else ""
        parts.append(f"{deployment.name} {count}{_number(each)}")
    return total, parts


def _fitting_cpus(plan: AppPlan, cpus: float) -> float | None:
    """The ``--num-cpus`` at which the deployments would fit in ``cpus`` (two decimals, rounded
    down), or None when no positive value would."""
    fixed = sum(d.cpus * d.replicas for d in plan.deployments if not d.cpus_from_default)
    replicas = sum(d.replicas for d in plan.deployments if d.cpus_from_default)
    if replicas == 0 or cpus - fixed <= 0:
        return None
    fit = math.floor((cpus - fixed) / replicas * 100) / 100
    return fit if fit > 0 else None


def shortfall(plan: AppPlan, cluster: Mapping[str, float], nodes: Sequence[Mapping[str, float]],
              per_repository: bool) -> list[str]:
    """What of ``plan`` the cluster cannot hold, one problem per line (empty: it fits).

    :param cluster: the cluster's total resources (``ray.cluster_resources()``).
    :param nodes: each live node's total resources.
    :param per_repository: the plan is already one deployment for every model.
    """
    problems: list[str] = []
    for resource, label in (("CPU", "CPUs"), ("GPU", "GPUs")):
        have = float(cluster.get(resource, 0.0))
        need, parts = _needs(plan.deployments, resource)
        if need > have + 1e-9:
            problems.append(f"the application reserves {_number(need)} {label} ({', '.join(parts)}) "
                            f"but the Ray cluster has {_number(have)}")
        largest = max((float(node.get(resource, 0.0)) for node in nodes), default=0.0)
        for deployment in plan.deployments:
            each = deployment.cpus if resource == "CPU" else deployment.gpus
            if each > largest + 1e-9:
                problems.append(f"a replica of {deployment.name} reserves {_number(each)} {label} but the largest "
                                f"Ray node has {_number(largest)}")
    if not problems:
        return []
    fixes = []
    if not per_repository and len(plan.deployments) > 1:
        fixes.append("--per-repository (one deployment serving every model, 1 CPU per replica)")
    fit = _fitting_cpus(plan, float(cluster.get("CPU", 0.0)))
    if fit is not None:
        fixes.append(f"--num-cpus {_number(fit)} (CPUs each model replica reserves where its config sets no "
                     "ray_num_cpus; fractions are fine)")
    fixes.append("ray_num_cpus / ray_num_gpus / ray_num_replicas parameters in the models' configs")
    fixes.append("more Ray nodes, or --skip-resource-check when the cluster adds nodes on demand")
    return [*problems, "to make it fit: " + "; ".join(fixes)]
