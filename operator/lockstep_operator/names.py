"""What a LockstepDeployment's objects are called, labelled and reached by: names every builder, handler and test
shares (the object names are pinned in DESIGN.md)."""

from __future__ import annotations

from lockstep_operator.crd import GROUP

RANK_GRPC_PORT = 50051
RANK_STORE_PORT = 29500
RANK_HEALTH_PORT = 50052  # plaintext grpc.health.v1 only, for the probes, when the gRPC port speaks TLS
MODEL_MOUNT = "/models"
CACHE_MOUNT = "/cache"
GROUP_TOKEN_KEY = "token"
GROUP_TOKEN_VOLUME = "group-token"
GROUP_TOKEN_MOUNT = "/var/run/lockstep/group-token"
TLS_VOLUME = "rank-tls"
GROUPS_KEY = "groups"
GROUPS_VOLUME = "groups"
# A directory mount (never subPath, which the kubelet does not update): the file changes in place.
GROUPS_MOUNT = "/etc/lockstep/groups"
TLS_MOUNT = "/var/run/lockstep/tls"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_GROUP = f"{GROUP}/group"
# On a group's StatefulSet, Service and NetworkPolicy (not its pods: the label would change the template
# hash and roll every group): which group this is, so the operator never parses it out of a name.
LABEL_GROUP_INDEX = f"{GROUP}/group-index"
ANNOTATION_HASH = f"{GROUP}/template-hash"


def group_name(name: str, index: int) -> str:
    """StatefulSet and headless Service of group `index` (pinned in DESIGN.md)."""
    return f"{name}-g{index}"


def coordinator_name(name: str) -> str:
    return f"{name}-coordinator"


def group_token_secret_name(name: str) -> str:
    """The Secret holding the group token that the deployment's ranks and coordinator share."""
    return f"{name}-group-token"


def selector(name: str, component: str, group: str | None = None) -> dict[str, str]:
    labels = {LABEL_NAME: "lockstep", LABEL_INSTANCE: name, LABEL_COMPONENT: component}
    if group is not None:
        labels[LABEL_GROUP] = group
    return labels


def labels(name: str, component: str, group: str | None = None) -> dict[str, str]:
    return selector(name, component, group) | {LABEL_MANAGED_BY: "lockstep-operator"}


def group_labels(name: str, index: int) -> dict[str, str]:
    """Labels of a group's StatefulSet, Service and NetworkPolicy; they carry the group's index."""
    return labels(name, "rank", group_name(name, index)) | {LABEL_GROUP_INDEX: str(index)}


def rank_selector_string(name: str) -> str:
    """The label selector of every rank pod of a deployment (the scale subresource's selector)."""
    return ",".join(f"{k}={v}" for k, v in selector(name, "rank").items())


def rank_host(name: str, namespace: str, index: int, rank: int, cluster_domain: str) -> str:
    """The stable DNS name of one rank pod, through its group's headless Service."""
    g = group_name(name, index)
    return f"{g}-{rank}.{g}.{namespace}.svc.{cluster_domain}"


def groups_configmap_name(name: str) -> str:
    """The ConfigMap holding the coordinator's group list."""
    return f"{name}-groups"
