"""The reward model's reward (the registered reward ``reward_model``; NeMo RL's env.reward_model).

A sequence-classification model with one output (a Bradley-Terry reward model, as NeMo RL takes
them) scores each conversation: the example's prompt (its chat messages, or its text as the
user's turn), then the completion as the assistant's turn, rendered with the reward model's own
tokenizer's chat template (without one, the turns' texts joined). The reward is the score as it
comes, in float32 (NeMo RL's: no sigmoid). Scored reward.reward_model.batch_size at a time, each
at its last token (padding never mistaken for it); with max_model_len, a longer conversation
keeps its end.

It runs in the driver's process (its first GPU, else the CPU), or with reward.reward_model.resources
(NeMo RL's env.reward_model.resources) in a Ray actor on devices of its own, counted apart from the
policy's (rollout/reward_host.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from novarl.errors import UserError


class RewardModel:
    loads_model = True
    """Its weights load at its first call, not when the run's checks build it (they load no weights)."""

    def __init__(self, block: Any, device: torch.device | None = None) -> None:
        if block is None or not block.model_name:
            raise UserError("reward.function 'reward_model' scores with reward.reward_model.model_name, which is "
                            "not set: name a sequence-classification model (a folder or hub id).")
        from novarl.models.locate import resolve_model_path

        resolve_model_path(block.model_name, download=False, key="reward.reward_model.model_name")  # named wrong?
        self.block = block
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model: Any = None
        self.__name__ = "reward_model"

    def load(self) -> None:
        from transformers import AutoModelForSequenceClassification

        from novarl.models.loading import DTYPES, load_tokenizer
        from novarl.models.locate import resolve_model_path

        block = self.block
        dtype = DTYPES[block.precision] if self.device.type == "cuda" else torch.float32
        source = resolve_model_path(block.model_name)
        self.tokenizer = load_tokenizer(block.tokenizer_name or block.model_name,
                                        trust_remote_code=block.trust_remote_code)
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                source, dtype=dtype, use_safetensors=True, trust_remote_code=block.trust_remote_code)
        except Exception as err:  # transformers raises many types for a folder it cannot read
            raise UserError(f"reward.reward_model.model_name='{block.model_name}': cannot load it as a "
                            f"sequence-classification model: {type(err).__name__}: {' '.join(str(err).split())[:300]}"
                            ) from None
        if model.config.num_labels != 1:
            raise UserError(f"reward.reward_model.model_name='{block.model_name}' has {model.config.num_labels} "
                            "outputs; a reward model (Bradley-Terry) has one.")
        self.model = model.to(self.device).eval()

    def conversation(self, source: Any, completion: str) -> str:
        """The text the model scores: the prompt's turns and the completion's, in its chat template."""
        if isinstance(source, (list, tuple)) and all(isinstance(m, Mapping) for m in source):
            turns = [{"role": m["role"], "content": m["content"]} for m in source]
        else:
            turns = [{"role": "user", "content": str(source)}]
        turns.append({"role": "assistant", "content": completion})
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(turns, tokenize=False)
        return "\n".join(t["content"] for t in turns)

    @torch.no_grad()
    def scores(self, texts: Sequence[str]) -> list[float]:
        if self.model is None:
            self.load()
        out: list[float] = []
        size = self.block.batch_size
        for start in range(0, len(texts), size):
            out.extend(self._batch(texts[start:start + size]))
        return out

    def _batch(self, texts: Sequence[str]) -> list[float]:
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        limit = self.block.max_model_len
        ids = [seq[-limit:] if limit else seq for seq in ids]
        width = max(len(seq) for seq in ids)
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.tensor([seq + [pad] * (width - len(seq)) for seq in ids], device=self.device)
        mask = torch.tensor([[1] * len(seq) + [0] * (width - len(seq)) for seq in ids], device=self.device)
        head = getattr(self.model, "score", None)
        last = torch.tensor([len(seq) - 1 for seq in ids], device=self.device)
        if head is None:  # an architecture with another head: one conversation at a time, unpadded
            return [float(self.model(input_ids=row[:n + 1].unsqueeze(0)).logits[0, 0])
                    for row, n in zip(input_ids, last.tolist())]
        hidden = self.model.base_model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        picked = hidden[torch.arange(len(ids), device=self.device), last]
        return head(picked)[:, 0].float().tolist()

    def __call__(self, completions: Sequence[str], prompts: Sequence[str] = (), sources: Sequence[Any] = (),
                 **_: Any) -> list[float]:
        if self.model is None:
            self.load()
        sources = list(sources) or [None] * len(completions)
        prompts = list(prompts) or [""] * len(completions)
        return self.scores([self.conversation(source if source is not None else prompt, completion)
                            for source, prompt, completion in zip(sources, prompts, completions)])


def reward_model(settings: Any = None) -> RewardModel:
    """The registered reward ``reward_model`` (reward.reward_model's model)."""
    return RewardModel(getattr(settings, "reward_model", None))
