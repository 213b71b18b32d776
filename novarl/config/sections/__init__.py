"""Config sections, by subject; novarl.config.schema puts them together (and re-exports them)."""
