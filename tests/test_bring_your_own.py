"""A user's own model, data and rewards, end to end: a tiny Qwen2 folder built from a config with
a ChatML tokenizer, a `datasets` folder of chat prompts with nested answers and an extra column,
and math-verify plus a batched reward of the user's, weighted."""

from __future__ import annotations

import json

import pytest

from novarl.cli import main
from novarl.config import load_config
from novarl.logging.metrics import read_jsonl
from novarl.trainer.setup import preflight
from tests.helpers.tiny_chatml import build_tiny_chatml_qwen2

pytest.importorskip("math_verify")
pytestmark = pytest.mark.slow

REWARDS = '''
def short(completions, level, **kwargs):
    """Batched (TRL's convention): shorter completions score higher on easy rows."""
    return [1.0 / (1 + len(c)) if lv == 0 else 0.0 for c, lv in zip(completions, level)]
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    import datasets

    work = tmp_path_factory.mktemp("byo")
    build_tiny_chatml_qwen2(work / "my_model")
    rows = [{"prompt": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": f"What is {a}+{b}? Put the answer in \\boxed{{}}."}],
             "reward_model": {"ground_truth": str(a + b)}, "level": (a + b) % 2} for a in range(8) for b in range(4)]
    whole = datasets.Dataset.from_list(rows)
    datasets.DatasetDict({"train": whole.select(range(24)), "test": whole.select(range(24, 32))}).save_to_disk(
        str(work / "my_data"))
    (work / "rewards.py").write_text(REWARDS)
    return work


def config(work, *extra: str) -> list[str]:
    return [f"policy.model_name={work / 'my_model'}", "policy.max_total_sequence_length=96",
            "policy.precision=float32", "policy.generation.backend=hf", "policy.generation.max_new_tokens=8",
            "policy.train_micro_batch_size=16", "policy.logprob_batch_size=16", "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2", "grpo.val_period=2",
            "grpo.max_val_samples=8", "grpo.val_batch_size=8", f"data.train_data_path={work / 'my_data'}",
            "data.output_key=reward_model.ground_truth", f"logger.log_dir={work / 'logs'}", "logger.progress_bar=false",
            "checkpointing.enabled=false",
            f"reward.function=[math_verify, {work / 'rewards.py'}:short]", "reward.weights=[1.0, 0.5]", *extra]


def test_chat_prompts_render_with_the_models_chatml_template(workdir):
    cfg = load_config({}, overrides=config(workdir))
    inputs = preflight(cfg)
    first = inputs.sampler.prompts[0]
    assert first.text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is ")
    assert first.text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert first.columns["level"] in (0, 1) and first.answer.isdigit()
    assert len(inputs.sampler.prompts) == 24 and inputs.val_source == "held-out" and len(inputs.val_prompts) == 8


def test_a_run_on_your_own_model_data_and_rewards(workdir, capsys):
    assert main(["train", *config(workdir)]) == 0, capsys.readouterr().err
    run = workdir / "logs" / "exp_001"
    train = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert len(train) == 2 and {"reward/math_verify", "reward/short"} <= train[-1].keys()
    assert json.loads((run / "policy" / "config.json").read_text())["model_type"] == "qwen2"
    assert (run / "policy" / "chat_template.jinja").is_file() or \
        "chat_template" in json.loads((run / "policy" / "tokenizer_config.json").read_text())
