"""The bundled math-style task: word problems from templates, answers in \\boxed{} checked by
math-verify, on the bundled tiny-math model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from novarl.config import load_config
from novarl.data.word_problems import word_problem_examples
from novarl.models.bundled import resolve_bundled

RECIPE = Path(__file__).parents[1] / "examples" / "configs" / "grpo_tiny_math.yaml"


def test_word_problems_are_fixed_disjoint_and_right():
    train, validation = word_problem_examples("train"), word_problem_examples("validation")
    assert (len(train), len(validation)) == (7000, 1000)
    assert word_problem_examples("train") == train  # the same every time
    assert not {e.prompt for e in train} & {e.prompt for e in validation}
    for ex in train[:500] + validation:
        a, b = map(int, re.findall(r"\d+", ex.prompt))
        adds = "more" in ex.prompt
        assert int(ex.answer) == (a + b if adds else a - b) >= 0
        assert ex.prompt.endswith("Put the answer in \\boxed{}.")
    with pytest.raises(ValueError):
        word_problem_examples("test")


def test_the_bundled_math_recipe_trains_with_math_verify(tmp_path):
    pytest.importorskip("math_verify")
    from novarl.logging.metrics import read_jsonl
    from novarl.trainer.api import GRPOTrainer

    assert resolve_bundled("tiny-math") is not None and (resolve_bundled("tiny-math") / "config.json").is_file()
    cfg = load_config(RECIPE, overrides=["grpo.max_num_steps=2", "grpo.max_val_samples=32", "grpo.val_batch_size=32",
                                         "policy.generation.backend=hf", "logger.progress_bar=false",
                                         f"logger.log_dir={tmp_path}"])
    result = GRPOTrainer(cfg).train()
    train = [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert len(train) == 2 and train[0]["reward_mean"] > 0  # the weak start is right sometimes: RL has signal
    assert result.initial_accuracy is not None and result.initial_accuracy > 0
