"""The layout advisor of `novarl plan`: it reproduces every branch of the seeds'
decision tree for the seeds' example models and clusters, overrides the tree
only when the memory model says so (and says so), and `novarl plan` prints it
as a table or JSON. Pure arithmetic: nothing is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from novarl.cli import main
from novarl.errors import UserError
from novarl.plan.advisor import HEADROOM, advise, tree_branch
from novarl.backends.contract.model_shape import ModelShape
from tests.helpers import default_generation

QWEN = {"model_type": "qwen2", "tie_word_embeddings": False, "vocab_size": 152064}
QWEN_1_5B = ModelShape.from_hf_config({**QWEN, "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
                                       "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936,
                                       "tie_word_embeddings": True})
QWEN_32B = ModelShape.from_hf_config({**QWEN, "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 40,
                                      "num_key_value_heads": 8, "intermediate_size": 27648})
QWEN_72B = ModelShape.from_hf_config({**QWEN, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                                      "num_key_value_heads": 8, "intermediate_size": 29568})
SEQ = 4096
DEFAULT_GENERATION = default_generation()


def test_model_sizes_fall_in_the_seeds_branches():
    assert 1.5e9 < QWEN_1_5B.parameters < 1.6e9
    assert 32.7e9 < QWEN_32B.parameters < 32.8e9
    assert 72.7e9 < QWEN_72B.parameters < 72.8e9
    assert tree_branch(QWEN_1_5B, num_nodes=4) == "<10B"
    assert tree_branch(QWEN_32B, num_nodes=1) == "10B-70B single node"
    assert tree_branch(QWEN_32B, num_nodes=2) == "10B-70B multi-node"
    assert tree_branch(QWEN_72B, num_nodes=1) == ">70B"


def test_small_model_on_one_gpu_is_dtensor_and_vllm_colocated():
    advice = advise(QWEN_1_5B, gpus_per_node=1, num_nodes=1, sequence_length=SEQ)
    best = advice.recommended
    assert advice.tree_branch == "<10B" and best is advice.tree_pick
    assert (best.strategy, best.training_backend, best.built) == ("dtensor fsdp2", "dtensor", True)
    assert (best.generation_backend, best.generation_tp, best.placement) == ("vllm", 1, "colocated")
    assert best.fits and best.peak_gb <= HEADROOM * 80
    assert "confirms" in advice.explanation[1]


def test_medium_model_on_one_node_is_dtensor_and_vllm_tp8():
    advice = advise(QWEN_32B, gpus_per_node=8, num_nodes=1, sequence_length=SEQ)
    best = advice.recommended
    assert advice.tree_branch == "10B-70B single node"
    assert (best.training_backend, best.generation_backend, best.generation_tp) == ("dtensor", "vllm", 8)
    assert best.placement == "colocated" and best.fits
    # Adam's 16 bytes x 32.8B / 8 GPUs = 65.5 GB of model states: plain FSDP2 does not
    # fit 72 GB with activations and gathered layers, so it moves to tensor parallelism 4 (its layers and,
    # over the vocabulary, its embeddings and head split: the same 65.5 GB of states, a quarter of each
    # layer gathered at a time) and says so.
    assert not advice.tree_pick.fits and advice.tree_pick.memory_gb["model_states"] == pytest.approx(65.5, abs=0.1)
    assert (best.strategy, best.tensor_parallel_size, best.data_parallel_size) == ("dtensor fsdp2+tp", 4, 2)
    assert best.memory_gb["model_states"] == pytest.approx(65.5, abs=0.1)
    assert "overrides" in advice.explanation[1] and "keeps the tree's backends" in advice.explanation[2]
    # while vLLM generates, the training states are parked on the host (distributed/parking.py): weights and
    # Adam's states, 12 of the 16 bytes (the gradients are freed), on each of the node's 8 GPUs
    parked = 65.5 * 12 / 16
    assert advice.explanation[-1] == (f"While the engines generate, the training states wait in page-locked host "
                                      f"memory: {parked:.1f} GB a GPU, {parked * 8:.0f} GB a node.")
    # on 141 GB GPUs the tree's plain layout fits and is confirmed
    roomy = advise(QWEN_32B, gpus_per_node=8, num_nodes=1, gpu_memory_gb=141, sequence_length=SEQ)
    assert roomy.recommended is roomy.tree_pick and roomy.recommended.strategy == "dtensor fsdp2"
    assert roomy.recommended.generation_tp == 8


def test_an_olmo2_model_is_not_given_dtensor_tensor_parallelism():
    """OLMo 2's query/key norms span every head, which the DTensor backend's tensor-parallel plans split by heads
    (refused there): the advisor leaves those layouts out and picks another that fits."""
    olmo2 = ModelShape.from_hf_config({"model_type": "olmo2", "hidden_size": 5120, "num_hidden_layers": 64,
                                       "num_attention_heads": 40, "num_key_value_heads": 8,
                                       "intermediate_size": 27648, "vocab_size": 100352})
    assert not olmo2.heads_split and QWEN_32B.heads_split
    advice = advise(olmo2, gpus_per_node=8, num_nodes=1, sequence_length=SEQ)
    assert all(c.strategy != "dtensor fsdp2+tp" for c in advice.candidates)
    assert advice.recommended.fits and advice.recommended.strategy != "dtensor fsdp2+tp"


def test_medium_model_on_several_nodes_is_megatron_and_dedicated_vllm():
    advice = advise(QWEN_32B, gpus_per_node=8, num_nodes=4, sequence_length=SEQ)
    best = advice.recommended
    assert advice.tree_branch == "10B-70B multi-node" and best is advice.tree_pick
    assert (best.training_backend, best.generation_backend, best.placement) == ("megatron", "vllm", "dedicated")
    assert best.tensor_parallel_size == 8 and best.training_gpus == 24 and best.built
    assert best.data_parallel_size * best.tensor_parallel_size * best.pipeline_parallel_size == 24
    assert not any("does not have" in line for line in advice.explanation)  # Megatron training is built


def test_large_model_on_four_nodes_is_megatron_with_megatron_generation():
    advice = advise(QWEN_72B, gpus_per_node=8, num_nodes=4, sequence_length=SEQ)
    best = advice.recommended
    assert advice.tree_branch == ">70B" and best is advice.tree_pick
    assert (best.training_backend, best.generation_backend, best.placement) == ("megatron", "megatron", "colocated")
    # the seeds' own example for Qwen2.5-72B on 4 x 8: TP=8, PP=4
    assert (best.tensor_parallel_size, best.pipeline_parallel_size, best.data_parallel_size) == (8, 4, 1)
    assert best.generation_tp == 8 and best.fits and best.built
    assert not any("does not have" in line for line in advice.explanation)


def test_seven_b_on_16gb_gpus_overrides_the_plain_dtensor_pick():
    advice = advise(ModelShape.from_name("7B"), gpus_per_node=8, num_nodes=1, gpu_memory_gb=16, sequence_length=SEQ)
    pick, best = advice.tree_pick, advice.recommended
    assert pick.strategy == "dtensor fsdp2" and not pick.fits and pick.peak_gb > HEADROOM * 16
    assert best is not None and best.fits and best is not pick
    assert best.training_backend == "dtensor" and best.strategy in ("dtensor fsdp2+tp", "dtensor fsdp2 + cpu offload")
    text = " ".join(advice.explanation)
    assert "overrides" in text and f"{pick.peak_gb:.1f} GB" in text and "14.4 GB budget" in text
    assert best.describe() in text


def test_nothing_fits_is_said_clearly():
    advice = advise(QWEN_72B, gpus_per_node=1, num_nodes=1, gpu_memory_gb=16, sequence_length=SEQ)
    assert advice.recommended is None and not any(c.fits for c in advice.candidates)
    assert advice.explanation[-1].startswith("Nothing fits")
    assert advice.to_dict()["recommended"] is None


def test_candidates_are_ranked_fitting_first_then_by_score():
    advice = advise(QWEN_32B, gpus_per_node=8, num_nodes=4, sequence_length=SEQ)
    keys = [(not c.fits, -c.score) for c in advice.candidates]
    assert keys == sorted(keys)
    strategies = {c.strategy for c in advice.candidates}
    assert strategies == {"dtensor fsdp2", "dtensor fsdp2+tp", "dtensor fsdp2 + cpu offload", "deepspeed zero-2",
                          "deepspeed zero-3", "megatron tp x pp"}
    for c in advice.candidates:
        assert c.tensor_parallel_size in (1, 2, 4, 8) and 8 % c.tensor_parallel_size == 0
        assert c.training_gpus % (c.tensor_parallel_size * c.pipeline_parallel_size) == 0
        assert c.built  # every enumerated layout has its backends in novarl
        assert not c.fits or c.peak_gb <= HEADROOM * 80
    offload = next(c for c in advice.candidates if c.strategy == "dtensor fsdp2 + cpu offload")
    assert offload.memory_gb["optimizer"] == 0 and offload.memory_gb["cpu_offloaded"] > 0
    assert any("CPU offload" in f for f in offload.score_factors)


def test_generation_tp_must_divide_the_node_and_the_heads():
    with pytest.raises(UserError, match="generation TP 3"):
        advise(QWEN_1_5B, gpus_per_node=8, num_nodes=1, sequence_length=SEQ, generation_tp=3)
    advice = advise(QWEN_1_5B, gpus_per_node=8, num_nodes=1, sequence_length=SEQ, generation_tp=4)
    assert {c.generation_tp for c in advice.candidates} == {4}


# ------------------------------------------------------------------ CLI
def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_plan_bundled_model_prints_the_table(capsys):
    code, out, err = run_cli(capsys, "plan", "--model", "tiny-arith")
    assert code == 0, err
    assert "training backend:" not in out  # only --model: no config section
    assert "strategy" in out and "peak" in out and "dtensor fsdp2" in out and "megatron tp x pp" in out
    assert "recommended: dtensor fsdp2 (dp=1" in out
    assert "- 0.30M parameters on 1 node(s) x 1 GPU(s)" in out


def test_cli_plan_parameter_count_as_json(capsys):
    code, out, err = run_cli(capsys, "plan", "--model", "7.5B", "--json", "--gpu-memory-gb", "40",
                             "cluster.gpus_per_node=8")
    assert code == 0, err
    data = json.loads(out)
    assert set(data) >= {"recommended", "candidates", "explanation", "tree_branch"}
    assert data["tree_branch"] == "<10B" and data["gpu_memory_gb"] == 40
    for candidate in data["candidates"]:
        assert set(candidate) >= {"strategy", "parallel", "memory_gb", "fits", "score", "placement", "generation"}
        assert set(candidate["parallel"]) == {"dp", "tp", "pp", "vpp", "cp", "ep"}
        assert {"params", "grads", "optimizer", "activations", "generator_weights", "kv_cache", "total",
                "peak"} <= set(candidate["memory_gb"])
        assert isinstance(candidate["fits"], bool)
    assert data["recommended"]["training_backend"] == "dtensor"


def test_cli_plan_config_still_plans_backends_and_advises(capsys):
    code, out, _ = run_cli(capsys, "plan")
    assert code == 0
    assert out.splitlines()[0] == f"training backend: dtensor; generation backend: {DEFAULT_GENERATION}"
    assert "recommended: dtensor fsdp2" in out


def test_cli_plan_checks_the_sequence_length_against_the_models_positions(capsys):
    """As validate does: longer than tiny-arith's 64 positions is a warning for Hugging Face
    generation, and not runnable for vLLM, which refuses such an engine (exit 2)."""
    code, out, err = run_cli(capsys, "plan", "policy.max_seq_length=128", "policy.generation.backend=hf")
    assert code == 0, err
    assert "warning: policy.max_seq_length=128 is longer than the model's max_position_embeddings=64" in out
    code, out, _ = run_cli(capsys, "plan", "policy.max_seq_length=128", "policy.generation.backend=vllm")
    assert code == 2 and "not runnable: policy.max_seq_length=128 is longer than the model's " \
                           "max_position_embeddings=64" in out


def test_cli_plan_skips_advice_for_an_uncached_hub_model(capsys):
    code, out, err = run_cli(capsys, "plan", "policy.model_name=novarl-test/not-a-cached-model")
    assert code == 0, err
    assert "layout advice skipped" in out and "without downloading" in out


def test_cli_plan_unknown_model_flag_exits_2(capsys):
    code, _, err = run_cli(capsys, "plan", "--model", "novarl-test/not-a-cached-model")
    assert code == 2 and "Traceback" not in err and "parameter count" in err


def test_a_kl_reference_adds_a_copy_of_the_weights_on_every_gpu():
    """The reference lives in the policy's processes, sharded like its weights; on FSDP2 in the compute
    dtype (bf16: half the bytes of the policy's float32 masters), elsewhere as the policy's weights are held."""
    shape = ModelShape.from_name("7B")
    plain = advise(shape, gpus_per_node=8, num_nodes=1, sequence_length=SEQ)
    with_kl = advise(shape, gpus_per_node=8, num_nodes=1, sequence_length=SEQ, with_reference=True)
    def key(c):
        return c.strategy, c.tensor_parallel_size, c.pipeline_parallel_size, c.activation_checkpointing

    before = {key(c): c for c in plain.candidates}
    common = [(before[key(c)], c) for c in with_kl.candidates if key(c) in before]
    assert len(common) >= 5
    assert {"fsdp2" in c.strategy for _, c in common} == {True, False}
    for without, kl in common:
        assert without.memory_gb["reference_weights"] == 0
        copy = without.memory_gb["params"] / (2 if "fsdp2" in kl.strategy else 1)
        assert kl.memory_gb["reference_weights"] == pytest.approx(copy)
        assert kl.memory_gb["training"] == pytest.approx(without.memory_gb["training"] + copy)


# ------------------------------------------------------------------ real shapes (config.json)
CONFIGS = Path(__file__).parent / "data" / "model_configs"


def test_a_70b_count_and_llama_70b_config_get_the_same_layout():
    real = ModelShape.from_name(str(CONFIGS / "llama-3.3-70b"))
    assumed = ModelShape.from_name("70B")
    assert 70.5e9 < real.parameters < 70.6e9 and 69e9 < assumed.parameters < 70.5e9
    for nodes in (1, 8):
        a = advise(real, gpus_per_node=8, num_nodes=nodes, sequence_length=SEQ)
        b = advise(assumed, gpus_per_node=8, num_nodes=nodes, sequence_length=SEQ)
        assert a.tree_branch == b.tree_branch == ("10B-70B single node" if nodes == 1 else "10B-70B multi-node")
        assert a.recommended.describe() == b.recommended.describe()


@pytest.mark.parametrize("name, nodes", [("qwen3-30b-a3b", 8), ("qwen3-235b-a22b", 32)])
def test_mixture_of_experts_models_get_expert_parallel_megatron_layouts(name, nodes):
    shape = ModelShape.from_name(str(CONFIGS / name))
    assert shape.num_experts == 128 and shape.num_experts_per_token == 8
    advice = advise(shape, gpus_per_node=8, num_nodes=nodes, sequence_length=SEQ)
    best = advice.recommended
    assert best is advice.tree_pick and best.fits and best.built
    assert best.training_backend == "megatron" and best.expert_parallel_size > 1
    assert shape.num_experts % best.expert_parallel_size == 0
    assert (best.data_parallel_size * best.tensor_parallel_size) % best.expert_parallel_size == 0
    assert f"ep={best.expert_parallel_size}" in best.describe()
    # Without expert parallelism every rank holds all 128 experts of its layers: only deep pipelines
    # fit, and they score below the expert-parallel pick (the pipeline bubble).
    whole = [c for c in advice.candidates if c.training_backend == "megatron" and c.expert_parallel_size == 1]
    assert whole and all(c.score < best.score for c in whole if c.fits)
    assert all(c.pipeline_parallel_size > best.pipeline_parallel_size for c in whole if c.fits)


def test_a_dense_model_is_never_given_expert_parallelism():
    advice = advise(ModelShape.from_name(str(CONFIGS / "llama-3.3-70b")), gpus_per_node=8, num_nodes=8,
                    sequence_length=SEQ)
    assert {c.expert_parallel_size for c in advice.candidates} == {1}


def test_the_advisor_splits_long_sequences_over_context_parallel_ranks_when_recomputation_is_not_enough():
    at_64k = advise(QWEN_1_5B, gpus_per_node=8, num_nodes=1, sequence_length=65536).recommended
    assert at_64k.context_parallel_size == 1 and at_64k.activation_checkpointing and at_64k.fits
    # (the picking head keeps no logits over the vocabulary at these lengths: recomputed layers hold 384k tokens)
    at_512k = advise(QWEN_1_5B, gpus_per_node=8, num_nodes=1, sequence_length=524288).recommended
    assert (at_512k.training_backend, at_512k.data_parallel_size, at_512k.context_parallel_size) == ("dtensor", 4, 2)
    assert at_512k.fits and at_512k.activation_checkpointing
    assert "context parallelism 2: the activations of 524288-token sequences decide" in " ".join(at_512k.notes)
    assert any("context parallel 2" in factor for factor in at_512k.score_factors)
    windowed = ModelShape.from_hf_config({**QWEN, "hidden_size": 1536, "num_hidden_layers": 28,
                                          "num_attention_heads": 12, "num_key_value_heads": 2,
                                          "intermediate_size": 8960, "sliding_window": 4096})
    assert not windowed.plain_causal_attention  # novarl's context parallelism does not compute it
    assert advise(windowed, gpus_per_node=8, num_nodes=1, sequence_length=131072).recommended.context_parallel_size == 1


def test_megatron_pipelines_run_interleaved_where_the_stages_split_evenly_and_it_fits():
    from novarl.backends.registry import training_spec
    from novarl.plan.auto import planned_layout

    def _megatron_overrides(pick):
        return training_spec("megatron").layout_overrides(planned_layout(pick, pick.generation_backend))

    advice = advise(QWEN_32B, gpus_per_node=8, num_nodes=5, sequence_length=SEQ)  # 64 layers, vLLM generation
    deep = next(c for c in advice.candidates if (c.tensor_parallel_size, c.pipeline_parallel_size) == (1, 4))
    assert deep.virtual_pipeline_parallel_size == 2 and deep.fits
    assert "interleaved pipeline: 2 model chunks per stage" in " ".join(deep.notes)
    assert "x0.842 pipeline bubble (p-1)/(v m+p-1), p=4, v=2, m=8" in deep.score_factors  # 1 - 3/19, not 1 - 3/11
    assert "policy.megatron_cfg.virtual_pipeline_model_parallel_size=2" in _megatron_overrides(deep)
    # where 2 chunks per stage would not fit, the plain pipeline is reported
    shallow = next(c for c in advice.candidates if (c.tensor_parallel_size, c.pipeline_parallel_size) == (2, 2)
                   and not c.activation_checkpointing)
    assert shallow.virtual_pipeline_parallel_size == 1 and shallow.fits
    assert "policy.megatron_cfg.virtual_pipeline_model_parallel_size=null" in _megatron_overrides(shallow)
    # Megatron generation decodes one chunk per stage: never interleaved
    large = advise(QWEN_72B, gpus_per_node=8, num_nodes=4, sequence_length=SEQ)
    assert {c.virtual_pipeline_parallel_size for c in large.candidates} == {1}
