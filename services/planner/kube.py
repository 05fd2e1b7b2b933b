"""A Deployment's replicas through its scale subresource, on the official `kubernetes` client.
The planner's Role allows get and patch on deployments/scale and nothing else."""
from __future__ import annotations

import os

from kubernetes import client, config


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

    def replicas(self, namespace: str, deployment: str) -> int:
        scale = self.api.read_namespaced_deployment_scale(deployment, namespace, _request_timeout=self.timeout_s)
        return int(scale.spec.replicas or 0)

    def set_replicas(self, namespace: str, deployment: str, replicas: int) -> None:
        self.api.patch_namespaced_deployment_scale(deployment, namespace, {"spec": {"replicas": replicas}},
                                                   _content_type="application/merge-patch+json",
                                                   _request_timeout=self.timeout_s)
