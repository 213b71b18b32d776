"""A few of each evaluation's samples, written whole to the run folder (NeMo RL's
logger.num_val_samples_to_print): `samples/eval_step_<N>.jsonl`, one line a sample -- its prompt, and
for an episode every turn and every observation as the tokens were (decoded with their special
tokens, so a chat template's markers show), its reward and how it ended."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from novarl.types import Completion


def rendered(completion: Completion, reward: float, tokenizer) -> dict[str, Any]:
    """One sample as a record: the prompt, the parts after it (the model's turns and the
    observations between them), the whole text, the reward and how it ended."""
    def text(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False)

    tokens, parts, start = completion.token_ids, [], 0
    for a, b in [*completion.observed, (len(completion.token_ids), len(completion.token_ids))]:
        if a > start:
            parts.append({"role": "model", "text": text(tokens[start:a])})
        if b > a:
            parts.append({"role": "observation", "text": text(tokens[a:b])})
        start = b
    return {"index": completion.prompt.index, "answer": completion.prompt.answer, "reward": reward,
            "turns": completion.turns, "finish_reason": completion.finish_reason, "failed": completion.failed,
            "prompt": text(completion.prompt.token_ids), "parts": parts,
            "text": text([*completion.prompt.token_ids, *tokens])}


def write_samples(folder: Path, step: int, completions: Sequence[Completion], rewards: Sequence[float],
                  tokenizer, count: int) -> Path | None:
    """The first `count` samples of the evaluation at `step`, to folder/samples/eval_step_<step>.jsonl."""
    if count <= 0 or not completions:
        return None
    path = folder / "samples" / f"eval_step_{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": step, **rendered(c, r, tokenizer)}) for c, r in zip(completions, rewards)]
    path.write_text("\n".join(lines[:count]) + "\n")
    return path
