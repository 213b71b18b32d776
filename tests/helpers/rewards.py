"""Reward functions for tests whose model is random (exact match would score 0 everywhere)."""


def digit_fraction(completion: str, answer: str) -> float:
    """The share of the completion's characters that are digits: varies across samples of a
    random model, so GRPO's advantages are not all zero."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def constant(completion: str, answer: str) -> float:
    """The same reward for every completion: no GRPO group ever carries a signal."""
    return 1.0


def recording(completion: str, answer: str, prompt: str) -> float:
    """Exact match, and a line "<process id>\\t<prompt>" appended to the file $NOVARL_TEST_RECORD for
    every completion scored: which prompts a run trained on, in order, by process."""
    import os

    with open(os.environ["NOVARL_TEST_RECORD"], "a") as out:
        out.write(f"{os.getpid()}\t{prompt}\n")
    return float(completion.strip() == answer.strip())
