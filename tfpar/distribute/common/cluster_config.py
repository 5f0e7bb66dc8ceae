"""The cluster a strategy runs on, as tfpar's plain ClusterConfig."""

from tfpar.cluster.tf_config import ClusterConfig, parse_tf_config


def cluster_config(cluster_resolver=None):
    """The validated ClusterConfig of `cluster_resolver`, or of TF_CONFIG when None.

    Returns None when there is no cluster (one process).
    """
    if cluster_resolver is None:
        return parse_tf_config()
    spec = cluster_resolver.cluster_spec().as_dict()
    if not spec:
        return None
    cluster = {job: tuple(tasks.values()) if isinstance(tasks, dict) else tuple(tasks)
               for job, tasks in spec.items()}
    return ClusterConfig(cluster, cluster_resolver.task_type, cluster_resolver.task_id)
