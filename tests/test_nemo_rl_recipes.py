"""NeMo RL's own GRPO configs and recipes, as they are (tests/data/nemo_rl: the files of
NVIDIA-NeMo/RL at 7ea279a, 2026-08, and at b50bfca, 2025-09, with their `defaults:` chains),
and the one validation pass: `novarl validate` names every reason `train` would stop, at
once, without torch when the model is not local."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from novarl.cli import main
from novarl.config import load_config
from novarl.backends.contract.resolve import installed
from tests.helpers.hub import cache_snapshot, parquet_bytes

NEMO_RL = Path(__file__).parent / "data" / "nemo_rl"

# file -> the layout `novarl plan` must print: what the file (with its bases) asks for.
LAYOUTS = {
    "2026-08/grpo_math_1B.yaml": "1 training rank(s) of 1 node(s) x 1 = dtensor dp 1 x tp 1 x cp 1; generation: 1 vllm "
                                 "engine(s) x tp=1, in this process beside the policy",
    "2026-08/ppo_math_1B.yaml": "1 training rank(s) of 1 node(s) x 1 = dtensor dp 1 x tp 1 x cp 1; generation: 1 vllm "
                                "engine(s) x tp=1, in this process beside the policy",
    "2026-08/grpo_math_8B.yaml": "8 training rank(s) of 1 node(s) x 8 = dtensor dp 8 x tp 1 x cp 1; generation: 8 vllm "
                                 "engine(s) x tp=1, colocated with policy ranks 0-7",
    "2026-08/grpo_math_1B_megatron.yaml": "1 training rank(s) of 1 node(s) x 1 = megatron dp 1 x tp 1 x pp 1 x cp 1; "
                                          "generation: 1 vllm engine(s) x tp=1, in this process beside the policy",
    "2026-08/grpo_math_8B_megatron.yaml": "8 training rank(s) of 1 node(s) x 8 = megatron dp 4 x tp 1 x pp 2 x cp 1; "
                                          "generation: 8 vllm engine(s) x tp=1, colocated with policy ranks 0-7",
    "2026-08/grpo_math_8B_megatron_fp8.yaml": "8 training rank(s) of 1 node(s) x 8 = megatron dp 4 x tp 1 x pp 2 x cp "
                                              "1; generation: 8 vllm engine(s) x tp=1, colocated with policy ranks 0-7",
    "2026-08/grpo_math_70B_megatron.yaml": "64 training rank(s) of 8 node(s) x 8 = megatron dp 4 x tp 4 x pp 4 x cp 1; "
                                           "generation: 8 vllm engine(s) x tp=8, colocated with policy ranks 0-63",
    "2026-08/grpo_math_qwen30ba3b_megatron.yaml": "64 training rank(s) of 8 node(s) x 8 = megatron dp 32 x tp 2 x pp 1 "
                                                  "x cp 1, ep 8; generation: 16 vllm engine(s) x tp=4, colocated with "
                                                  "policy ranks 0-63",
    "2026-08/recipes/llm/grpo-llama3.1-8b-instruct-2n4g-fsdp2tp1-noncolocated.yaml":
        "4 training rank(s) of 2 node(s) x 4 = dtensor dp 4 x tp 1 x cp 1; generation: 4 vllm engine(s) x tp=1, "
        "dedicated: 1 node(s) x 4 GPU(s) apart from the policy's 4 rank(s)",
    "2026-08/recipes/llm/grpo-qwen2.5-7b-instruct-4n4g-fsdp2tp2.v3.yaml":
        "16 training rank(s) of 4 node(s) x 4 = dtensor dp 8 x tp 2 x cp 1; generation: 8 vllm engine(s) x tp=2, "
        "colocated with policy ranks 0-15",
    "2026-08/recipes/llm/grpo-qwen2.5-7b-instruct-4n8g-megatron.yaml":
        "32 training rank(s) of 4 node(s) x 8 = megatron dp 16 x tp 2 x pp 1 x cp 1; generation: 8 vllm engine(s) x "
        "tp=4, colocated with policy ranks 0-31",
    "2026-08/recipes/llm/grpo-qwen3-30ba3b-8n8g-megatron.yaml":
        "64 training rank(s) of 8 node(s) x 8 = megatron dp 4 x tp 4 x pp 4 x cp 1, ep 4; generation: 16 vllm "
        "engine(s) x tp=4, colocated with policy ranks 0-63",
    "2026-08/recipes/llm/grpo-gemma3-27b-it-8n8g-fsdp2tp8-actckpt-long.yaml":
        "64 training rank(s) of 8 node(s) x 8 = dtensor dp 8 x tp 8 x cp 1; generation: 16 vllm engine(s) x tp=4, "
        "colocated with policy ranks 0-63",
    # DAPO: dynamic sampling, reward scaling and shaping, its answer checker, hf_config_overrides
    "2026-08/recipes/llm/dapo-qwen2.5-7b.v2.yaml":
        "128 training rank(s) of 16 node(s) x 8 = dtensor dp 32 x tp 1 x cp 4; generation: 64 vllm engine(s) x tp=2, "
        "colocated with policy ranks 0-127",
    "2026-08/recipes/llm/grpo-llama3.2-1b-instruct-1n8g-megatron_generation.yaml":
        "8 training rank(s) of 1 node(s) x 8 = megatron dp 8 x tp 1 x pp 1 x cp 1; generation: megatron on the "
        "policy's 8 rank(s) (the policy's own model, no weight sync)",
    "2025-09/grpo_math_1B.yaml": "1 training rank(s) of 1 node(s) x 1 = dtensor dp 1 x tp 1 x cp 1; generation: 1 vllm "
                                 "engine(s) x tp=1, in this process beside the policy",
    "2025-09/grpo_math_8B.yaml": "8 training rank(s) of 1 node(s) x 8 = dtensor dp 8 x tp 1 x cp 1; generation: 8 vllm "
                                 "engine(s) x tp=1, colocated with policy ranks 0-7",
    "2025-09/grpo_math_1B_megatron.yaml": "1 training rank(s) of 1 node(s) x 1 = megatron dp 1 x tp 1 x pp 1 x cp 1; "
                                          "generation: 1 vllm engine(s) x tp=1, in this process beside the policy",
    "2025-09/grpo_math_70B_megatron.yaml": "64 training rank(s) of 8 node(s) x 8 = megatron dp 4 x tp 4 x pp 4 x cp 1; "
                                           "generation: 8 vllm engine(s) x tp=8, colocated with policy ranks 0-63",
    "2025-09/grpo_math_qwen30ba3b_megatron.yaml": "64 training rank(s) of 8 node(s) x 8 = megatron dp 32 x tp 2 x pp 1 "
                                                  "x cp 1, ep 8; generation: 16 vllm engine(s) x tp=4, colocated with "
                                                  "policy ranks 0-63",
    "2025-09/recipes/llm/grpo-deepscaler-1.5b-8K.yaml":
        "8 training rank(s) of 1 node(s) x 8 = dtensor dp 8 x tp 1 x cp 1; generation: 8 vllm engine(s) x tp=1, "
        "colocated with policy ranks 0-7",
    "2025-09/recipes/llm/grpo-llama3.1-8b-instruct-2n8g-fsdp2tp1-noncolocated.yaml":
        "8 training rank(s) of 2 node(s) x 8 = dtensor dp 8 x tp 1 x cp 1; generation: 8 vllm engine(s) x tp=1, "
        "dedicated: 1 node(s) x 8 GPU(s) apart from the policy's 8 rank(s)",
    "2025-09/recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml":
        "32 training rank(s) of 4 node(s) x 8 = megatron dp 8 x tp 1 x pp 4 x cp 1, ep 4; generation: 32 vllm "
        "engine(s) x tp=1, colocated with policy ranks 0-31",
    "2025-09/recipes/llm/grpo-qwen2.5-7b-instruct-4n8g-megatron.yaml":
        "32 training rank(s) of 4 node(s) x 8 = megatron dp 16 x tp 2 x pp 1 x cp 1; generation: 8 vllm engine(s) x "
        "tp=4, colocated with policy ranks 0-31",
}


def _spanning(layout: str) -> str:
    """A colocated vLLM engine of tp > 1 spans tp policy ranks; the layout line says so."""
    found = re.search(r"x tp=(\d+), colocated with policy ranks [0-9-]+$", layout)
    tp = int(found.group(1)) if found else 1
    return layout + (f", each spanning {tp} of them (a tensor-parallel shard in each rank's process)"
                     if tp > 1 else "")


LAYOUTS = {name: _spanning(layout) for name, layout in LAYOUTS.items()}

# file -> the refusals (one line each) of features novarl does not build.
CISPO_RECIPE = "2026-08/recipes/llm/grpo-cispo-mm1-async-lag1-highoffpolicy-qwen3-30ba3b-3n8g-megatron-cispo.yaml"
REFUSED = {
    "2026-08/grpo_math_1B_sglang.yaml": ["'policy.generation.backend' = 'sglang': SGLang generation is not built"],
    CISPO_RECIPE: ["'grpo.async_grpo.in_flight_weight_updates' = true: in-flight weight updates"],  # CISPO is read
}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(autouse=True)
def online_host(monkeypatch, tmp_path):
    """validate and plan read local files only (nothing reaches the network), here as on a host
    that may download: without HF_HUB_OFFLINE a hub model or dataset not cached is a note
    (`novarl train` downloads it); with it, a problem. The checks' folders are writable ones."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_nemo_rl_files_load_as_written_and_plan_prints_their_layout(capsys, name):
    cfg = load_config(NEMO_RL / name)
    # what loading warns about is said once, a line each
    assert len(set(cfg.load_warnings)) == len(cfg.load_warnings)
    assert not any("\n" in line for line in cfg.load_warnings)
    # the 2026-08 files all name port ranges: their operational keys come in one line
    operational = sum("NeMo RL setting(s) about ports" in line for line in cfg.load_warnings)
    assert operational == (1 if name.startswith("2026-08") else operational) and operational <= 1
    code, out, err = run(capsys, "plan", str(NEMO_RL / name))
    assert code == 0, err
    layout = [line.removeprefix("layout: ") for line in out.splitlines() if line.startswith("layout: ")]
    assert layout == [LAYOUTS[name]], out


def test_nemo_rl_dapo_recipe_loads_with_what_it_asks():
    cfg = load_config(NEMO_RL / "2026-08/recipes/llm/dapo-qwen2.5-7b.v2.yaml")
    assert cfg.policy.hf_config_overrides == {"max_position_embeddings": 16384}
    assert cfg.reward.function == "dapo_math_verify" and cfg.grpo.use_dynamic_sampling
    assert cfg.grpo.reward_shaping.enabled and cfg.grpo.reward_scaling.target_min == -1.0
    assert (cfg.loss_fn.ratio_clip_max, cfg.loss_fn.ratio_clip_c) == (0.28, 10)
    # 5 % of DAPOMath17K held out (from grpo_math_1B.yaml) beside AIME 2024, evaluated together as NeMo RL does
    assert cfg.data.split_validation_size == 0.05 and cfg.data.val_dataset_name == "DAPOMathAIME2024"


def test_nemo_rl_cispo_recipe_loads_without_in_flight_weight_updates():
    cfg = load_config(NEMO_RL / CISPO_RECIPE, overrides=["grpo.async_grpo.in_flight_weight_updates=false"])
    loss = cfg.loss_fn
    assert loss.use_cispo and (loss.ratio_clip_min, loss.ratio_clip_max) == (1.0, 5.0)  # no lower bound
    assert cfg.grpo.async_grpo.enabled and loss.use_importance_sampling_correction


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_nemo_rl_features_novarl_does_not_build_are_refused_one_line_each(capsys, name):
    code, _, err = run(capsys, "validate", str(NEMO_RL / name))
    assert code == 2 and "Traceback" not in err
    lines = err.splitlines()
    assert lines[0].startswith(f"novarl: error: Invalid config ({NEMO_RL / name}): {len(REFUSED[name])} problem(s):")
    for expected in REFUSED[name]:
        assert sum(line.startswith(f"  - {expected}") for line in lines) == 1, (expected, err)


# NeMo RL's performance switches: loss_fn.force_on_policy_ratio (recipes/llm/performance, added from
# 7ea279a) and FP8 generation, each file -> the overrides it needs here besides a local data file.
PERFORMANCE = {
    "2026-08/recipes/llm/performance/grpo-qwen3-32b-4n8g.yaml": (),
    # as written its engines of tp 16 span two nodes, which novarl's engines do not (refused on its own);
    # its grouped-GEMM experts run as SequentialMLP, with a warning
    "2026-08/recipes/llm/performance/grpo-qwen3-235b-16n8g.yaml":
        ("policy.generation.vllm_cfg.tensor_parallel_size=8",),
    "2026-08/grpo_math_8B_megatron_fp8.yaml": (),
}


@pytest.mark.parametrize("name", sorted(PERFORMANCE))
def test_nemo_rl_performance_recipes_are_valid_for_a_gpu_host(capsys, tmp_path, monkeypatch, name):
    from novarl.backends.generation.vllm import fp8_engine_args

    monkeypatch.setattr("novarl.host.has_cuda", lambda: False)
    (tmp_path / "x.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    data = ("data.dataset_name=ResponseDataset", "data.train_data_path=x.jsonl")
    code, out, err = run(capsys, "validate", str(NEMO_RL / name), *PERFORMANCE[name], *data)
    assert code == 0, err
    comments = [line for line in out.splitlines() if line.startswith("# ")]
    (gpu_host,) = [line for line in comments if line.startswith("# valid for a GPU host")]
    cfg = load_config(NEMO_RL / name, overrides=[*PERFORMANCE[name], *data])
    if "performance" in name:  # the ratio forced, with its one optimizer step per batch
        assert cfg.loss_fn.force_on_policy_ratio and " -> 1 optimizer step(s) of " in comments[0], comments[0]
    else:  # vLLM's online FP8 with NeMo RL's DeepGEMM settings; the sync sends bf16, quantized by vLLM
        assert "policy.generation.vllm_cfg.precision='fp8'" in gpu_host
        assert not any("use_deep_gemm" in line for line in comments)
        assert fp8_engine_args(cfg.policy.generation.vllm_cfg, "unused") == (
            {"quantization": "fp8_per_block"}, {"VLLM_USE_DEEP_GEMM": "1", "VLLM_USE_DEEP_GEMM_E8M0": "0"})
    if PERFORMANCE[name]:
        code, _, err = run(capsys, "validate", str(NEMO_RL / name), *data)
        assert code == 2 and "would span nodes of cluster.gpus_per_node=8" in err and "force_on" not in err, err


def test_validate_on_a_nemo_rl_recipe_names_what_is_left(capsys, tmp_path, hub_cache, monkeypatch):
    # As written, the math recipe names NeMo RL's OpenMathInstruct-2 and Llama-3.1-8B: offline and in no
    # cache, validate names both in one error (train could download neither).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = str(NEMO_RL / "2026-08/grpo_math_8B.yaml")
    code, _, err = run(capsys, "validate", recipe)
    assert code == 2 and err.startswith("novarl: error: 2 problems stop this run:"), err
    assert "  - data.dataset_name='OpenMathInstruct-2' (hub dataset 'nvidia/OpenMathInstruct-2'): it is in no local " \
           "cache" in err and "HF_HUB_OFFLINE is set" in err
    assert "  - policy.model_name='meta-llama/Llama-3.1-8B-Instruct': it is not in the local Hugging Face cache" in err
    # With the dataset in the hub cache (laid out as on the hub: its card names the train_1M split),
    # the model is what is left offline; on a host that may download it, the recipe is valid and a
    # GPU-sized engine layout is said in one line.
    card = ("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n"
            "  - split: train_1M\n    path: data/train_1M-*\n---\n").encode()
    cache_snapshot(hub_cache, "nvidia/OpenMathInstruct-2", {
        "README.md": card, "data/train_1M-00000-of-00001.parquet": parquet_bytes(
            [{"problem": "1+1=", "generated_solution": "...", "expected_answer": "2", "problem_source": "x"}])},
        repo_type="dataset")
    code, _, err = run(capsys, "validate", recipe)
    assert code == 2 and err.startswith("novarl: error: policy.model_name='meta-llama/Llama-3.1-8B-Instruct'"), err
    monkeypatch.delenv("HF_HUB_OFFLINE")
    code, out, err = run(capsys, "validate", recipe)
    assert code == 0, err
    comments = [line for line in out.splitlines() if line.startswith("# ")]
    assert comments[0].startswith("# valid. training backend: dtensor; generation backend: vllm")
    assert any("'meta-llama/Llama-3.1-8B-Instruct' is not in the local Hugging Face cache: `novarl train` downloads"
               in line for line in comments)
    assert any("data.prompt_file='examples/prompts/cot.txt' is not here: reading NeMo RL's cot.txt" in line
               for line in comments)
    assert sum("NeMo RL setting(s) about ports" in line for line in comments) == 1


def test_validate_without_a_local_model_imports_no_torch(tmp_path):
    code = ("import sys; from novarl.cli import main; "
            f"rc = main(['validate', {str(NEMO_RL / '2026-08/grpo_math_70B_megatron.yaml')!r}, "
            "'data.dataset_name=ResponseDataset', 'data.train_data_path=x.jsonl']); "
            "heavy = [m for m in ('torch', 'transformers', 'megatron', 'vllm') if m in sys.modules]; "
            "print(rc, heavy)")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # (validate reads local files only)
    (tmp_path / "x.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=tmp_path)
    # x.jsonl is there; a hub model that is not cached leaves the data's rows for train to read.
    assert out.stdout.strip().splitlines()[-1] == "0 []", out.stdout + out.stderr


def test_validate_lists_every_reason_train_would_stop_at_once(capsys, tmp_path):
    (tmp_path / "blocker").write_text("a file where the log folder should go")
    code, out, err = run(capsys, "validate", "policy.dtensor_cfg.context_parallel_size=2",
                         "grpo.max_rollout_turns=2",
                         f"logger.log_dir={tmp_path / 'blocker' / 'logs'}", "data.train_data_path=missing.jsonl",
                         "data.dataset_name=ResponseDataset", "reward.function=no_such_module:f")
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert lines[0] == "novarl: error: 5 problems stop this run:", err
    assert "1 ranks is not a multiple of policy.dtensor_cfg.tensor_parallel_size x context_parallel_size" in err
    assert "multi-turn rollouts (grpo.max_rollout_turns=2)" in err
    assert "logger.log_dir=" in err and "is a file, so the folder cannot be made there" in err
    assert "data.train_data_path='missing.jsonl': no such file" in err
    assert "reward.function" in err and "no_such_module" in err


# ------------------------------------------------------------------ Megatron pre-flight, before any rank starts
@pytest.fixture
def megatron_on_cpu(monkeypatch):
    monkeypatch.setenv("NOVARL_MEGATRON_ON_CPU", "1")


MEGATRON = ("policy.megatron_cfg.enabled=true", "policy.generation.backend=hf")


@pytest.mark.skipif(installed("transformer_engine"), reason="Transformer Engine is installed: its options run")
def test_transformer_engine_options_are_valid_for_a_gpu_host_and_stop_train_here(capsys, megatron_on_cpu, tmp_path):
    args = (*MEGATRON, "policy.megatron_cfg.apply_rope_fusion=true", "policy.megatron_cfg.moe_permute_fusion=true",
            f"logger.log_dir={tmp_path / 'logs'}")
    code, out, err = run(capsys, "validate", *args)
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if "valid for a GPU host" in line]
    assert ("Transformer Engine (pip install --no-build-isolation 'novarl[te]' on the GPU hosts; NGC's PyTorch images "
            "have it) for policy.megatron_cfg.apply_rope_fusion, "
            "policy.megatron_cfg.moe_permute_fusion") in line
    code, _, err = run(capsys, "train", *args)
    assert code == 2 and "this host lacks Transformer Engine" in err and "Traceback" not in err
    assert not (tmp_path / "logs").exists()
    # grouped-GEMM experts run as SequentialMLP (the converted weights have its names): said once
    code, out, err = run(capsys, "validate", *args, "policy.megatron_cfg.moe_grouped_gemm=true")
    assert code == 0, err
    assert sum("'policy.megatron_cfg.moe_grouped_gemm' = True: novarl runs the experts as megatron-core's "
               "SequentialMLP" in line for line in out.splitlines()) == 1, out


def test_megatron_model_constraints_are_listed_with_the_other_problems(capsys, megatron_on_cpu, tmp_path):
    code, out, err = run(capsys, "validate", *MEGATRON, "policy.precision=float32",
                         "policy.megatron_cfg.pipeline_dtype=bfloat16",
                         "policy.megatron_cfg.expert_model_parallel_size=2", "cluster.gpus_per_node=2",
                         "reward.function=no_such_module:f")
    assert code == 2 and out == "", err
    assert err.startswith("novarl: error: 2 problems stop this run:"), err
    assert "pipeline_dtype=bfloat16 differs from policy.precision=float32" in err
    assert "needs a Mixture-of-Experts model; LlamaForCausalLM is dense" in err
    assert "no_such_module" in err


def test_megatron_with_a_cached_hub_id_converts_from_the_cache(capsys, megatron_on_cpu, hub_cache, monkeypatch):
    from tests.helpers.hub import cache_snapshot
    from novarl.config import BUNDLED_RECIPE
    from novarl.models.bundled import resolve_bundled

    folder = resolve_bundled("tiny-arith")
    snapshot = cache_snapshot(hub_cache, "someorg/tiny", {p.name: p.read_bytes() for p in folder.iterdir()
                                                          if p.is_file()})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the tiny model's own recipe: a hub id alone would start from the real-model one (512 tokens)
    code, out, err = run(capsys, "validate", "-c", str(BUNDLED_RECIPE), *MEGATRON, "policy.model_name=someorg/tiny")
    assert code == 0, err
    assert f"# model: someorg/tiny ({snapshot}); " in out  # every check read the cached snapshot's files


def test_megatron_with_an_uncached_hub_id_offline_is_refused_before_ranks_start(capsys, megatron_on_cpu, hub_cache,
                                                                               monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run(capsys, "train", *MEGATRON, "policy.model_name=someorg/absent",
                       f"logger.log_dir={tmp_path / 'l'}")
    assert code == 2 and "Traceback" not in err
    assert "policy.model_name='someorg/absent'" in err and "HF_HUB_OFFLINE=1 forbids downloading it" in err
    assert not (tmp_path / "l").exists()
