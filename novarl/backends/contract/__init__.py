"""The run's contract: which backends a config runs on, what they need, the batch arithmetic, the
model's shape and every check made before a run starts (no torch, no weights)."""
