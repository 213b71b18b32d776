"""Rewards for examples/byo/grpo_byo.yaml: one per sample, one batched (TRL's convention)."""


def correct(completion: str, answer: str, carry: int) -> dict:
    """1 for the right sum. `carry` (a column of the data row) comes because it is named here;
    the dict's other numbers are logged as reward/<function>/<key>, averaged per step."""
    right = float(completion.strip() == answer)
    return {"reward": right, "right_with_carry": right * carry}


def digits_only(completions: list[str], **kwargs) -> list[float]:
    """A format reward over the whole batch: 1 when the completion is digits only."""
    return [float(c.strip().isdigit()) for c in completions]
