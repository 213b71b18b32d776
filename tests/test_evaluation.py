"""The evaluation (NeMo RL's keys): one greedy completion a prompt, or grpo.val_num_generations_per_prompt
sampled ones, a prompt's consecutive, with pass@k; periodic evaluations from grpo.val_start_at on; the
early stop on grpo.stop_at_validation_metric, at start or at a periodic evaluation (after that step's
checkpoint); and what the config says about them. The bundled tiny model, Hugging Face generation."""

from __future__ import annotations

import pytest
import torch

from novarl.cli import BUNDLED_RECIPE, main
from novarl.config import load_config
from novarl.errors import ConfigError
from novarl.logging.metrics import read_jsonl
from novarl.logging.plots import ACCURACY_LABEL, curve_series
from novarl.rewards.scorer import RewardScorer
from novarl.trainer.api import GRPOTrainer
from novarl.trainer.checkpoint import FINISHED_FILE, check_checkpoint
from novarl.trainer.evaluate import EvalSampling, correct_shares, describe, evaluate, evaluation_sampling
from novarl.trainer.grpo import periodic_validation_due
from novarl.types import SamplingConfig
from tests.helpers import HF

RUN = ["logger.progress_bar=false", "grpo.max_train_seconds=null", "grpo.num_prompts_per_step=16",
       "policy.train_micro_batch_size=128", "grpo.max_val_samples=16", HF]


def config(*overrides: str):
    return load_config(BUNDLED_RECIPE, overrides=[HF, "grpo.max_val_samples=12", *overrides])


@pytest.fixture(scope="module")
def eval_inputs():
    """The bundled model on 12 held-out prompts, in this process."""
    from novarl.trainer.setup import prepare_eval

    return prepare_eval(config(), "tiny-arith", torch.device("cpu"))


def first_digit_right(completion: str, answer: str) -> float:
    """1 when the completion starts with the answer's first digit: right for some samples of a prompt."""
    return float(completion.strip()[:1] == answer.strip()[:1])


def evaluated(eval_inputs, how: EvalSampling, *, batch_size: int = 256, scorer=None) -> tuple[dict, list, list]:
    """(the metrics, every sample, every reward) of one evaluation."""
    kept = []
    result = evaluate(eval_inputs.generator, eval_inputs.prompts, scorer or eval_inputs.scorer, how,
                      batch_size=batch_size, episodes=eval_inputs.episodes,
                      keep=lambda samples, rewards: kept.append((samples, rewards)))
    [(samples, rewards)] = kept
    return result, samples, rewards


# ------------------------------------------------------------------ the evaluation's sampling and metrics
def test_the_evaluation_samples_as_the_config_says():
    greedy = evaluation_sampling(config("policy.generation.stop_token_ids=[2]", "policy.generation.stop_strings=[';']"))
    assert greedy.label == "greedy" and greedy.num_generations_per_prompt == 1
    assert greedy.sampling == SamplingConfig(max_new_tokens=4, temperature=0.0, stop_token_ids=(2,),
                                             stop_strings=(";",))
    # unset val_* keys: the training sampling's; seeded by grpo.seed
    sampled = evaluation_sampling(config("grpo.val_num_generations_per_prompt=4", "policy.generation.top_k=7"))
    assert sampled.label == "4 samples a prompt at temperature 1, top_k 7"
    assert (sampled.sampling.temperature, sampled.sampling.top_p, sampled.sampling.top_k) == (1.0, 1.0, 7)
    assert sampled.sampling.seed == 42 and sampled.num_generations_per_prompt == 4
    own = evaluation_sampling(config("grpo.val_num_generations_per_prompt=4", "policy.generation.val_temperature=0.7",
                                     "policy.generation.val_top_p=0.9", "policy.generation.val_top_k=5"))
    assert own.label == "4 samples a prompt at temperature 0.7, top_p 0.9, top_k 5"
    assert (own.sampling.temperature, own.sampling.top_p, own.sampling.top_k) == (0.7, 0.9, 5)
    result = {"accuracy": 0.35, "pass_k": 0.6}
    assert describe(result, own) == ("held-out accuracy 35.0% (4 samples a prompt at temperature 0.7, top_p 0.9, "
                                     "top_k 5), pass@4 60.0%")
    assert describe(result, greedy, source="training-set") == "training-set accuracy 35.0% (greedy)"


def test_pass_k_is_the_share_of_prompts_with_a_correct_sample():
    rewards = [0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0]  # 4 prompts x 2 samples; 0.5 is not correct (< 1)
    assert correct_shares(rewards, 2) == {"accuracy": 3 / 8, "reward": 3.5 / 8, "num_samples": 8.0,
                                          "pass_k": 2 / 4, "num_prompts": 4.0}
    assert correct_shares(rewards, 1) == {"accuracy": 3 / 8, "reward": 3.5 / 8, "num_samples": 8.0}


def test_one_completion_a_prompt_is_the_greedy_evaluation(eval_inputs):
    result, samples, rewards = evaluated(eval_inputs, evaluation_sampling(config()), batch_size=5)
    greedy = SamplingConfig(max_new_tokens=4, temperature=0.0)
    expected = eval_inputs.generator.submit(eval_inputs.prompts, greedy).result()
    assert [c.text for c in samples] == [c.text for c in expected]
    assert [c.prompt for c in samples] == eval_inputs.prompts
    scores = eval_inputs.scorer.score(expected)
    assert result == {"accuracy": sum(s >= 1 for s in scores) / 12, "reward": sum(scores) / 12, "num_samples": 12.0}
    assert rewards == scores


def test_k_samples_of_each_prompt_are_consecutive_seeded_and_counted_by_prompt(eval_inputs):
    how = evaluation_sampling(config("grpo.val_num_generations_per_prompt=3"))
    scorer = RewardScorer.from_spec(first_digit_right)
    result, samples, rewards = evaluated(eval_inputs, how, batch_size=7, scorer=scorer)
    assert [c.prompt for c in samples] == [p for p in eval_inputs.prompts for _ in range(3)]
    assert rewards == [first_digit_right(c.text, c.prompt.answer) for c in samples]
    solved = [any(r >= 1 for r in rewards[i:i + 3]) for i in range(0, 36, 3)]
    assert result["pass_k"] == sum(solved) / 12 and result["num_prompts"] == 12.0
    assert result["accuracy"] == sum(r >= 1 for r in rewards) / 36 and result["num_samples"] == 36.0
    assert 0 < result["accuracy"] < result["pass_k"] < 1  # some prompts' samples differ in being right
    # the seed fixes each sample, whatever the batches
    again, resampled, _ = evaluated(eval_inputs, how, batch_size=36, scorer=scorer)
    assert [c.text for c in resampled] == [c.text for c in samples] and again == result
    greedy = evaluated(eval_inputs, evaluation_sampling(config()))[1]
    assert len({c.text for c in samples}) > len({c.text for c in greedy})  # sampled, not greedy


def test_episodes_are_played_k_times_a_prompt():
    from novarl.trainer.setup import prepare_eval

    cfg = config("env.again.actor_class_fqn=tests.helpers.environments:AskAgain", "env.again.cfg={turns: 2}",
                 "policy.max_seq_length=32", "grpo.max_rollout_turns=2", "grpo.max_val_samples=4",
                 "grpo.val_num_generations_per_prompt=2")
    inputs = prepare_eval(cfg, "tiny-arith", torch.device("cpu"))
    result, samples, rewards = evaluated(inputs, evaluation_sampling(cfg), batch_size=3)
    assert [c.prompt.text for c in samples] == [p.text for p in inputs.prompts for _ in range(2)]
    assert result["num_prompts"] == 4.0 and result["num_samples"] == 8.0 and result["episode_turns_mean"] == 2.0
    assert result["pass_k"] == sum(max(rewards[i:i + 2]) >= 1 for i in range(0, 8, 2)) / 4
    assert [c.text for c in evaluated(inputs, evaluation_sampling(cfg), batch_size=8)[1]] == [c.text for c in samples]


def test_novarl_eval_samples_k_completions_when_the_config_says_so(capsys):
    code = main(["eval", "tiny-arith", "grpo.val_num_generations_per_prompt=2", "grpo.max_val_samples=8"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("held-out accuracy (2 samples a prompt at temperature 1) of tiny-arith: ")
    assert ", pass@2 " in out and out.endswith(" on 8 prompts\n")


def test_the_reward_curve_says_how_the_evaluation_sampled():
    def evaluation(step, **counts):
        return {"kind": "eval", "step": step, "accuracy": 0.5, **counts}

    assert curve_series([evaluation(0, num_samples=8.0)]).accuracy_label == ACCURACY_LABEL == "held-out greedy accuracy"
    sampled = [evaluation(5, num_samples=32.0, num_prompts=8.0), evaluation(10, num_samples=32.0, num_prompts=8.0)]
    assert curve_series(sampled).accuracy_label == "held-out accuracy (4 samples a prompt)"
    resumed_with_k = [evaluation(0, num_samples=8.0), *sampled]  # grpo.val_num_generations_per_prompt changed
    assert curve_series(resumed_with_k).accuracy_label == "held-out accuracy (greedy or 4 samples a prompt)"


# ------------------------------------------------------------------ when the run evaluates, and stops
def test_periodic_evaluations_start_at_val_start_at():
    def due(**grpo) -> list[int]:
        cfg = load_config({"grpo": {"max_num_steps": 6, "val_period": 2, **grpo}}).grpo
        return [step for step in range(1, 7) if periodic_validation_due(cfg, step, 6)]

    assert due() == due(val_start_at=-1) == due(val_start_at=2) == [2, 4]  # step 6: val_at_end's
    assert due(val_start_at=3) == [4]
    assert due(val_start_at=3, val_at_end=False) == [4, 6]
    assert due(val_period=0) == []


def test_an_evaluation_at_the_threshold_ends_the_run_after_its_steps_checkpoint(tmp_path, capsys):
    """Periodic evaluations every 2 steps from step 3 on: the first is step 4's, which reaches the
    threshold; the run ends there, after step 4's checkpoint (due every 3 steps: step 3's, then the
    last one's), without the evaluation at the end again."""
    cfg = load_config(BUNDLED_RECIPE, overrides=[
        *RUN, f"logger.log_dir={tmp_path / 'logs'}", "grpo.max_num_steps=6", "grpo.val_at_start=false",
        "grpo.val_period=2", "grpo.val_start_at=3", "grpo.val_num_generations_per_prompt=2",
        "grpo.stop_at_validation_metric=pass_k", "grpo.stop_at_validation_threshold=0.0",
        "checkpointing.enabled=true", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        "checkpointing.save_period=3"])
    result = GRPOTrainer(cfg).train()
    err = capsys.readouterr().err
    records = read_jsonl(result.output_dir / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
    [evaluation] = [r for r in records if r["kind"] == "eval"]
    assert evaluation["step"] == 4 and evaluation["num_samples"] == 32 and evaluation["num_prompts"] == 16
    assert result.steps == 4 and result.metrics["stopped_on_validation_metric"] == 1.0
    assert result.metrics["val_pass_k"] == evaluation["pass_k"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_3", "step_4"]
    assert check_checkpoint(tmp_path / "ckpt" / "step_4") is None
    assert (f"step 4: held-out accuracy {100 * evaluation['accuracy']:.1f}% (2 samples a prompt at temperature 1), "
            f"pass@2 {100 * evaluation['pass_k']:.1f}%") in err
    assert (f"step 4: validation pass_k reached the early-stop threshold ({evaluation['pass_k']:.4f} >= 0, "
            "grpo.stop_at_validation_threshold); stopping training") in err
    assert result.stopped_early and result.stopped_by == "grpo.stop_at_validation_metric"
    # the same command again: the run it would resume stopped there; a higher threshold goes on
    argv = ["train", *RUN, f"logger.log_dir={tmp_path / 'logs'}", "grpo.max_num_steps=6", "grpo.val_at_start=false",
            "grpo.val_period=2", "grpo.val_start_at=3", "grpo.val_num_generations_per_prompt=2",
            "grpo.stop_at_validation_metric=pass_k", "checkpointing.enabled=true",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", "checkpointing.save_period=3"]
    assert main([*argv, "grpo.stop_at_validation_threshold=0.0"]) == 2
    err = capsys.readouterr().err
    assert "is at step 4, where the run that wrote it stopped: its evaluation's pass_k reached " \
           "grpo.stop_at_validation_threshold=0" in err and "Traceback" not in err
    # killed after its stop's save, before it ended (no finished record): the resume ends it, training nothing
    (tmp_path / "ckpt" / "step_4" / FINISHED_FILE).unlink()
    assert main([*argv, "grpo.stop_at_validation_threshold=0.0"]) == 0
    assert "(4 of 6 steps: stopped on grpo.stop_at_validation_metric)" in capsys.readouterr().out
    records = read_jsonl(sorted((tmp_path / "logs").iterdir())[-1] / "metrics.jsonl")
    assert [r["kind"] for r in records[records.index(next(r for r in records if r["kind"] == "resume")):]] \
        == ["resume"]
    assert main([*argv, "grpo.stop_at_validation_threshold=1.5"]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy (2 samples a prompt at temperature 1): before" in out and "(6 steps)" in out


def test_an_evaluation_at_start_at_the_threshold_trains_no_step(tmp_path):
    cfg = load_config(BUNDLED_RECIPE, overrides=[
        *RUN, f"logger.log_dir={tmp_path}", "grpo.max_num_steps=3", "grpo.stop_at_validation_metric=accuracy",
        "grpo.stop_at_validation_threshold=0.0"])
    result = GRPOTrainer(cfg).train()
    records = read_jsonl(result.output_dir / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in records] == [("eval", 0)]  # and not val_at_end's again
    assert result.steps == 0 and result.metrics["stopped_on_validation_metric"] == 1.0


def test_a_metric_the_evaluation_does_not_report_is_refused_by_name(tmp_path, capsys):
    code = main(["train", *RUN, f"logger.log_dir={tmp_path / 'logs'}", "grpo.max_num_steps=2",
                 "grpo.stop_at_validation_metric=pass_at_1", "grpo.stop_at_validation_threshold=0.5"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "novarl: error: grpo.stop_at_validation_metric='pass_at_1': the evaluation at step 0 reports no such " \
           "metric; it reports accuracy, num_samples, reward. Name one of them." in err
    assert not any((tmp_path / "logs").iterdir())  # nothing trained: no run folder


# ------------------------------------------------------------------ what the config says
@pytest.mark.parametrize("grpo, says", [
    ({"stop_at_validation_threshold": 0.5}, "grpo.stop_at_validation_threshold=0.5 is set without "
                                            "grpo.stop_at_validation_metric"),
    ({"stop_at_validation_metric": "accuracy"}, "grpo.stop_at_validation_metric='accuracy' needs "
                                                "grpo.stop_at_validation_threshold"),
    ({"stop_at_validation_metric": "pass_k", "stop_at_validation_threshold": 0.5},
     "grpo.stop_at_validation_metric='pass_k' needs grpo.val_num_generations_per_prompt > 1"),
    ({"stop_at_validation_metric": "accuracy", "stop_at_validation_threshold": 0.5, "val_period": 0,
      "val_at_start": False}, "the run evaluates at its end only (grpo.val_period=0, val_at_start=false)"),
])
def test_an_early_stop_that_cannot_work_is_refused(grpo, says):
    with pytest.raises(ConfigError, match="1 problem") as refused:
        load_config({"grpo": grpo})
    assert says in str(refused.value)


def test_evaluation_sampling_keys_of_a_greedy_evaluation_are_said_to_do_nothing():
    said = ("'policy.generation.{val_temperature, val_top_k}': the evaluation is greedy, one completion per prompt; "
            "the evaluation's sampling settings apply with grpo.val_num_generations_per_prompt > 1")
    generation = {"val_temperature": 0.7, "val_top_k": 5}
    assert said in load_config({"policy": {"generation": generation}}).load_warnings
    assert load_config({"policy": {"generation": generation}, "grpo": {"val_num_generations_per_prompt": 2}}
                       ).load_warnings == ()
