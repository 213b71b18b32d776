"""NeMo RL's named math datasets, by the names its configs use (`data.dataset_name:
OpenMathInstruct-2`): each a hub dataset with fixed fields, as NeMo RL's
`nemo_rl/data/datasets/response_datasets/` classes read it (contract: NeMo RL 7ea279a). Names the
config accepts, as BUNDLED_TASKS are; data/named.py reads them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NamedDataset:
    repo_id: str
    input_key: str
    """Dotted path to the prompt (`prompt.0.content`: the first message's text)."""
    output_key: str
    split: str = "train"
    subsets: tuple[str | None, ...] = (None,)
    """Subsets read one after the other (AIME 2025 is two)."""
    answer_after: str | None = None
    """The answer is the text after this marker (GSM8K's '#### 42')."""


NAMED_DATASETS = {
    "OpenMathInstruct-2": NamedDataset("nvidia/OpenMathInstruct-2", "problem", "expected_answer", split="train_1M"),
    "DAPOMath17K": NamedDataset("BytedTsinghua-SIA/DAPO-Math-17k", "prompt.0.content", "reward_model.ground_truth"),
    "DAPOMathAIME2024": NamedDataset("BytedTsinghua-SIA/AIME-2024", "prompt.0.content", "reward_model.ground_truth"),
    "DeepScaler": NamedDataset("agentica-org/DeepScaleR-Preview-Dataset", "problem", "answer"),
    "AIME2024": NamedDataset("HuggingFaceH4/aime_2024", "problem", "answer"),
    "AIME2025": NamedDataset("opencompass/AIME2025", "question", "answer", split="test",
                             subsets=("AIME2025-I", "AIME2025-II")),
    "AIME2026": NamedDataset("MathArena/aime_2026", "problem", "answer"),
    "GSM8K": NamedDataset("openai/gsm8k", "question", "answer", subsets=("main",), answer_after="####"),
    "gsm8k": NamedDataset("openai/gsm8k", "question", "answer", subsets=("main",), answer_after="####"),
}
