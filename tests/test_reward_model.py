"""The reward model's reward (novarl/rewards/reward_model.py; NeMo RL's env.reward_model): a tiny
Bradley-Terry model built here scores conversations as a direct call of the same model does, in
batches with padding and with max_model_len; NeMo RL's grpo_rm_1B.yaml loads as written and, scaled
to the bundled tiny model, trains with the tiny reward model on CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from novarl.config import load_config
from novarl.config.sections.data import RewardConfig
from novarl.errors import UserError
from novarl.models.bundled import BUNDLED_MODELS
from novarl.rewards.scorer import RewardScorer
from novarl.types import Completion, Prompt

RM_RECIPE = Path(__file__).parent / "data" / "nemo_rl" / "2026-08" / "grpo_rm_1B.yaml"


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory) -> Path:
    """A random-initialised Llama sequence classifier (one output) with tiny-arith's tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    source = Path(BUNDLED_MODELS["tiny-arith"])
    folder = tmp_path_factory.mktemp("tiny_rm")
    config = AutoConfig.from_pretrained(source, num_labels=1, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    return folder


def direct_scores(folder: Path, texts: list[str], keep: int | None = None) -> list[float]:
    """The model's own forward on each text alone (no padding), the last `keep` tokens."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    scores = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][-keep if keep else 0:]
            scores.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    return scores


def completion(prompt: str, text: str) -> Completion:
    return Completion(Prompt(f"<{prompt}>", [1], None, source=prompt), [1], [0.0], text, "stop", 0)


def test_reward_model_scores_equal_a_direct_call_of_the_same_model(tiny_rm):
    done = [completion("12+30=", "42"), completion("7+8=", "15 and more text"), completion("1+1=", "2"),
            completion("99+1=", "100"), completion("5+5=", "")]
    texts = [f"{c.prompt.source}\n{c.text}" for c in done]  # no chat template: the turns' texts joined
    for batch_size, keep in ((3, None), (2, 6)):
        settings = RewardConfig(function="reward_model", reward_model={"model_name": str(tiny_rm),
                                                                      "batch_size": batch_size, "max_model_len": keep})
        scorer = RewardScorer.from_spec("reward_model", settings=settings)
        assert scorer.score(done) == pytest.approx(direct_scores(tiny_rm, texts, keep), abs=1e-5)
    with pytest.raises(UserError, match="reward.reward_model.model_name, which is not set"):
        RewardScorer.from_spec("reward_model", settings=RewardConfig(function="reward_model"))
    with pytest.raises(UserError, match="reward.reward_model.model_name='/no/such/rm': no model folder there"):
        RewardScorer.from_spec("reward_model", settings=RewardConfig(function="reward_model",
                                                                     reward_model={"model_name": "/no/such/rm"}))


@pytest.mark.usefixtures("ray_session")  # the worker's Ray instance (tests/conftest.py), for the reward model's actor
def test_nemo_rls_reward_model_recipe_loads_and_trains_scaled_to_the_tiny_models(tiny_rm, tmp_path, capsys):
    """As NeMo RL lays it out: 2 devices, the reward model on 1 of its own (a Ray actor; CPU slots here), the
    policy and its colocated engine on the other."""
    from novarl.logging.metrics import read_jsonl
    from novarl.trainer.api import GRPOTrainer

    cfg = load_config(RM_RECIPE)
    assert cfg.reward.function == "reward_model"
    rm = cfg.reward.reward_model
    assert (rm.model_name, rm.precision, rm.batch_size, rm.max_model_len) == \
        ("Skywork/Skywork-Reward-V2-Qwen3-0.6B", "bfloat16", 4, 2048)
    assert any(w.startswith("env.reward_model: processor, offload_optimizer_for_logprob") for w in cfg.load_warnings)
    assert (rm.resources.gpus_per_node, cfg.cluster.gpus_per_node) == (1, 2)  # NeMo RL's: 1 of the node's 2 GPUs
    small = load_config(RM_RECIPE, overrides=[
        "policy.model_name=tiny-arith", "policy.tokenizer.name=null", "policy.tokenizer.chat_template=null",
        "policy.generation.backend=hf", "data.dataset_name=arithmetic", "data.prompt_file=null",
        "data.split_validation_size=0",
        f"env.reward_model.model_name={tiny_rm}",
        "policy.max_total_sequence_length=64", "policy.generation.max_new_tokens=4",
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2", "grpo.max_num_steps=2",
        "grpo.max_val_samples=4", "grpo.val_period=0", "grpo.val_at_start=false", "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8", "policy.dtensor_cfg.cpu_offload=false",
        "checkpointing.enabled=false", "logger.monitor_gpus=false", "logger.progress_bar=false",
        "logger.num_val_samples_to_print=4", "grpo.val_at_end=true", "grpo.max_train_seconds=null",
        f"logger.log_dir={tmp_path}"])
    from novarl.backends.generation.layout import training_devices

    assert training_devices(small)[0] == 1  # the reward model's device is not the policy's
    result = GRPOTrainer(small).train()
    assert "reward_model: a Ray actor on 1 CPU slot(s) of its own" in capsys.readouterr().err
    steps = [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert len(steps) == 2
    kept = (result.output_dir / "samples" / "eval_step_2.jsonl").read_text()
    samples = [json.loads(line) for line in kept.splitlines()]
    assert samples, "the evaluation kept no samples"
    from transformers import AutoTokenizer

    special = AutoTokenizer.from_pretrained(tiny_rm).all_special_tokens

    def plain(text: str) -> str:  # the samples keep special tokens; the reward model is given the text without
        for token in special:
            text = text.replace(token, "")
        return text

    texts = [f"{plain(s['prompt'])}\n{plain(''.join(p['text'] for p in s['parts']))}" for s in samples]
    assert [s["reward"] for s in samples] == pytest.approx(direct_scores(tiny_rm, texts), abs=1e-5)
