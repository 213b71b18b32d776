"""`policy.backend: auto`: the planner's choice written into the config as the seeds' keys."""

from __future__ import annotations

import json

import pytest

from novarl.cli import BUNDLED_RECIPE, main
from novarl.config import load_config
from novarl.errors import UserError
from novarl.plan.auto import apply_auto
from novarl.backends.contract.resolve import installed, resolve_backends

QWEN = {"model_type": "qwen2", "tie_word_embeddings": False, "vocab_size": 152064, "num_key_value_heads": 8}
QWEN_32B = {**QWEN, "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 40, "intermediate_size": 27648}
QWEN_72B = {**QWEN, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "intermediate_size": 29568}
VLLM_OR_HF = "vllm" if installed("vllm") else "hf"


def model_folder(tmp_path, config: dict) -> str:
    """A model folder with only config.json: the planner reads the shape, never the weights."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def auto(*overrides: str, **host):
    cfg = load_config(BUNDLED_RECIPE, overrides=["policy.backend=auto", *overrides])
    return apply_auto(cfg, **host)


def test_without_auto_the_config_is_untouched():
    cfg = load_config(BUNDLED_RECIPE)
    assert apply_auto(cfg, on_gpu=False) == (cfg, [])


def test_no_gpu_takes_the_cpu_layout():
    cfg, why = auto("policy.generation.backend=hf", "policy.dtensor_cfg.tensor_parallel_size=2",
                    "cluster.gpus_per_node=2", on_gpu=False)
    assert cfg.policy.backend is None  # resolved: the saved config.yaml is explicit
    assert resolve_backends(cfg).training == "dtensor"
    assert cfg.policy.dtensor_cfg.tensor_parallel_size == 1
    # the engine measured faster here for the bundled 0.3M model, as without auto (vLLM from 10M parameters)
    assert cfg.policy.generation.backend == "hf" and cfg.policy.generation.colocated.enabled
    assert "no GPU here" in why[0] and "2 x 1 CPU rank(s)" in why[0]
    assert "Hugging Face generates faster than vLLM below 10M parameters" in why[0]


def test_small_model_on_a_gpu_follows_the_advisor():
    cfg, why = auto("policy.megatron_cfg.enabled=true", "cluster.gpus_per_node=8", on_gpu=True, gpu_memory_gb=80)
    assert resolve_backends(cfg).training == "dtensor"  # auto overrides the flags it was given
    assert cfg.policy.generation.backend == VLLM_OR_HF and cfg.policy.generation.colocated.enabled
    assert cfg.policy.generation.vllm_cfg.tensor_parallel_size == 1
    assert any("<10B" in line for line in why)


def test_middle_branch_on_one_node_writes_colocated_vllm_spanning_the_gpus(tmp_path):
    """The seeds' 10B-70B single-node branch: vLLM TP=8 colocated beside the training backend the
    memory model picks, a layout that runs (the engine spans the 8 policy ranks), so nothing in it
    is refused on a GPU host."""
    from novarl.backends.generation.layout import generation_layout, layout_missing
    from novarl.backends.contract.resolve import check_available

    cfg, why = auto(f"policy.model_name={model_folder(tmp_path, QWEN_32B)}", "policy.generation.backend=vllm",
                    "cluster.gpus_per_node=8", on_gpu=True, gpu_memory_gb=80)
    choice = resolve_backends(cfg)
    assert choice.generation == "vllm" and any("10B-70B single node" in line for line in why)
    assert cfg.policy.generation.colocated.enabled and cfg.policy.generation.vllm_cfg.tensor_parallel_size == 8
    layout = generation_layout(cfg, "vllm")
    assert layout.ranks_per_engine == 8 and layout_missing(layout) == []
    available = check_available(cfg, choice)
    assert set(available.missing) <= set(available.gpu_only)  # valid for a GPU host


def test_megatron_recommendation_runs_megatron_with_its_sizes(tmp_path):
    cfg, why = auto(f"policy.model_name={model_folder(tmp_path, QWEN_32B)}", "policy.max_total_sequence_length=4096",
                    "policy.train_micro_batch_size=1", "cluster.gpus_per_node=8", "cluster.num_nodes=4",
                    on_gpu=True, gpu_memory_gb=80)
    assert not any("which novarl does not run yet" in line for line in why)
    assert resolve_backends(cfg).training == "megatron"
    mc = cfg.policy.megatron_cfg
    assert mc.tensor_model_parallel_size == 8 and 24 % (8 * mc.pipeline_model_parallel_size) == 0
    gen = cfg.policy.generation
    # 32B on 4 nodes: generation on a node of its own (the tree's multi-node branch)
    assert not gen.colocated.enabled and gen.colocated.resources.gpus_per_node == 8
    assert gen.colocated.resources.num_nodes == 1 and cfg.cluster.num_nodes == 4  # NeMo RL: taken out of the 4


def test_above_70b_runs_megatron_training_and_generation(tmp_path):
    """The tree's last branch: Megatron training and Megatron generation on the same GPUs."""
    cfg, why = auto(f"policy.model_name={model_folder(tmp_path, QWEN_72B)}", "policy.max_total_sequence_length=4096",
                    "policy.train_micro_batch_size=1", "cluster.gpus_per_node=8", "cluster.num_nodes=4",
                    on_gpu=True, gpu_memory_gb=80)
    choice = resolve_backends(cfg)
    assert (choice.training, choice.generation) == ("megatron", "megatron")
    mc = cfg.policy.megatron_cfg
    assert (mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size) == (8, 4)  # the seeds' 72B example
    assert cfg.policy.generation.colocated.enabled and cfg.cluster.num_nodes == 4


def test_nothing_runnable_fits_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no layout novarl can run today fits"):
        auto(f"policy.model_name={model_folder(tmp_path, QWEN_72B)}", "policy.max_total_sequence_length=4096",
             "cluster.gpus_per_node=1", on_gpu=True, gpu_memory_gb=24)


def test_validate_prints_the_choice(capsys):
    assert main(["validate", "policy.backend=auto"]) == 0
    out = capsys.readouterr().out
    assert "# policy.backend=auto" in out and "training backend: dtensor" in out


@pytest.mark.slow
def test_train_runs_the_auto_choice_and_saves_it_explicitly(tmp_path):
    from novarl.logging.metrics import read_jsonl
    from novarl.trainer.api import GRPOTrainer

    cfg = load_config(BUNDLED_RECIPE, overrides=[
        "policy.backend=auto", f"logger.log_dir={tmp_path}", "logger.progress_bar=false", "grpo.max_num_steps=2",
        "grpo.max_train_seconds=null", "grpo.val_at_start=false", "grpo.val_at_end=false"])
    result = GRPOTrainer(cfg).train()
    saved = load_config(result.output_dir / "config.yaml")
    assert saved.policy.backend is None and saved.policy.generation.backend == "hf"
    assert len([r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"]) == 2


def test_model_based_rewards_on_devices_of_their_own_are_planned_apart_from_the_policy(tmp_path, capsys):
    """A reward model holding 4 of the node's 8 GPUs: the policy's layout is planned over the other 4, and
    `novarl plan` sizes each reward model against one GPU (it loads whole on one): a 32B judge in bf16 does
    not fit a 40 GB GPU (exit 2), the bundled tiny reward model does."""
    judge = model_folder(tmp_path / "judge", QWEN_32B)
    rewards = ["reward.function=[reward_model, llm_judge]", "reward.reward_model.model_name=tiny-arith",
               "reward.reward_model.resources.gpus_per_node=4", f"reward.judge.model_name={judge}",
               "cluster.gpus_per_node=8"]
    cfg, why = auto(*rewards, on_gpu=True, gpu_memory_gb=40)
    assert any("4 GPU" in line or "x 4" in line for line in why), why  # the advisor's count: 8 less the reward model's
    assert any("reward.judge:" in line and "does not fit" in line for line in why)
    config = tmp_path / "rm.yaml"
    config.write_text("\n".join(["policy:", "  model_name: tiny-arith"]))
    assert main(["plan", "-c", str(config), "--gpu-memory-gb", "40", *rewards]) == 2
    out = capsys.readouterr().out
    assert "reward.reward_model: tiny-arith, 0.3M parameters" in out
    assert "on 4 GPU(s) of its own; it loads on one, the other 3 are idle: fits on a 40 GB GPU" in out
    assert f"reward.judge: {judge}, 32." in out and "on the driver's first GPU: does not fit" in out
