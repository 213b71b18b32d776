"""Environments novarl ships (NeMo RL's names in `env.<name>`: config/sections/data.py BUILT_IN_ENVIRONMENTS)."""
