"""Clusters: TF_CONFIG parsing (pure), servers and the local launcher."""

from tfpar.cluster.tf_config import ClusterConfig, TFConfigError, parse_tf_config

__all__ = ["ClusterConfig", "TFConfigError", "parse_tf_config"]
