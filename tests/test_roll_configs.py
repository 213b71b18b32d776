"""ROLL's RLVR pipeline configs (seed 003's format): role blocks, strategies, device
mappings turned into novarl's sections (config/roll.py). tests/data/roll holds seven of
ROLL's own RLVR examples (alibaba/ROLL at 8eb27cc; tests/data/README.md names them) and one of novarl's
in the same format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from novarl.cli import main
from novarl.config import load_config
from novarl.config.roll import parse_devices
from novarl.errors import ConfigError

ROLL = Path(__file__).parent / "data" / "roll"


def error_of(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return str(info.value)


@pytest.fixture
def in_tmp(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 20) for b in range(40, 44)]
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_a_roll_pipeline_config_becomes_novarls_sections(in_tmp):
    cfg = load_config(ROLL / "tiny_grpo_fsdp2.yaml")
    policy, grpo, loss = cfg.policy, cfg.grpo, cfg.loss_fn
    assert policy.model_name == "tiny-arith" and policy.precision == "float32"
    assert policy.dtensor_cfg.enabled and not policy.megatron_cfg.enabled and not policy.deepspeed_cfg.enabled
    assert (cfg.cluster.gpus_per_node, cfg.cluster.num_nodes) == (2, 1)
    assert policy.generation.backend == "hf" and policy.generation.colocated.enabled
    assert (grpo.num_prompts_per_step, grpo.num_generations_per_prompt, grpo.max_num_steps, grpo.seed) == (4, 4, 3, 7)
    assert (policy.max_seq_length, policy.generation.max_new_tokens, cfg.data.max_input_seq_length) == (32, 8, 24)
    assert (policy.train_micro_batch_size, policy.train_global_batch_size, policy.logprob_batch_size) == (4, 16, 4)
    assert policy.optimizer.kwargs["lr"] == 1e-4 and policy.scheduler[0].name.endswith("LinearLR")
    assert (loss.ratio_clip_min, loss.ratio_clip_max, loss.ratio_clip_c) == (0.2, 0.2, pytest.approx(1.4))
    assert (loss.reference_policy_kl_penalty, loss.kl_estimator, loss.kl_output_clamp_value) == (1e-3, "k3", 10.0)
    assert loss.loss_agg_mode == "token-mean" and grpo.overlong_filtering
    assert (grpo.advantage_clip_low, grpo.advantage_clip_high, grpo.reward_clip) == (-2.0, 2.0, 10)
    assert cfg.data.train_data_path == "data/train.jsonl"
    assert cfg.checkpointing.checkpoint_dir == "./output/checkpoints/tiny-grpo-fsdp2"
    became = "\n".join(cfg.load_notes)
    assert "actor_train (fsdp2_train on 2 device(s)) -> policy: dtensor" in became
    assert "actor_infer (hf_infer on 2 device(s)) -> policy.generation: hf, colocated on the training devices" in became
    assert "reference (hf_infer) -> the frozen reference, on the training backend (dtensor)" in became
    assert "rewards.math_rule (MathRuleRewardWorker) -> reward.function='math_verify'" in became
    assert cfg.reward.function == "math_verify"


def test_validate_on_the_roll_config_lists_what_each_block_became(in_tmp, capsys):
    assert main(["validate", str(ROLL / "tiny_grpo_fsdp2.yaml")]) == 0
    out = capsys.readouterr().out
    assert "# note: ROLL: actor_train (fsdp2_train on 2 device(s)) -> policy: dtensor" in out
    assert "# valid. training backend: dtensor; generation backend: hf" in out


FIVE_DOMAINS = {"code_sandbox": "code_tests", "llm_judge": "llm_judge", "crossthinkqa": "crossthinkqa",
                "ifeval": "ifeval"}


@pytest.mark.parametrize("name, domains", [
    ("qwen3-8B-rlvr_fsdp2.yaml", FIVE_DOMAINS), ("qwen2.5-7B-rlvr_megatron.yaml", FIVE_DOMAINS),
    ("qwen3-30BA3B-rlvr_megatron.yaml", FIVE_DOMAINS), ("qwen2.5-7B-rlvr_megatron_8gpus.yaml", FIVE_DOMAINS),
    ("qwen3-8B-rlvr_megatron.yaml", FIVE_DOMAINS),
    ("qwen2.5-7B-rlvr_megatron_8gpus_llm_as_judge.yaml", {"llm_judge": "llm_judge"}),
])
def test_rolls_own_rlvr_examples_load_as_written(name, domains):
    """Their reward workers (math rule, code sandbox, LLM judge, CrossThinkQA and IFEval rules), the
    domains' mix, the difficulty mask and their chat-message rows are all read."""
    cfg = load_config(ROLL / name)
    math = len(domains) > 1  # the judge-only example has no math rule: its other rows are not drawn
    assert (cfg.reward.default_domain, cfg.reward.function) == (("math_rule", "math_verify") if math else
                                                                ("default", "exact_match"))
    assert {n: d.function for n, d in cfg.reward.domains.items()} == domains
    judge = "virtuoussy/Qwen2.5-7B-Instruct-RLVR" if math else cfg.policy.model_name  # ${pretrain}: the policy's
    assert cfg.reward.judge.model_name == judge and cfg.reward.judge.backend == "vllm"
    assert cfg.grpo.difficulty_mask.enabled and set(cfg.data.domain_interleave_probs) <= {"math_rule", *domains}
    assert (cfg.data.input_key, cfg.data.output_key) == ("messages", "ground_truth")


def test_rolls_separate_example_is_refused_for_its_placement_alone():
    lines = error_of(ROLL / "qwen2.5-7B-rlvr_megatron_separate.yaml").splitlines()
    assert len(lines) == 3 and lines[1].startswith("  - 'actor_infer.device_mapping': 4 devices on a 2-node cluster")
    assert lines[2].startswith("  - 'rewards.llm_judge.device_mapping': 4 devices on a 2-node cluster")


def test_device_mappings_become_placement():
    base = {"pretrain": "tiny-arith", "num_gpus_per_node": 8, "adv_estimator": "grpo",
            "actor_train": {"strategy_args": {"strategy_name": "fsdp2_train"}, "device_mapping": "list(range(0,16))"},
            "actor_infer": {"strategy_args": {"strategy_name": "vllm"}, "device_mapping": "list(range(16,24))"}}
    cfg = load_config(base)  # disjoint: dedicated, one whole node of three
    assert (cfg.cluster.num_nodes, cfg.policy.generation.colocated.enabled) == (3, False)
    assert cfg.policy.generation.colocated.resources.num_nodes == 1
    one_node = {**base, "actor_train": {**base["actor_train"], "device_mapping": "list(range(0,6))"},
                "actor_infer": {**base["actor_infer"], "device_mapping": [6, 7]}}
    cfg = load_config(one_node)
    assert cfg.cluster.num_nodes == 1 and cfg.policy.generation.colocated.resources.gpus_per_node == 2
    partly = {**base, "actor_infer": {**base["actor_infer"], "device_mapping": "list(range(12,20))"}}
    assert "shares 4 of its 8 devices with actor_train" in error_of(partly)
    half_node = {**base, "actor_infer": {**base["actor_infer"], "device_mapping": "list(range(16,20))"}}
    assert "dedicated generation on several nodes takes whole nodes" in error_of(half_node)


def test_fsdp2_settings_are_used_or_said_not_to_be():
    def fsdp2(**strategy_config):
        return load_config({"pretrain": "tiny-arith", "adv_estimator": "grpo", "actor_train": {
            "strategy_args": {"strategy_name": "fsdp2_train", "strategy_config": strategy_config},
            "device_mapping": [0]}})

    cfg = fsdp2(param_dtype="bf16", offload_policy=True, reshard_after_forward=True)  # what novarl does
    assert (cfg.policy.precision, cfg.policy.dtensor_cfg.cpu_offload, cfg.load_warnings) == ("bfloat16", True, ())
    warned = fsdp2(reshard_after_forward=False, use_batched_model_update=False, wrap_policy={"x": 1}).load_warnings
    where = "actor_train.strategy_args.strategy_config."
    assert [w.split(":")[0] for w in warned] == [f"{where}reshard_after_forward=False",
                                                 f"{where}use_batched_model_update=False", f"{where}wrap_policy={{'x'"]
    assert all("accepted and not used" in w for w in warned)


def test_a_judges_device_mapping_apart_from_the_policys_is_counted_as_its_own():
    """ROLL's judge on devices no policy role uses -> reward.judge.resources (NeMo RL's accounting: the
    policy gets the rest); on devices the policy's roles use too (ROLL time-shares them, as all its
    examples do) -> the judge in the driver's process, said once."""
    from novarl.backends.generation.layout import reward_devices

    tree = yaml.safe_load((ROLL / "qwen2.5-7B-rlvr_megatron_8gpus_llm_as_judge.yaml").read_text())
    shared = load_config(tree)
    assert shared.reward.judge.resources.gpus_per_node is None
    assert any("rewards.llm_judge: the LLM judge runs in the driver's process: its devices are the policy's too"
               in w for w in shared.load_warnings)
    for role in ("actor_train", "reference"):
        tree[role]["device_mapping"] = "list(range(0,6))"
    apart = load_config(tree)  # the judge's devices 6 and 7 are no role's
    assert apart.reward.judge.resources.gpus_per_node == 2 and apart.cluster.num_nodes == 1
    assert reward_devices(apart) == (6, 1)  # the policy and generation: the other 6 of the node's 8
    assert any("rewards.llm_judge.device_mapping -> reward.judge.resources: 2 device(s) of its own" in note
               for note in apart.load_notes)


def test_rolls_chat_message_rows_are_read(in_tmp):
    rows = [{"messages": [{"role": "user", "content": f"{a}+1="}], "ground_truth": str(a + 1), "tag": "math"}
            for a in range(10, 20)]
    (in_tmp / "data" / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tree = {"pretrain": "tiny-arith", "adv_estimator": "grpo", "response_length": 8, "prompt_length": 24,
            "actor_train": {"strategy_args": {"strategy_name": "fsdp2_train"}, "device_mapping": [0],
                            "data_args": {"file_name": "data/chat.jsonl", "messages": "messages"}}}
    cfg = load_config(tree)
    assert (cfg.data.input_key, cfg.data.output_key) == ("messages", "ground_truth")
    from novarl.data.datasets import load_examples

    examples = load_examples(cfg.data, "train")
    assert examples[0].prompt == ({"role": "user", "content": "10+1="},) and examples[0].answer == "11"


def test_device_mapping_forms():
    assert parse_devices("list(range(0,16))", "x") == tuple(range(16))
    assert parse_devices("list(range(4))", "x") == (0, 1, 2, 3)
    assert parse_devices("list([0,1,2,3,8,9,10,11])", "x") == (0, 1, 2, 3, 8, 9, 10, 11)
    assert parse_devices([2, 3], "x") == (2, 3)
    with pytest.raises(ValueError, match="a device mapping is a list of GPU indices"):
        parse_devices("__import__('os')", "x")


def test_megatron_strategy_config_is_checked_key_by_key():
    tree = {"pretrain": "tiny-arith", "adv_estimator": "grpo", "num_gpus_per_node": 8,
            "actor_train": {"strategy_args": {"strategy_name": "megatron_train", "strategy_config": {
                "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2,
                "sequence_parallel": True, "recompute_granularity": "full", "bf16": True, "no_such_key": 1}},
                "device_mapping": "list(range(0,8))"}}
    msg = error_of(tree)
    assert "unknown key 'actor_train.strategy_args.strategy_config.no_such_key' (megatron_train)" in msg
    del tree["actor_train"]["strategy_args"]["strategy_config"]["no_such_key"]
    mc = load_config(tree).policy.megatron_cfg
    assert mc.enabled and (mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size,
                           mc.expert_model_parallel_size) == (2, 2, 2)
    assert mc.sequence_parallel and mc.recompute_granularity == "full"


def test_novarl_overrides_apply_over_a_roll_config(in_tmp):
    cfg = load_config(ROLL / "tiny_grpo_fsdp2.yaml", overrides=["grpo.max_num_steps=1", "policy.generation.top_k=5"])
    assert cfg.grpo.max_num_steps == 1 and cfg.policy.generation.top_k == 5


def test_the_roll_config_trains(in_tmp, capsys):
    """The whole path: ROLL's blocks -> 2 DTensor ranks over Ray with colocated HF engines, a
    KL-penalised reference, dual clipping and clipped advantages, on the bundled tiny model."""
    pytest.importorskip("ray")
    code = main(["train", str(ROLL / "tiny_grpo_fsdp2.yaml"), "logger.progress_bar=false", "grpo.max_num_steps=2",
                 "grpo.val_at_start=false", "grpo.max_val_samples=4"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert "[novarl] note: ROLL: actor_train (fsdp2_train on 2 device(s)) -> policy: dtensor" in captured.err
    assert "training backend: dtensor; generation backend: hf" in captured.err
    assert (in_tmp / "output" / "checkpoints" / "tiny-grpo-fsdp2").is_dir()


@pytest.mark.parametrize("change, expected", [
    ({"prompt_length": "abc"}, "'prompt_length' = 'abc': it must be a positive whole number."),
    ({"num_gpus_per_node": 0}, "'num_gpus_per_node' = 0: it must be a positive whole number."),
    ({"advantage_clip": [1]}, "'advantage_clip' = [1]: it must be a positive number."),
    ({"actor_train": {"strategy_args": 5, "device_mapping": [0]}}, "a ROLL setting has a value of the wrong type"),
    ({"actor_train": {"strategy_args": {"strategy_name": "fsdp2_train"}, "device_mapping": "list(range(3,3))"}},
     "a device mapping is a list of GPU indices"),
])
def test_bad_roll_values_are_refused_naming_the_key(change, expected):
    tree = {"pretrain": "tiny-arith", "adv_estimator": "grpo", "response_length": 8,
            "actor_train": {"strategy_args": {"strategy_name": "fsdp2_train"}, "device_mapping": "list(range(0,2))"},
            **change}
    assert expected in error_of(tree)


def test_rolls_lora_arguments_become_lora_cfg():
    def lora_of(**model_args):
        tree = {"pretrain": "tiny-arith", "adv_estimator": "grpo", "response_length": 8,
                "actor_train": {"strategy_args": {"strategy_name": "fsdp2_train"}, "device_mapping": [0],
                                "model_args": model_args}}
        return load_config(tree).policy.dtensor_cfg.lora_cfg

    assert not lora_of(lora_rank=16).enabled  # ROLL turns LoRA on with lora_target
    lora = lora_of(lora_target="all", lora_rank=16)
    assert lora.enabled and lora.match_all_linear and (lora.dim, lora.alpha, lora.dropout) == (16, 32, 0)
    lora = lora_of(lora_target="q_proj, v_proj", lora_alpha=8, lora_dropout=0.05)
    assert not lora.match_all_linear and lora.target_modules == ["q_proj", "v_proj"]
    assert (lora.dim, lora.alpha, lora.dropout, lora.dropout_position) == (8, 8, 0.05, "pre")
    tree = {"pretrain": "tiny-arith", "adv_estimator": "grpo", "response_length": 8,
            "actor_train": {"strategy_args": {"strategy_name": "fsdp2_train"}, "device_mapping": [0],
                            "model_args": {"lora_target": ".*proj$", "adapter_name_or_path": "x"}}}
    message = error_of(tree)
    assert "'actor_train.model_args.lora_target' = '.*proj$'" in message
    assert "'actor_train.model_args.adapter_name_or_path' = 'x'" in message


@pytest.mark.parametrize("keys, estimator, normalize", [
    ({"adv_estimator": "reinforce", "whiten_advantages": True}, ("reinforce_plus_plus", False), True),
    ({"adv_estimator": "reinforce", "whiten_advantages": True, "norm_mean_type": "group"},
     ("reinforce_plus_plus", True), True),
    ({"adv_estimator": "reinforce", "norm_mean_type": "group", "norm_std_type": "group"}, ("grpo", True), True),
    ({"adv_estimator": "reinforce", "norm_mean_type": "group"}, ("grpo", True), False),
    ({"adv_estimator": "grpo"}, ("grpo", True), True),
])
def test_rolls_advantage_settings_become_an_estimator(keys, estimator, normalize):
    tree = {"pretrain": "tiny-arith", "response_length": 8, **keys,
            "actor_train": {"strategy_args": {"strategy_name": "fsdp2_train"}, "device_mapping": [0]}}
    grpo = load_config(tree).grpo
    assert (grpo.adv_estimator.name, grpo.adv_estimator.minus_baseline) == estimator
    assert grpo.normalize_rewards is normalize
    batch_mean = {**tree, "adv_estimator": "reinforce", "norm_mean_type": "batch"}
    assert "'norm_mean_type' = 'batch'" in error_of(batch_mean)
    assert "'gamma' = 0.99: novarl's group-baseline returns are undiscounted" in error_of({**tree, "gamma": 0.99})


# ------------------------------------------------------------------ PPO: ROLL's gae and its critic
def test_seed_003_blocks_as_printed_validate_as_ppo_with_a_critic_like_the_policy(in_tmp, hub_cache, capsys):
    """Seed 003's two blocks exactly as printed, with the model ROLL's example of them names:
    ROLL's default estimator (gae) becomes PPO with a critic built like the policy (the file
    has no critic block), the reference's own layout and grouped GEMM are said, not dropped."""
    from tests.test_config import SEED_003_ROLES

    (in_tmp / "s003.yaml").write_text("pretrain: Qwen/Qwen3-30B-A3B\n" + SEED_003_ROLES)
    assert main(["validate", str(in_tmp / "s003.yaml")]) == 0
    out = capsys.readouterr().out
    for line in ("# note: ROLL: actor_train (megatron_train on 32 device(s)) -> policy: megatron (tp 2, pp 2, cp 1, ep 4)",
                 "# note: ROLL: reference (megatron_infer) -> the frozen reference, on the training backend (megatron)",
                 "# note: ROLL: critic (no critic block; adv_estimator gae) -> value: a critic built like the policy, on "
                 "the policy's model ('Qwen/Qwen3-30B-A3B') with a scalar head, on the training backend (megatron: tp 2, "
                 "pp 2, cp 1, ep 4), the policy's ranks and settings",
                 "# warning: reference: its strategy_config (tensor_model_parallel_size=1, pipeline_model_parallel_size=1, "
                 "expert_model_parallel_size=4, moe_token_dispatcher_type='alltoall', moe_grouped_gemm=true): the "
                 "reference runs on the training backend's layout (actor_train's megatron_train: tp 2, pp 2, cp 1, ep 4)",
                 "# warning: actor_train.strategy_args.strategy_config.moe_grouped_gemm=true: novarl runs the experts as "
                 "megatron-core's SequentialMLP"):
        assert sum(line in o for o in out.splitlines()) == 1, (line, out[-3000:])
    assert "\nvalue:\n  model_name: Qwen/Qwen3-30B-A3B\n" in out and "    name: gae\n" in out


PPO_TREE = {"pretrain": "tiny-arith", "response_length": 8, "num_gpus_per_node": 2, "lambd": 0.9, "gamma": 0.99,
            "whiten_advantages": True, "value_clip": 0.5, "critic_warmup": 2,
            "actor_train": {"strategy_args": {"strategy_name": "fsdp2_train"}, "device_mapping": "list(range(0,2))",
                            "training_args": {"learning_rate": 1e-5}},
            "critic": {"strategy_args": {"strategy_name": "fsdp2_train", "strategy_config": {"param_dtype": "bf16"}},
                       "device_mapping": "list(range(0,2))", "model_args": {"dtype": "bf16", "model_type": "trl"},
                       "training_args": {"learning_rate": 2e-5, "per_device_train_batch_size": 4},
                       "infer_batch_size": 3}}


def test_rolls_gae_and_critic_block_become_ppo_with_the_critic_beside_the_policy():
    cfg = load_config(PPO_TREE)
    gae = cfg.grpo.adv_estimator
    assert (gae.name, gae.gae_lambda, gae.gae_gamma, gae.normalize_advantages) == ("gae", 0.9, 0.99, True)
    assert cfg.value_loss_fn.cliprange == 0.5 and cfg.grpo.policy_training_start_step == 2
    value = cfg.value
    assert (value.model_name, value.precision, value.optimizer.kwargs["lr"]) == ("tiny-arith", "bfloat16", 2e-5)
    assert (value.train_micro_batch_size, value.logprob_batch_size, cfg.policy.optimizer.kwargs["lr"]) == (4, 3, 1e-5)
    assert "ROLL: critic (fsdp2_train) -> value: the critic, on the policy's model ('tiny-arith')" in cfg.load_notes[-1]
    assert load_config({**PPO_TREE, "value_clip": None}).value_loss_fn.cliprange is None  # ROLL: no clip
    # the critic runs on the policy's backend, ranks and devices: another strategy is refused, other devices said
    other = {**PPO_TREE, "critic": {**PPO_TREE["critic"], "strategy_args": {"strategy_name": "deepspeed_train"},
                                    "device_mapping": "list(range(2,4))", "worker_cls": "my.Critic"}}
    message = error_of(other)
    assert "'critic.strategy_args.strategy_name' = 'deepspeed_train': novarl's critic runs on the policy's" in message
    assert "'critic.worker_cls' = 'my.Critic'" in message
    cfg = load_config({**PPO_TREE, "critic": {**PPO_TREE["critic"], "device_mapping": "list(range(2,4))"}})
    assert "critic: its device_mapping differs from actor_train's" in cfg.load_warnings[-1]
    # without gae, the critic block and the critic's keys are said once, not used
    cfg = load_config({**PPO_TREE, "adv_estimator": "grpo", "whiten_advantages": False, "gamma": 1})
    assert cfg.value is None and cfg.load_warnings == (
        "ROLL settings accepted and not used: lambd, value_clip, critic_warmup (read with adv_estimator: gae (PPO "
        "with a critic), and this file's is 'grpo')",
        "critic: ROLL trains a critic only with adv_estimator: gae, and this file's is 'grpo'; the block is not used")
    assert "'norm_mean_type' = 'group': with adv_estimator gae novarl reads each reward as it is" in error_of(
        {**PPO_TREE, "norm_mean_type": "group"})


def test_the_critic_blocks_run_settings_are_said_not_dropped():
    """The critic block is translated as a training role and only its `policy` settings become
    `value`: what it sets elsewhere (training_args.num_train_epochs, the run's epochs) is named
    in the block's warning; a reward_pretrain beside the critic's own model is said too."""
    training = {**PPO_TREE["critic"]["training_args"], "num_train_epochs": 3}
    cfg = load_config({**PPO_TREE, "critic": {**PPO_TREE["critic"], "training_args": training}})
    assert cfg.load_warnings == ("critic: training_args.num_train_epochs=3: the run's epochs (grpo.max_num_epochs) "
                                 "are actor_train's; the critic trains at every step the policy does",)
    assert cfg.grpo.max_num_epochs == load_config(PPO_TREE).grpo.max_num_epochs  # actor_train's, not the critic's
    model_args = {**PPO_TREE["critic"]["model_args"], "model_name_or_path": "tiny-arith"}
    cfg = load_config({**PPO_TREE, "reward_pretrain": "someorg/reward",
                       "critic": {**PPO_TREE["critic"], "model_args": model_args}})
    assert cfg.load_warnings == ("reward_pretrain='someorg/reward' is not used: the critic is critic.model_args."
                                 "model_name_or_path ('tiny-arith'), and novarl has no reward-model role (its math "
                                 "rule reward, reward.function, loads no model)",)


def test_reward_pretrain_without_gae_is_said_as_rolls_reward_model():
    """ROLL's own examples set reward_pretrain with adv_estimator: reinforce: the model its reward
    workers load. The warning says novarl has no reward-model role, not only that gae reads it."""
    tree = {"pretrain": "tiny-arith", "response_length": 8, "adv_estimator": "reinforce", "norm_mean_type": "group",
            "reward_pretrain": "Qwen/Qwen2.5-7B",
            "actor_train": {"strategy_args": {"strategy_name": "fsdp2_train"}, "device_mapping": [0]}}
    assert load_config(tree).load_warnings == (
        "ROLL settings accepted and not used: reward_pretrain (the model ROLL's reward workers and its critic load: "
        "novarl has no reward-model role (its math rule reward, reward.function, loads no model) and builds a critic "
        "on it only with adv_estimator: gae, and this file's is 'reinforce')",)
