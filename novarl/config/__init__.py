"""Configuration: typed schema, loading, overrides, errors."""

from novarl.config.loading import dump_config, load_config
from novarl.config.schema import NovaRLConfig

__all__ = ["NovaRLConfig", "dump_config", "load_config"]
