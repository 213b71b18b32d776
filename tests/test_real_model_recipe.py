"""A real model with no config: the recipe it starts from (NeMo RL's grpo_math_1B sizes),
fitted to this host with a line for each change; the cluster `tensor_parallel_size=` sizes
from this host's GPUs; a hub id that is not cached, from Python."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import novarl
import novarl.trainer.starting as starting
from novarl.cli import _config, build_parser
from novarl.config import load_config
from novarl.errors import ConfigError, UserError
from novarl.backends.contract.checks import check_config
from novarl.backends.contract.resolve import installed, plan_batches
from tests.helpers.tiny_chatml import build_tiny_chatml_qwen2

RECIPE_LINE = "recipe: grpo_real_model (NeMo RL grpo_math_1B's sizes) for policy.model_name="


def config_only(folder: Path, *, hidden_size: int, num_attention_heads: int, max_position_embeddings: int) -> Path:
    """A model folder holding only config.json (all that the start reads: no weights are loaded)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": 1, "num_hidden_layers": 2,
        "intermediate_size": 2 * hidden_size, "vocab_size": 259, "max_position_embeddings": max_position_embeddings}))
    return folder


@pytest.fixture
def gpus(monkeypatch):
    """Set how many CUDA devices this host reports: gpus(8)."""
    return lambda count: monkeypatch.setattr(starting, "cuda_device_count", lambda: count)


@pytest.mark.slow
def test_a_local_model_runs_three_steps_from_the_real_model_recipe(tmp_path, monkeypatch, capsys):
    """novarl.train on a folder with no config: NeMo RL's sizes (512 tokens), vLLM asked for and
    Hugging Face used, with the reason, where vLLM cannot run the model; the log names the recipe;
    the batch is cut down by keywords only, to keep the test short."""
    monkeypatch.chdir(tmp_path)
    model = build_tiny_chatml_qwen2(tmp_path / "my_model", max_position_embeddings=1024)  # head_dim 16
    rows = [{"prompt": f"What is {a}+{b}? Put the answer in \\boxed{{}}.", "answer": str(a + b)}
            for a in range(6) for b in range(4)]
    result = novarl.train(model=str(model), dataset=rows, reward_fn=lambda c, a: float(a in c),
                          max_num_steps=3, num_prompts_per_step=4, num_generations_per_prompt=4,
                          policy__generation__max_new_tokens=16, grpo__max_val_samples=8, grpo__val_batch_size=8,
                          log_dir=str(tmp_path / "logs"), logger__progress_bar=False)
    log = capsys.readouterr().err
    assert result.steps == 3 and result.model_dir.is_dir()
    assert f"note: {RECIPE_LINE}{model}" in log
    if installed("vllm"):
        assert "generation on Hugging Face, not vLLM: vLLM's CPU attention runs head sizes 32, 64" in log
        assert "this model's head_dim is 16" in log
    assert "training backend: dtensor; generation backend: hf" in log
    saved = load_config(result.output_dir / "config.yaml")
    policy = saved.policy
    assert policy.max_seq_length == 512 >= 512 and policy.generation.vllm_cfg.max_model_len is None
    assert (policy.optimizer.kwargs["lr"], policy.train_micro_batch_size, saved.loss_fn.reference_policy_kl_penalty,
            saved.grpo.use_leave_one_out_baseline, policy.generation.colocated.enabled) == (5e-6, 4, 0.01, True, True)
    assert (saved.grpo.num_prompts_per_step, saved.grpo.max_num_steps) == (4, 3)  # the keywords on top
    # the recipe's checkpointing stays inside novarl.train's run folder, not results/grpo here
    assert (result.output_dir / "checkpoints" / "step_3").is_dir() and not (tmp_path / "results").exists()


def test_the_recipe_keeps_vllm_where_it_runs_and_fits_the_models_positions(tmp_path, gpus):
    gpus(0)
    head64 = config_only(tmp_path / "head64", hidden_size=128, num_attention_heads=2, max_position_embeddings=1024)
    short = config_only(tmp_path / "short", hidden_size=128, num_attention_heads=2, max_position_embeddings=256)
    cfg = novarl.GRPOTrainer.from_pretrained(str(head64)).config
    assert (cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt) == (32, 16)
    assert plan_batches(cfg).global_batch_size == 512
    assert (cfg.policy.max_seq_length, cfg.policy.generation.max_new_tokens) == (512, 512)
    assert cfg.policy.generation.backend == ("vllm" if installed("vllm") else "hf")
    assert cfg.policy.precision is None  # bf16 on a GPU, fp32 here: the line says which
    assert "recipe: precision float32 on this host without a GPU (bfloat16, NeMo RL's, on GPUs)" in cfg.load_notes

    short = novarl.GRPOTrainer.from_pretrained(str(short)).config
    assert (short.policy.max_seq_length, short.policy.generation.max_new_tokens) == (256, 256)
    assert any(n.startswith("recipe: policy.max_seq_length 512 -> 256, the model's max_position_embeddings")
               for n in short.load_notes)
    # what the user sets is never changed
    head16 = config_only(tmp_path / "head16", hidden_size=64, num_attention_heads=4, max_position_embeddings=256)
    mine = novarl.GRPOTrainer.from_pretrained(str(head16), max_seq_length=200,
                                              policy__generation__backend="vllm").config
    assert (mine.policy.max_seq_length, mine.policy.generation.backend) == (200, "vllm")
    assert not any("max_seq_length 512" in n or "not vLLM" in n for n in mine.load_notes)


def test_bundled_models_and_given_configs_keep_their_own_start(tmp_path):
    tiny = novarl.GRPOTrainer.from_pretrained("tiny-arith").config
    assert tiny.policy.max_seq_length == 16 and tiny.load_notes[0].startswith("recipe: tiny_arith")
    given = novarl.GRPOTrainer({"policy": {"model_name": "someorg/somemodel"}}, max_num_steps=5).config
    assert given.policy.max_seq_length == 512 and given.policy.generation.backend is None  # the schema's
    assert given.grpo.max_num_steps == 5 and not given.load_notes


def test_the_cli_without_a_config_starts_from_the_recipe(tmp_path):
    model = config_only(tmp_path / "m", hidden_size=128, num_attention_heads=2, max_position_embeddings=1024)
    args = build_parser().parse_args(["train", f"policy.model_name={model}", "grpo.max_num_steps=7"])
    cfg = _config(args)  # what `novarl train` / `validate` / `plan` run on
    assert f"{RECIPE_LINE}{model}" in cfg.load_notes
    assert (cfg.policy.max_seq_length, cfg.grpo.max_num_steps, cfg.data.dataset_name) == (512, 7, "word_problems")
    own = _config(build_parser().parse_args(["train", f"policy.model_name={model}",
                                             "data.train_data_path=my.jsonl"]))
    assert own.data.dataset_name is None  # the recipe's bundled task gives way to the user's file
    assert _config(build_parser().parse_args(["train"])).policy.max_seq_length == 16


def test_tensor_parallel_size_takes_the_hosts_gpus(hub_cache, monkeypatch, gpus):
    """Seed 000's GRPOTrainer.from_pretrained("Qwen/Qwen2.5-32B", tensor_parallel_size=8): the
    config only (nothing is downloaded)."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing reaches the network (nothing tries)
    gpus(8)
    cfg = novarl.GRPOTrainer.from_pretrained("Qwen/Qwen2.5-32B", tensor_parallel_size=8).config
    assert (cfg.cluster.gpus_per_node, cfg.cluster.num_nodes) == (8, 1)
    assert cfg.policy.dtensor_cfg.tensor_parallel_size == cfg.policy.generation.vllm_cfg.tensor_parallel_size == 8
    report = check_config(cfg)
    assert not report.problems and report.batches.data_parallel_size == 1
    assert ("cluster: gpus_per_node=8, this host's visible GPUs, for tensor_parallel_size=8: 1 data-parallel rank(s) "
            "x 8; vLLM engines of tensor_parallel_size=8") in cfg.load_notes
    assert novarl.GRPOTrainer.from_pretrained("Qwen/Qwen2.5-1.5B", tensor_parallel_size=2).config.cluster.gpus_per_node == 8
    # a cluster the user sizes is theirs; a given config without one is sized too
    theirs = novarl.GRPOTrainer.from_pretrained("Qwen/Qwen2.5-32B", tensor_parallel_size=2, cluster={"gpus_per_node": 4})
    assert theirs.config.cluster.gpus_per_node == 4 and theirs.config.policy.generation.vllm_cfg.tensor_parallel_size == 1
    given = novarl.GRPOTrainer({"policy": {"model_name": "Qwen/Qwen2.5-32B"}}, tensor_parallel_size=4).config
    assert given.cluster.gpus_per_node == 8

    gpus(1)
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size=8 needs 8 devices; this host has 1 GPU \(visible "
                                          r"CUDA devices\). Use a tensor_parallel_size that divides 1 \(1\)"):
        novarl.GRPOTrainer.from_pretrained("Qwen/Qwen2.5-32B", tensor_parallel_size=8)
    gpus(6)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 needs a multiple of 4 devices; this host has 6 "
                                          r"GPUs = 1 x 4 \+ 2 .* divides 6 \(1, 2, 3, 6\)"):
        novarl.GRPOTrainer.from_pretrained("Qwen/Qwen2.5-32B", tensor_parallel_size=4)
    gpus(0)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=8 needs 8 devices; this host has no CUDA GPU\. .*"
                                          r"cluster=\{'gpus_per_node': 8\} to run 8 CPU ranks"):
        novarl.GRPOTrainer.from_pretrained("Qwen/Qwen2.5-32B", tensor_parallel_size=8)
    assert novarl.GRPOTrainer.from_pretrained("Qwen/Qwen2.5-32B", tensor_parallel_size=1).config.cluster.gpus_per_node == 1


def test_an_uncached_hub_id_from_python_is_one_clear_line(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(8)]
    with pytest.raises(UserError) as caught:
        novarl.train(model="someorg/uncached-model", dataset=rows, reward_fn=lambda c, a: 0.0,
                     log_dir=str(hub_cache.parent / "logs"))
    err = caught.value
    message = str(err)
    assert "\n" not in message
    assert message.startswith("policy.model_name='someorg/uncached-model': it is not in the local Hugging Face cache")
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in message
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
    assert not (hub_cache.parent / "logs").exists()


def test_keyword_overrides_nested_too_deep_or_in_themselves_are_refused_before_the_recipe():
    """GRPOTrainer with no config reads the keyword overrides to pick its recipe: a tree that
    load_config refuses is refused there too, the same way (not a RecursionError)."""
    deep = inner = {}
    for _ in range(5_000):
        inner["x"] = {}
        inner = inner["x"]
    with pytest.raises(ConfigError, match=r"^Keyword override policy=: 'policy\.x\.x.*' is nested more than 64 levels"):
        novarl.GRPOTrainer(policy=deep)
    looped: dict = {}
    looped["x"] = looped
    with pytest.raises(ConfigError, match=r"^Keyword override policy=: 'policy\.x' contains itself"):
        novarl.GRPOTrainer(policy=looped)


def test_engines_are_sized_only_when_the_fitted_recipe_generates_on_vllm(tmp_path, monkeypatch, gpus):
    """vLLM absent: the recipe generates on Hugging Face, and tensor_parallel_size= sizes the
    cluster without a vLLM engine size (no line about engines, no warning about vllm_cfg)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    gpus(2)
    model = config_only(tmp_path / "m", hidden_size=128, num_attention_heads=2, max_position_embeddings=256)
    cfg = novarl.GRPOTrainer.from_pretrained(str(model), tensor_parallel_size=2).config
    assert (cfg.policy.generation.backend, cfg.cluster.gpus_per_node) == ("hf", 2)
    assert not any("vllm_cfg" in warning for warning in check_config(cfg).warnings)
    assert "cluster: gpus_per_node=2, this host's visible GPUs, for tensor_parallel_size=2: 1 data-parallel rank(s) " \
           "x 2" in cfg.load_notes
    assert not any("vLLM engines" in n for n in cfg.load_notes)


def test_the_cut_sequence_lengths_reason_names_the_generation_backend_in_force(tmp_path, gpus):
    gpus(0)  # head_dim 16: vLLM's CPU attention refuses it, so the recipe generates on Hugging Face
    head16 = config_only(tmp_path / "head16", hidden_size=64, num_attention_heads=4, max_position_embeddings=256)
    notes = novarl.GRPOTrainer.from_pretrained(str(head16)).config.load_notes
    cut = [n for n in notes if n.startswith("recipe: policy.max_seq_length 512 -> 256")]
    assert cut == ["recipe: policy.max_seq_length 512 -> 256, the model's max_position_embeddings (its positions "
                   "end there); new tokens follow it"]
    head64 = config_only(tmp_path / "head64", hidden_size=128, num_attention_heads=2, max_position_embeddings=256)
    if installed("vllm"):
        assert ("recipe: policy.max_seq_length 512 -> 256, the model's max_position_embeddings (its positions end "
                "there, and vLLM refuses a longer engine); new tokens and the engine follow it"
                ) in novarl.GRPOTrainer.from_pretrained(str(head64)).config.load_notes


def test_tensor_parallel_size_sizes_the_cluster_of_a_loaded_config_too(gpus):
    gpus(8)
    given = {"policy": {"model_name": "someorg/somemodel"}}
    loaded = novarl.GRPOTrainer(load_config(given), tensor_parallel_size=4).config
    assert (loaded.cluster.gpus_per_node, loaded.policy.generation.vllm_cfg.tensor_parallel_size) == (8, 4)
    assert loaded.model_dump() == novarl.GRPOTrainer(given, tensor_parallel_size=4).config.model_dump()


def test_eval_without_a_config_starts_from_the_recipe_for_the_model_it_evaluates(tmp_path):
    from novarl.cli import eval_config

    model = config_only(tmp_path / "m", hidden_size=128, num_attention_heads=2, max_position_embeddings=1024)
    cfg = eval_config(build_parser().parse_args(["eval", str(model), "grpo.max_val_samples=5"]))
    assert f"{RECIPE_LINE}{model}" in cfg.load_notes
    assert (cfg.policy.max_seq_length, cfg.grpo.max_val_samples) == (512, 5)
    assert eval_config(build_parser().parse_args(["eval", "tiny-arith"])).policy.max_seq_length == 16
