"""Pool configuration: the YAML schema of a pool file, drafter and policy classes looked up and their parameters
checked before any model loads, and an ``Engine`` built from a validated pool. Builds on ``metasd.core``,
``metasd.models`` and the plugins (``metasd.drafters``, ``metasd.policies``).

>>> from metasd.config import load_pool
>>> engine = load_pool("my_pool.yaml")      # default: the embedded pool, configs/default.yaml
"""
from .build import (DEFAULT_POOL, ModelCache, build_engine, check_model_references, check_quantization,
                    default_pool_path, default_serve_pool_path, load_pool, make_policy_from_config, parse_pool_config,
                    read_pool_config)
from .files import ConfigError, expand_env_path, format_validation_error, read_yaml_mapping, validate_config
from .plugins import check_param_names, params_model, resolve_drafter_class, resolve_policy_class
from .schema import CostModelConfig, DrafterConfig, PolicyConfig, PoolConfig, VerifierConfig, select_entries

__all__ = [
    "DEFAULT_POOL", "ConfigError", "CostModelConfig", "DrafterConfig", "ModelCache", "PolicyConfig", "PoolConfig",
    "VerifierConfig", "build_engine", "check_model_references", "check_param_names", "check_quantization",
    "default_pool_path", "default_serve_pool_path", "expand_env_path", "format_validation_error", "load_pool",
    "make_policy_from_config",
    "params_model", "parse_pool_config", "read_pool_config", "read_yaml_mapping", "resolve_drafter_class",
    "resolve_policy_class", "select_entries", "validate_config",
]
