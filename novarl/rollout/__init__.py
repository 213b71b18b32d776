"""Rollouts: prompts -> episodes (one turn, or several with an environment between them) -> the
samples a step trains on, every token the engine sampled kept exactly as it was sampled."""
