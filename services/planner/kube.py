"""A pool's replicas through its workload's scale subresource, on the official `kubernetes` client:
`deployments/{name}/scale` for a Deployment pool, `statefulsets/{name}/scale` for a StatefulSet
pool (a persistent disk KV tier). The planner's Role allows get and patch on those and nothing else."""
from __future__ import annotations

import os
from typing import NamedTuple

from kubernetes import client, config

KINDS = ("deployment", "statefulset")


class Workload(NamedTuple):
    kind: str     # one of KINDS
    name: str

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"      # as kubectl names it


def apps_api(kubeconfig: str, timeout_s: float) -> "ScaleClient":
    """In a pod (KUBERNETES_SERVICE_HOST set) its ServiceAccount, else the kubeconfig file."""
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig)
    elif "KUBERNETES_SERVICE_HOST" in os.environ:
        config.load_incluster_config()
    else:
        config.load_kube_config()
    return ScaleClient(client.AppsV1Api(), timeout_s)


class ScaleClient:
    def __init__(self, api: client.AppsV1Api, timeout_s: float) -> None:
        self.api = api
        self.timeout_s = timeout_s
        self.read = {"deployment": api.read_namespaced_deployment_scale,
                     "statefulset": api.read_namespaced_stateful_set_scale}
        self.patch = {"deployment": api.patch_namespaced_deployment_scale,
                      "statefulset": api.patch_namespaced_stateful_set_scale}

    def replicas(self, namespace: str, workload: Workload) -> int:
        scale = self.read[workload.kind](workload.name, namespace, _request_timeout=self.timeout_s)
        return int(scale.spec.replicas or 0)

    def set_replicas(self, namespace: str, workload: Workload, replicas: int) -> None:
        self.patch[workload.kind](workload.name, namespace, {"spec": {"replicas": replicas}},
                                  _content_type="application/merge-patch+json",
                                  _request_timeout=self.timeout_s)
