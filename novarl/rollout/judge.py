"""An LLM judge's reward (the registered reward ``llm_judge``; ROLL's LLMJudgeRewardWorker).

A generation engine of its own -- Hugging Face (`reward.judge.backend: hf`) or vLLM (`vllm`),
never the policy's engines -- reads each completion in a prompt template and answers; a parser
turns the answer into the reward:
- ``yes_no`` (ROLL's judge prompts): 1 when the answer says yes, 0 when it says no (the first of
  the two words in it, case aside);
- ``score`` (a 0-10 grade, "Score: 7"): the number / 10.
An answer the parser cannot read scores 0 and is counted (reward/llm_judge/unparsable).

The templates (reward.judge.prompt) are novarl's own: ``yes_no`` asks whether the solution's final
answer matches the reference (ROLL's Qwen2.5-7B-Instruct-RLVR-prompt asks the same), ``score``
grades the response; any other text is a template of its own with {question}, {response} and
{reference}. The prompt is the user's turn in the judge's chat template (its text, without one).

The judge runs in the driver's process (its first GPU, else the CPU), or with reward.judge.resources
in a Ray actor on devices of its own, counted apart from the policy's (rollout/reward_host.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from novarl.errors import UserError
from novarl.types import Prompt, SamplingConfig

TEMPLATES = {
    "yes_no": ("You are checking a solution against a reference answer.\n\n"
               "Question:\n{question}\n\nSolution (its final step):\n{response}\n\nReference answer:\n{reference}\n\n"
               "Does the final answer of the solution match the reference answer? If the solution gives no clear "
               "final answer, it does not. Answer with YES or NO only."),
    "score": ("Grade the response to the question on a scale from 0 to 10 for correctness and helpfulness.\n\n"
              "Question:\n{question}\n\nResponse:\n{response}\n\nReference (may be empty):\n{reference}\n\n"
              "End your answer with a line 'Score: <0-10>'."),
}
PARSERS = ("yes_no", "score")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_SCORE = re.compile(r"score\s*:\s*([0-9]+(?:\.[0-9]+)?)", re.IGNORECASE)


def parse_answer(text: str, parser: str) -> float | None:
    """The reward an answer gives, or None when the parser cannot read it."""
    if parser == "yes_no":
        found = _YES_NO.search(text)
        return None if found is None else float(found.group(1).lower() == "yes")
    found = _SCORE.search(text)
    if found is None:
        return None
    return min(max(float(found.group(1)), 0.0), 10.0) / 10


def judge_prompt(template: str, question: str, response: str, reference: str | None) -> str:
    text = TEMPLATES.get(template, template)
    try:
        return text.format(question=question, response=response, reference=reference or "")
    except (KeyError, IndexError, ValueError) as err:
        raise UserError(f"reward.judge.prompt: a template takes {{question}}, {{response}} and {{reference}} only "
                        f"(other braces doubled); it failed on {err!r}.") from None


class LLMJudge:
    loads_model = True
    """Its engine starts at its first call, not when the run's checks build it (they load no weights)."""

    def __init__(self, block: Any) -> None:
        if block is None or not block.model_name:
            raise UserError("reward.function 'llm_judge' asks reward.judge.model_name, which is not set: name the "
                            "judge's model (a folder or hub id).")
        from novarl.models.locate import resolve_model_path

        resolve_model_path(block.model_name, download=False, key="reward.judge.model_name")  # named wrong?
        self.block = block
        self.__name__ = "llm_judge"
        self._started: tuple[Any, Any] | None = None

    @property
    def engine(self) -> Any:
        return self._start()[0]

    @property
    def tokenizer(self) -> Any:
        return self._start()[1]

    def _start(self) -> tuple[Any, Any]:
        if self._started is None:
            self._started = self._engine(self.block)
        return self._started

    @staticmethod
    def _engine(block: Any) -> tuple[Any, Any]:
        import torch

        from novarl.backends.registry import generation_spec
        from novarl.models.loading import load_tokenizer
        from novarl.models.locate import resolve_model_path

        path = resolve_model_path(block.model_name)
        tokenizer = load_tokenizer(path, trust_remote_code=block.trust_remote_code)
        precision = block.precision if torch.cuda.is_available() else "float32"
        engine = generation_spec(block.backend).standalone_engine(
            path, tokenizer, precision=precision, max_seq_length=block.max_model_len, batch_size=block.batch_size,
            trust_remote_code=block.trust_remote_code)
        return engine, tokenizer

    def prompts(self, questions: Sequence[str], responses: Sequence[str], references: Sequence[str | None]
                ) -> list[Prompt]:
        out = []
        for question, response, reference in zip(questions, responses, references):
            text = judge_prompt(self.block.prompt, question, response.rpartition("</think>")[2], reference)
            if getattr(self.tokenizer, "chat_template", None):
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                          add_generation_prompt=True)
            out.append(Prompt(text, self.tokenizer(text, add_special_tokens=False)["input_ids"]))
        return out

    def answers(self, prompts: Sequence[Prompt]) -> list[str]:
        block = self.block
        sampling = SamplingConfig(max_new_tokens=block.max_new_tokens, temperature=block.temperature,
                                  top_p=block.top_p, top_k=block.top_k, seed=block.seed)
        return [c.text for c in self.engine.generate(list(prompts), sampling)]

    def __call__(self, completions: Sequence[str], prompts: Sequence[str] = (), sources: Sequence[Any] = (),
                 answers: Sequence[str | None] = (), **_: Any) -> list[dict[str, float]]:
        questions = [_question(s, p) for s, p in zip(list(sources) or [None] * len(completions),
                                                     list(prompts) or [""] * len(completions))]
        said = self.answers(self.prompts(questions, completions, list(answers) or [None] * len(completions)))
        out = []
        for text in said:
            value = parse_answer(text, self.block.parser)
            out.append({"reward": 0.0 if value is None else value, "unparsable": float(value is None)})
        return out


def _question(source: Any, prompt: str) -> str:
    """The question as the data gave it: the last user turn of chat messages, or the text."""
    if isinstance(source, (list, tuple)):
        users = [m.get("content", "") for m in source if isinstance(m, Mapping) and m.get("role") == "user"]
        return str(users[-1]) if users else prompt
    return str(source) if source is not None else prompt


def llm_judge(settings: Any = None) -> LLMJudge:
    """The registered reward ``llm_judge`` (reward.judge's model)."""
    return LLMJudge(getattr(settings, "judge", None))
