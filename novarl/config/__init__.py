"""Configuration: typed schema, loading, overrides, errors."""

from novarl.config.loading import BUNDLED_RECIPE, dump_config, load_config
from novarl.config.schema import NovaRLConfig

__all__ = ["BUNDLED_RECIPE", "NovaRLConfig", "dump_config", "load_config"]
