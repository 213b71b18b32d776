"""NeMo RL's config semantics: `defaults:` chains, `_override_`, '???', relative and
environment interpolation, and the table of NeMo RL keys novarl's schema does not hold
(config/nemo_rl.py). Pure config work: nothing is loaded or trained."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from novarl.algorithms.losses import ClippedPGSettings, clamped_kl
from novarl.config import load_config
from novarl.config.nemo_rl import RULES
from novarl.config.loading import schema_has
from novarl.errors import ConfigError


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def error_of(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return str(info.value)


# ------------------------------------------------------------------ defaults: chains
def test_a_chain_merges_bases_first_and_resolves_after_composing(tmp_path):
    write(tmp_path, "base/grand.yaml", """
        grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 4, seed: 1}
        policy: {model_name: tiny-arith, max_total_sequence_length: 64, tokenizer: {name: "${policy.model_name}"}}
    """)
    # A base names its own base relative to its own folder.
    write(tmp_path, "base/parent.yaml", "defaults: grand.yaml\ngrpo: {seed: 2}\n")
    child = write(tmp_path, "child.yaml", """
        defaults: base/parent.yaml
        grpo: {seed: 3}
        policy: {model_name: other-model}
    """)
    cfg = load_config(child)
    assert cfg.grpo.seed == 3 and cfg.grpo.num_prompts_per_step == 2 and cfg.grpo.num_generations_per_prompt == 4
    assert cfg.policy.max_seq_length == 64  # the alias in a base file is rewritten before merging
    # ${policy.model_name} in the grandparent reads the child's value (resolved after composing).
    assert cfg.policy.tokenizer.name == "other-model"


def test_a_list_of_bases_merges_in_order_the_later_winning(tmp_path):
    write(tmp_path, "a.yaml", "grpo: {seed: 1, num_prompts_per_step: 5}\n")
    write(tmp_path, "b.yaml", "grpo: {seed: 2}\n")
    cfg = load_config(write(tmp_path, "c.yaml", "defaults: [a.yaml, b.yaml]\n"))
    assert (cfg.grpo.seed, cfg.grpo.num_prompts_per_step) == (2, 5)
    cfg = load_config(write(tmp_path, "d.yaml", f"defaults: [{tmp_path / 'b.yaml'}, a.yaml]\n"))  # absolute too
    assert cfg.grpo.seed == 1


def test_lists_replace_mappings_merge_override_marker_replaces(tmp_path):
    write(tmp_path, "base.yaml", """
        policy:
          scheduler: [{name: torch.optim.lr_scheduler.ConstantLR, kwargs: {factor: 1.0}}]
          optimizer: {name: torch.optim.AdamW, kwargs: {lr: 1.0e-5, weight_decay: 0.1}}
          generation: {temperature: 0.5, top_p: 0.9}
    """)
    cfg = load_config(write(tmp_path, "child.yaml", """
        defaults: base.yaml
        policy:
          scheduler: [{name: torch.optim.lr_scheduler.LinearLR, kwargs: {start_factor: 0.5}}]
          optimizer: {kwargs: {lr: 2.0e-5}}
          generation: {_override_: true, temperature: 0.7}
    """))
    assert [s.name for s in cfg.policy.scheduler] == ["torch.optim.lr_scheduler.LinearLR"]  # a list replaces
    assert cfg.policy.optimizer.kwargs == {"lr": 2.0e-5, "weight_decay": 0.1}  # a mapping merges
    # _override_: the base's generation block is dropped, the schema default comes back for top_p.
    assert cfg.policy.generation.temperature == 0.7 and cfg.policy.generation.top_p == 1.0


def test_mandatory_values_left_unset_are_named_together(tmp_path):
    write(tmp_path, "base.yaml", "policy: {model_name: '???'}\ngrpo: {seed: '???', num_prompts_per_step: 2}\n")
    msg = error_of(write(tmp_path, "child.yaml", "defaults: base.yaml\n"))
    assert "2 value(s) the config marks as mandatory ('???') are not set: policy.model_name, grpo.seed" in msg
    # A child (or an override) that sets them is fine; a child's '???' keeps the base's value.
    write(tmp_path, "set.yaml", "defaults: base.yaml\npolicy: {model_name: tiny-arith}\n")
    assert load_config(tmp_path / "set.yaml", overrides=["grpo.seed=4"]).grpo.seed == 4
    write(tmp_path, "keep.yaml", "defaults: set.yaml\ngrpo: {seed: 5}\npolicy: {model_name: '???'}\n")
    assert load_config(tmp_path / "keep.yaml").policy.model_name == "tiny-arith"


@pytest.mark.parametrize("files, expected", [
    ({"a.yaml": "defaults: b.yaml\n", "b.yaml": "defaults: a.yaml\n"}, "comes back to a file it has read"),
    ({"a.yaml": "defaults: missing.yaml\n"}, "its base file 'defaults: missing.yaml'"),
    ({"a.yaml": "defaults: {x: 1}\n"}, "must name a base file"),
    ({"a.yaml": "defaults: [sub]\n", "sub/x.yaml": "grpo: {}\n"}, "is a folder"),
])
def test_broken_chains_are_refused_naming_the_file(tmp_path, files, expected):
    for name, text in files.items():
        write(tmp_path, name, text)
    msg = error_of(tmp_path / "a.yaml")
    assert expected in msg and str(tmp_path / "a.yaml") in msg


def test_a_dict_with_defaults_is_refused():
    assert "base files are read only from a YAML file" in error_of({"defaults": "x.yaml"})


# ------------------------------------------------------------------ interpolation
def test_relative_interpolation_reads_siblings_and_parents():
    cfg = load_config({"policy": {"max_total_sequence_length": 96, "generation": {
        "temperature": 0.6, "top_p": "${.temperature}",
        "max_new_tokens": "${..max_total_sequence_length}",
        "vllm_cfg": {"max_model_len": "${...max_total_sequence_length}", "gpu_memory_utilization": "${..top_p}"}}}})
    gen = cfg.policy.generation
    assert gen.top_p == 0.6 and gen.max_new_tokens == 96 and gen.vllm_cfg.max_model_len == 96
    assert gen.vllm_cfg.gpu_memory_utilization == 0.6  # a relative reference to a relative reference
    assert "above the top of the config" in error_of({"grpo": {"seed": "${....x}"}})


def test_environment_interpolation(monkeypatch):
    monkeypatch.setenv("NOVARL_TEST_LOGS", "/tmp/somewhere")
    monkeypatch.delenv("NOVARL_TEST_UNSET", raising=False)
    cfg = load_config({"logger": {"log_dir": "${oc.env:NOVARL_TEST_LOGS}/logs"},
                       "grpo": {"seed": "${oc.env:NOVARL_TEST_UNSET,7}"}})
    assert cfg.logger.log_dir == "/tmp/somewhere/logs" and cfg.grpo.seed == 7
    msg = error_of({"logger": {"log_dir": "${oc.env:NOVARL_TEST_UNSET}"}})
    assert "reads the environment variable NOVARL_TEST_UNSET, which is not set" in msg


# ------------------------------------------------------------------ NeMo RL keys
def test_every_rule_names_a_key_the_schema_does_not_hold():
    # A rule for a key novarl implements would hide it: each rule's key is outside the schema.
    held = [r.path for r in RULES if "*" not in r.path and schema_has(r.path)]
    assert held == []


def test_feature_switches_are_refused_when_on_and_accepted_when_off():
    off = load_config({"loss_fn": {"use_cispo": False, "truncated_importance_sampling_type": None},
                       "grpo": {"reward_shaping": {"enabled": False, "overlong_buffer_length": 128},
                                "use_dynamic_sampling": False, "dynamic_sampling_max_gen_batches": 10,
                                "async_grpo": {"max_generation_failures": 0}},
                       "policy": {"dtensor_cfg": {"lora_cfg": {"enabled": False, "dim": 8}}}})
    assert off.load_warnings == ()  # off is what novarl does: nothing to warn about
    msg = error_of({"grpo": {"async_grpo": {"max_generation_failures": 3}, "stop_at_validation_threshold": 0.5},
                    "on_policy_distillation": {"enabled": True},
                    "policy": {"precision": "float64", "router_replay": {"enabled": True}}})
    lines = msg.splitlines()
    assert lines[0] == "Invalid config (the config): 5 problem(s):"  # with the schema's own errors, all at once
    assert "  - 'on_policy_distillation' = {'enabled': True}: on-policy distillation is not built; remove it or " \
           "turn it off." in lines
    assert any(line.startswith("  - 'grpo.async_grpo.max_generation_failures' = 3: tolerated generation failures")
               for line in lines)
    assert any(line.startswith("  - 'policy.router_replay' = {'enabled': True}: MoE router") for line in lines)
    assert any("stop_at_validation_threshold=0.5 is set without grpo.stop_at_validation_metric" in line
               for line in lines)
    assert any(line.startswith("  - 'policy.precision' = 'float64'") for line in lines)


def test_operational_keys_are_accepted_with_one_warning():
    cfg = load_config({"cluster": {"master_port_range_low": 1400, "master_port_range_high": 1999},
                       "checkpointing": {"save_optimizer": False},
                       "policy": {"generation": {"port_range_low": 3000},
                                  # an inactive backend's operational keys are not worth a word
                                  "megatron_cfg": {"enabled": False, "cuda_graph_impl": "none"}}})
    (warning,) = cfg.load_warnings
    assert warning.startswith("4 NeMo RL setting(s) about ports, servers, logging, kernels or offloading are "
                              "accepted and not used by novarl: cluster.{master_port_range_low, "
                              "master_port_range_high}; checkpointing.save_optimizer (novarl always saves the "
                              "optimizer state, so that a resume is exact); policy.generation.port_range_low")
    assert "cuda_graph_impl" not in warning


def test_renamed_nemo_rl_spellings_land_on_novarl_keys():
    cfg = load_config({
        "loss_fn": {"reference_policy_kl_type": "k2", "kl_input_clamp_value": 20.0, "kl_output_clamp_value": 10.0},
        "grpo": {"val_period": -1, "async_grpo": None, "normalize_rewards": True,
                 "adv_estimator": {"name": "grpo", "normalize_rewards": False, "use_leave_one_out_baseline": True,
                                   "minus_baseline": True}},
        "checkpointing": {"metric_name": "val:accuracy", "model_save_format": None},
        "policy": {"sequence_packing": {"algorithm": "modified_ffd"},
                   "optimizer": {"name": "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam",
                                 "kwargs": {"lr": 1e-6}}}})
    assert cfg.loss_fn.kl_estimator == "k2" and cfg.loss_fn.kl_input_clamp_value == 20.0
    assert cfg.grpo.val_period == 0 and not cfg.grpo.async_grpo.enabled
    # NeMo RL reads the advantage estimator's copies of the flags.
    assert cfg.grpo.normalize_rewards is False and cfg.grpo.use_leave_one_out_baseline is True
    assert cfg.checkpointing.metric_name == "val_accuracy" and cfg.checkpointing.model_save_format is None
    assert cfg.policy.sequence_packing.algorithm == "modified_first_fit_decreasing"
    assert cfg.policy.optimizer.name == "torch.optim.AdamW"
    assert any("runs as torch.optim.AdamW" in w for w in cfg.load_warnings)
    assert load_config({"grpo": {"adv_estimator": {"name": "rloo"}}}).grpo.adv_estimator.name == "rloo"
    assert "'grpo', 'reinforce_plus_plus', 'rloo' or 'gae'" in error_of({"grpo": {"adv_estimator": {"name": "gdpo"}}})


def test_nemo_rl_data_blocks_become_novarl_data_keys():
    cfg = load_config({"data": {
        "train": {"data_path": "train.jsonl", "input_key": "question", "split_validation_size": 0.1, "seed": 1},
        "validation": None,
        "default": {"dataset_name": "ResponseDataset", "output_key": "solution", "prompt_file": None,
                    "processor": "math_hf_data_processor", "env_name": "math"}},
        "env": {"math": {"num_workers": 8}}})
    data = cfg.data
    assert (data.dataset_name, data.train_data_path, data.input_key, data.output_key) == \
        ("ResponseDataset", "train.jsonl", "question", "solution")
    assert data.split_validation_size == 0.1
    assert "env.math: completions are scored by reward.function='math_verify' (math-verify, as NeMo RL's " \
        "hf_math_verify); num_workers=8 is not used (the reward runs in the driver)" in cfg.load_warnings
    assert cfg.reward.function == "math_verify"
    # the list form: several datasets, data.default under each block
    cfg = load_config({"data": {"train": [{"data_path": "a.jsonl"}, {"data_path": "b.jsonl", "input_key": "q"}],
                                "default": {"input_key": "p", "processor": "math_hf_data_processor"}}})
    assert [(b.data_path, b.input_key) for b in cfg.data.train] == [("a.jsonl", "p"), ("b.jsonl", "q")]
    msg = error_of({"data": {"train": [{"data_path": "a.jsonl", "prompt_file": "other.txt"}, "b.jsonl"]}})
    assert "'data.train[0].prompt_file' = 'other.txt' differs from data.default's null" in msg
    assert "'data.train[1]' = 'b.jsonl': a dataset block is a mapping" in msg
    msg = error_of({"data": {"train": {"data_path": "a.jsonl", "input_key": "q"},
                             "validation": {"data_path": "b.jsonl", "input_key": "other", "processor": "x"}}})
    assert "'data.validation.input_key' = 'other' differs from the training data's 'q'" in msg
    assert "'data.validation.processor' = 'x'" in msg
    msg = error_of({"data": {"default": {"env_name": "code"}}, "env": {"code": {"x": 1}}})
    assert "'env.code': NeMo RL's 'code' environment is not built" in msg


def test_null_optimizer_is_megatron_only_and_null_scheduler_is_constant():
    cfg = load_config({"policy": {"optimizer": None, "scheduler": None, "megatron_cfg": {"enabled": True}}})
    assert cfg.policy.optimizer is None and cfg.policy.scheduler is None
    msg = error_of({"policy": {"optimizer": None}})
    assert "policy.optimizer is null, which only the Megatron backend allows" in msg
    from novarl.backends.training.optim import build_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    scheduler = build_scheduler(load_config({"policy": {"scheduler": None}}).policy.scheduler, optimizer, 10)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_kl_clamps_bound_the_log_ratio_and_the_estimate():
    logprobs = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    reference = torch.tensor([-1.5, -40.0, 30.0])
    plain = clamped_kl(logprobs, reference, ClippedPGSettings(kl_estimator="k1"))
    assert torch.allclose(plain, torch.tensor([0.5, 39.0, -31.0]))
    clamped = clamped_kl(logprobs, reference, ClippedPGSettings(kl_estimator="k1", kl_input_clamp_value=20.0))
    assert torch.allclose(clamped, torch.tensor([0.5, 20.0, -20.0]))
    both = clamped_kl(logprobs, reference, ClippedPGSettings(kl_estimator="k3", kl_input_clamp_value=20.0,
                                                             kl_output_clamp_value=10.0))
    # k3 at log q - log p = -0.5: exp(-0.5) + 0.5 - 1; at -20: 19 + e^-20, clamped to 10; at +20: huge, clamped.
    assert torch.allclose(both, torch.tensor([0.1065307, 10.0, 10.0]), atol=1e-6)
    both.sum().backward()
    # Where the input or the output is clamped, no gradient flows.
    assert logprobs.grad[1] == 0 and logprobs.grad[2] == 0 and logprobs.grad[0] != 0


# ------------------------------------------------------------------ settings that are never silently ignored
def test_every_schema_setting_is_read_or_refused_or_warned_about():
    """A key that is accepted is used, warned about once, or refused. This test finds the
    schema fields no code reads by name: each must be in config/unused.py (refused or
    warned) or governed by a switch that is refused or warned about (named here)."""
    import re
    import typing

    from pydantic import BaseModel

    from novarl.config.schema import NovaRLConfig
    from novarl.config.unused import SETTINGS

    governed = {
        "logger.wandb_enabled": "backends/contract/resolve.py check_available warns, by f-string",
        "logger.tensorboard_enabled": "the same", "logger.mlflow_enabled": "the same",
        "logger.swanlab_enabled": "the same",
        "logger.mlflow.experiment_name": "logger.mlflow_enabled is warned about",
        "logger.mlflow.run_name": "logger.mlflow_enabled is warned about",
        "env.num_workers": "env.math is warned about (config/nemo_rl.py)",
        "env.math_verify_impl": "env.math is warned about (config/nemo_rl.py)",
    }

    def leaves(model, prefix=""):
        for name, field in model.model_fields.items():
            path = f"{prefix}{field.alias or name}"
            args = [field.annotation, *typing.get_args(field.annotation)]
            nested = [c for a in args for c in (a, *typing.get_args(a))
                      if isinstance(c, type) and issubclass(c, BaseModel)]
            if nested:
                yield from leaves(nested[0], path + ".")
            else:
                yield path, name

    root = Path(__file__).parent.parent / "novarl"
    source = "\n".join(p.read_text() for p in root.rglob("*.py")  # where the settings are defined is no use
                       if p.name not in ("schema.py", "nemo_rl.py", "unused.py") and p.parent.name != "sections")
    named = {s.path for s in SETTINGS}
    unread = [path for path, name in leaves(NovaRLConfig)
              if not re.search(rf"\b{re.escape(name)}\b", source) and path not in named and path not in governed]
    assert unread == []


def test_unbuilt_settings_are_refused_and_operational_ones_warned():
    msg = error_of({"checkpointing": {"checkpoint_must_save_by": "00:03:30:00"}})
    assert msg.startswith("Invalid config (the config): 1 problem(s):")
    assert "'checkpointing.checkpoint_must_save_by' = '00:03:30:00': saving before a wall-clock deadline" in msg
    cfg = load_config({"policy": {"logprob_chunk_size": 1024, "dtensor_cfg": {"_v2": False},
                                  "megatron_cfg": {"enabled": True, "context_parallel_size": 2,
                                                   "distributed_data_parallel_config": {"overlap_param_gather": True}}},
                       "checkpointing": {"save_consolidated": True}})
    warned = "\n".join(cfg.load_warnings)
    for key in ("'policy.logprob_chunk_size' = 1024: logprobs come from chunks", "policy.dtensor_cfg._v2", "checkpointing.save_consolidated",
                "distributed_data_parallel_config.overlap_param_gather"):
        assert key in warned
    assert load_config({}).load_warnings == ()
    # without context parallelism Megatron's output layer picks chunk by chunk (each tensor-parallel rank over its
    # part of the vocabulary), as DTensor's head does on every layout: the key is read
    for parallel in ({"megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 2}},
                     {"dtensor_cfg": {"tensor_parallel_size": 2, "context_parallel_size": 2}}):
        assert load_config({"policy": {"logprob_chunk_size": 1024, **parallel}}).load_warnings == ()


def test_sequence_parallelism_without_tensor_parallel_ranks_is_said_to_do_nothing():
    def warned(policy):
        return [w for w in load_config({"policy": policy}).load_warnings if "sequence_parallel" in w]

    assert warned({"dtensor_cfg": {"sequence_parallel": True}}) == [
        "'policy.dtensor_cfg.sequence_parallel' = True: no effect with policy.dtensor_cfg.tensor_parallel_size=1 "
        "(nothing to split the activations over)"]
    assert warned({"megatron_cfg": {"enabled": True, "sequence_parallel": True}})[0].startswith(
        "'policy.megatron_cfg.sequence_parallel' = True: no effect with "
        "policy.megatron_cfg.tensor_model_parallel_size=1")
    # the backend that trains is the one read: DTensor's setting under Megatron, or with tensor
    # parallelism, says nothing
    assert warned({"dtensor_cfg": {"sequence_parallel": True}, "megatron_cfg": {"enabled": True}}) == []
    assert warned({"megatron_cfg": {"enabled": True, "sequence_parallel": True, "tensor_model_parallel_size": 2}}) == []


def test_the_top_level_overlap_grad_reduce_is_not_overridden():
    from novarl.backends.training.megatron import ddp_config

    pytest.importorskip("megatron.core")
    off = load_config({"policy": {"megatron_cfg": {"overlap_grad_reduce": False}}}).policy.megatron_cfg
    assert ddp_config(off, True).overlap_grad_reduce is False
    default = load_config({}).policy.megatron_cfg
    assert ddp_config(default, True).overlap_grad_reduce is True  # distributed_data_parallel_config's own


def test_max_num_epochs_ends_the_run_when_it_comes_before_max_num_steps():
    from novarl.trainer.setup import steps_in_epochs

    notes: list[str] = []
    cfg = load_config({"grpo": {"num_prompts_per_step": 4, "max_num_steps": 100, "max_num_epochs": 2}})
    assert steps_in_epochs(cfg, 10, notes) == 4  # 2 whole batches of 4 in 10 prompts, twice
    assert "the run takes 4 steps, not grpo.max_num_steps=100" in notes[0]
    assert steps_in_epochs(load_config({"grpo": {"num_prompts_per_step": 4, "max_num_steps": 3}}), 10, []) == 3
    assert steps_in_epochs(load_config({"grpo": {"num_prompts_per_step": 4, "max_num_steps": 3,
                                                 "max_num_epochs": 1}}), 10, []) == 2


def test_reward_and_advantage_clipping():
    from novarl.algorithms.estimators import StepRewards
    from novarl.trainer.stages import advantage_estimator
    from novarl.types import TrainBatch

    def step_advantages(cfg, batch, rewards):
        return advantage_estimator(cfg)(StepRewards(batch, rewards)).advantages

    rewards = torch.tensor([0.0, 0.0, 0.0, 100.0, 1.0, 2.0, 3.0, 4.0])
    # eight sequences of a prompt token and one trained token: one advantage each, on its trained token
    batch = TrainBatch.from_rows(torch.ones((8, 2), dtype=torch.long), torch.ones((8, 2), dtype=torch.bool),
                                 torch.tensor([[False, True]] * 8), torch.zeros(8))
    cfg = load_config({"grpo": {"num_generations_per_prompt": 4, "normalize_rewards": False}})
    assert torch.allclose(step_advantages(cfg, batch, rewards)[1::2],
                          torch.tensor([-25.0, -25.0, -25.0, 75.0, -1.5, -0.5, 0.5, 1.5]))
    cfg = load_config({"grpo": {"num_generations_per_prompt": 4, "normalize_rewards": False, "reward_clip": 10.0,
                                "advantage_clip_low": -1.0, "advantage_clip_high": 5.0}})
    # The reward 100 counts as 10 (group mean 2.5), then the advantages are clipped to [-1, 5].
    assert torch.allclose(step_advantages(cfg, batch, rewards)[1::2],
                          torch.tensor([-1.0, -1.0, -1.0, 5.0, -1.0, -0.5, 0.5, 1.5]))


def test_unbuilt_settings_are_listed_with_the_schemas_errors():
    msg = error_of({"checkpointing": {"checkpoint_must_save_by": "x"}, "policy": {"precision": "float64"}})
    assert msg.startswith("Invalid config (the config): 2 problem(s):")
    assert "'checkpointing.checkpoint_must_save_by' = 'x'" in msg and "'policy.precision' = 'float64'" in msg
