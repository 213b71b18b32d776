"""The memory model of `novarl plan`: parameter counts from model shapes, the
ZeRO paper's model-state example, Korthikanti et al.'s activation formulas,
every strategy's split, and the generator's weights and KV cache. Pure
arithmetic: no model is loaded, no download. GB is 1e9 bytes throughout."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from novarl.errors import UserError
from novarl.plan import memory
from novarl.plan.memory import (
    GB,
    STRATEGIES,
    ColocatedGenerator,
    MemoryBreakdown,
    Parallelism,
    Workload,
    bytes_per_parameter,
    estimate_memory,
    fsdp2_bytes_per_parameter,
    generator_weight_bytes,
    kv_cache_bytes,
    kv_cache_bytes_from_utilization,
    kv_cache_bytes_per_token,
    layer_activation_bytes,
    max_kv_cache_tokens,
    megatron_bytes_per_parameter,
    output_activation_bytes,
    picked_output_bytes,
    stack_activation_bytes,
    zero_model_states,
)
from novarl.backends.contract.model_shape import ModelShape, parse_parameter_count

# config.json excerpts, as published on the Hugging Face hub.
LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
             "tie_word_embeddings": False}
QWEN25_15B = {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
              "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936,
              "tie_word_embeddings": True}
LLAMA3_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
              "tie_word_embeddings": False}
QWEN3_06B = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
             "tie_word_embeddings": True, "attention_bias": False}
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False}

# Korthikanti et al. 2022, Table 3: the GPT-3 175B configuration (t=8, p=8).
GPT3_175B = ModelShape(num_layers=96, hidden_size=12288, num_attention_heads=96, num_key_value_heads=96,
                       head_dim=128, intermediate_size=4 * 12288, vocab_size=51200)


def shape(config: dict) -> ModelShape:
    return ModelShape.from_hf_config(config)


# ----------------------------------------------------------------- model shapes
@pytest.mark.parametrize(("config", "expected"), [
    (LLAMA2_7B, 6_738_415_616),    # "6.74B", the safetensors total of Llama-2-7b-hf
    (QWEN25_15B, 1_543_714_304),   # "1.54B" on the Qwen2.5-1.5B model card
    (LLAMA3_70B, 70_553_706_496),  # "70.6B" of Meta-Llama-3-70B
    (MIXTRAL_8X7B, 46_702_792_704),  # "46.7B total" of Mixtral-8x7B
])
def test_parameter_counts_match_published_models(config, expected):
    assert shape(config).parameters == expected


def test_qwen2_has_qkv_biases_and_qwen3_qk_norms():
    qwen = shape(QWEN25_15B)
    assert qwen.attention_bias and not qwen.qk_norm
    without_bias = ModelShape(**{**qwen.__dict__, "attention_bias": False})
    assert qwen.parameters - without_bias.parameters == 28 * (1536 + 2 * 256)
    qwen3 = shape(QWEN3_06B)
    assert qwen3.qk_norm and not qwen3.attention_bias
    # Qwen3-0.6B model card: 0.44B non-embedding parameters.
    assert qwen3.parameters - qwen3.embedding_parameters == pytest.approx(0.44e9, rel=0.01)


def test_moe_counts_routed_experts_router_and_active_parameters():
    mixtral = shape(MIXTRAL_8X7B)
    assert (mixtral.num_experts, mixtral.num_experts_per_token) == (8, 2)
    assert mixtral.expert_parameters_per_layer == 8 * 3 * 4096 * 14336
    assert mixtral.mlp_parameters_per_layer == mixtral.expert_parameters_per_layer + 4096 * 8
    assert mixtral.active_parameters == 12_879_925_248  # "12.9B active"
    assert shape(LLAMA2_7B).active_parameters == shape(LLAMA2_7B).parameters


def test_hf_config_defaults_and_nested_text_config():
    llama = shape({k: v for k, v in LLAMA2_7B.items() if k not in ("num_key_value_heads", "tie_word_embeddings")})
    assert (llama.num_key_value_heads, llama.head_dim, llama.tie_word_embeddings) == (32, 128, False)
    nested = ModelShape.from_hf_config({"model_type": "llava", "text_config": LLAMA2_7B})
    assert nested.parameters == 6_738_415_616


def test_hf_config_without_needed_keys_names_them_and_the_source():
    with pytest.raises(UserError, match=r"gpt2/config.json: no hidden_size, num_hidden_layers"):
        ModelShape.from_hf_config({"n_embd": 768, "vocab_size": 50257}, source="gpt2/config.json")


def test_from_folder_reads_config_json_only(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_15B))
    (tmp_path / "model.safetensors").write_text("not weights")
    assert ModelShape.from_folder(tmp_path).parameters == 1_543_714_304
    assert ModelShape.from_folder(tmp_path / "config.json").source == str(tmp_path / "config.json")


def test_from_folder_errors_name_the_path(tmp_path):
    with pytest.raises(UserError, match=f"{tmp_path}: no config.json there"):
        ModelShape.from_folder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot be read as JSON"):
        ModelShape.from_folder(tmp_path)


@pytest.mark.parametrize(("text", "count"), [
    ("7.5B", 7_500_000_000), ("70b", 70_000_000_000), ("500M", 500_000_000), ("1.5T", 1_500_000_000_000),
    (" 3K ", 3000), ("7e9", 7_000_000_000), (7.5e9, 7_500_000_000), (1_000_000, 1_000_000),
])
def test_parse_parameter_count(text, count):
    assert parse_parameter_count(text) == count


@pytest.mark.parametrize("bad", ["seven", "7X", "-3B", "", "7 B B", True, 0])
def test_bad_parameter_count_names_it(bad):
    with pytest.raises(UserError, match=re_escape(repr(bad))):
        parse_parameter_count(bad)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize("count", ["7.5B", "70B", "500M", "1T", "405B", 1.2e9, 3e9])
def test_assumed_shape_is_within_ten_percent_and_llama_like(count):
    assumed = ModelShape.from_parameter_count(count)
    wanted = parse_parameter_count(count)
    assert abs(assumed.parameters - wanted) <= 0.1 * wanted
    assert assumed.head_dim == 128 and assumed.num_key_value_heads <= 8 and assumed.vocab_size == 128256
    assert assumed.intermediate_size == 256 * math.ceil(3.5 * assumed.hidden_size / 256)
    assert str(count) in assumed.source


def test_assumed_shape_for_8b_is_llama3_8b():
    assumed = ModelShape.from_parameter_count("8B")
    assert (assumed.hidden_size, assumed.num_layers, assumed.intermediate_size) == (4096, 32, 14336)
    assert assumed.parameters == 8_030_261_248  # Meta-Llama-3-8B
    seventy = ModelShape.from_parameter_count("70B")
    assert (seventy.hidden_size, seventy.intermediate_size) == (8192, 28672) and 75 <= seventy.num_layers <= 85


def test_assumed_shapes_stay_within_four_percent_from_100m_to_2t():
    for step in range(60):
        wanted = 1e8 * (2e12 / 1e8) ** (step / 59)
        assumed = ModelShape.from_parameter_count(wanted)
        assert abs(assumed.parameters - wanted) <= 0.04 * wanted, wanted


def test_assumed_shape_refuses_counts_below_its_embeddings():
    with pytest.raises(UserError, match="'50M' is too small"):
        ModelShape.from_parameter_count("50M")


def test_from_name_takes_a_count_a_folder_or_a_cached_hub_id(tmp_path, monkeypatch):
    assert ModelShape.from_name("7B").hidden_size == 4096
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    assert ModelShape.from_name(str(tmp_path)).parameters == 6_738_415_616
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--meta-llama--Llama-2-7b-hf"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(LLAMA2_7B))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert ModelShape.from_name("meta-llama/Llama-2-7b-hf").parameters == 6_738_415_616
    with pytest.raises(UserError, match="'nobody/no-such-model' is neither a parameter count"):
        ModelShape.from_name("nobody/no-such-model")


# ------------------------------------------------------- model states (ZeRO paper)
def test_zero_paper_example_in_gb():
    """Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, Nd = 64, K = 12 gives
    120 GB, 31.4 GB, 16.6 GB and 1.9 GB per device. Exact in GB = 1e9 bytes."""
    psi, expected = 7.5e9, {0: 120e9, 1: 31.40625e9, 2: 16.640625e9, 3: 1.875e9}
    printed = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, total in expected.items():
        states = sum(zero_model_states(psi, stage=stage, data_parallel_size=64))
        assert states == pytest.approx(total, rel=1e-12)
        assert round(states / GB, 1) == printed[stage]
    assert round(120e9 / 2**30, 1) == 111.8  # in GiB the paper's numbers would not come out


@pytest.mark.parametrize("nd", [1, 8, 64, 1024])
def test_zero_per_stage_formulas(nd):
    psi = 1e9
    formulas = {0: 16 * psi, 1: 4 * psi + 12 * psi / nd, 2: 2 * psi + 14 * psi / nd, 3: 16 * psi / nd}
    for stage, total in formulas.items():
        assert sum(zero_model_states(psi, stage=stage, data_parallel_size=nd)) == pytest.approx(total)
    assert zero_model_states(psi, stage=2, data_parallel_size=nd) == (2 * psi, 2 * psi / nd, 12 * psi / nd)


def test_bytes_per_parameter_by_precision_and_optimizer():
    assert bytes_per_parameter("bfloat16", "adam") == memory.BytesPerParameter(2, 2, 12)
    assert bytes_per_parameter("float16", "adam").total == 16
    assert bytes_per_parameter("float32", "adam") == memory.BytesPerParameter(4, 4, 8)  # no master copy
    assert bytes_per_parameter("bfloat16", "sgd") == memory.BytesPerParameter(2, 2, 8)
    assert fsdp2_bytes_per_parameter("bfloat16").total == 16 == fsdp2_bytes_per_parameter("float32").total


@pytest.mark.parametrize(("precision", "fp32_grads", "replicated", "fixed", "sharded"), [
    ("float16", False, 20, 4, 16),   # Megatron Core guide: 20 | 4 + 16/d
    ("bfloat16", True, 18, 6, 12),   # 18 | 6 + 12/d
    ("float32", False, 16, 8, 8),    # 16 | 8 + 8/d
])
def test_megatron_distributed_optimizer_table(precision, fp32_grads, replicated, fixed, sharded):
    per = megatron_bytes_per_parameter(precision, grad_reduce_in_fp32=fp32_grads)
    assert per.total == replicated
    llama = shape(LLAMA2_7B)
    work = Workload(sequence_length=128, micro_batch_size=1, precision=precision)
    for d in (1, 4, 16):
        for distributed in (True, False):
            parallel = Parallelism(data_parallel_size=d, use_distributed_optimizer=distributed,
                                   grad_reduce_in_fp32=fp32_grads)
            result = estimate_memory(llama, strategy="megatron", workload=work, parallel=parallel)
            per_param = fixed + sharded / d if distributed else replicated
            assert result.model_states == pytest.approx(per_param * llama.parameters)


# ------------------------------------------------- activations (Korthikanti et al.)
def per_layer_175b(**kwargs) -> float:
    """GPT-3 175B layer activations, in units of s*b*h (s=2048, b=1, h=12288)."""
    sbh = 2048 * 1 * 12288
    settings = {"tensor_parallel_size": 8, "flash_attention": False, **kwargs}
    return layer_activation_bytes(sequence_length=2048, micro_batch_size=1, hidden_size=12288,
                                  num_attention_heads=96, **settings) / sbh


def test_korthikanti_table2_for_gpt3_175b():
    """5as/h = 5*96*2048/12288 = 80, so per layer (units of sbh):
    no parallelism 34+80=114; TP 10+24/8+80/8=23; TP+SP (34+80)/8=14.25;
    TP+selective 10+3=13; TP+SP+selective 34/8=4.25; full recomputation 2."""
    assert per_layer_175b(tensor_parallel_size=1) == 114
    assert per_layer_175b() == 23
    assert per_layer_175b(sequence_parallel=True) == 14.25
    assert per_layer_175b(recompute="selective") == 13
    assert per_layer_175b(sequence_parallel=True, recompute="selective") == 4.25
    assert per_layer_175b(recompute="full") == 2
    assert per_layer_175b(recompute="full", sequence_parallel=True) == 2 / 8


def test_korthikanti_stated_reductions():
    # Abstract: sequence parallelism + selective recomputation cut activation memory ~5x.
    both = per_layer_175b(sequence_parallel=True, recompute="selective")
    assert per_layer_175b() / both == pytest.approx(5.41, abs=0.01)
    # Sec. 5: selective recomputation saves 70% (GPT-3, 80/114) and 65% (MT-NLG 530B, a=128, h=20480: 64/98).
    assert 1 - both / per_layer_175b(sequence_parallel=True) == pytest.approx(0.702, abs=0.001)
    mt_nlg = {"sequence_length": 2048, "micro_batch_size": 1, "hidden_size": 20480, "num_attention_heads": 128,
              "tensor_parallel_size": 8, "sequence_parallel": True, "flash_attention": False}
    kept = layer_activation_bytes(recompute="selective", **mt_nlg) / layer_activation_bytes(**mt_nlg)
    assert 1 - kept == pytest.approx(0.653, abs=0.001)


def test_gpt3_175b_first_stage_totals_in_gb():
    """L=96 layers' worth on the first of p=8 stages (8 micro-batches of 12 layers):
    s*b*h*L = 2,415,919,104 bytes per unit."""
    sbhl = 2048 * 12288 * 96
    work = dict(sequence_length=2048, micro_batch_size=1)
    for sp, recompute, units, printed in [(False, "none", 23, 55.57), (True, "none", 14.25, 34.43),
                                          (False, "selective", 13, 31.41), (True, "selective", 4.25, 10.27)]:
        layers = stack_activation_bytes(GPT3_175B, num_layers=96, tensor_parallel_size=8, sequence_parallel=sp,
                                        recompute=recompute, flash_attention=False, **work)
        assert layers == units * sbhl and round(layers / GB, 2) == printed
        megatron = estimate_memory(
            GPT3_175B, strategy="megatron",
            workload=Workload(recompute=recompute, flash_attention=False, **work),
            parallel=Parallelism(tensor_parallel_size=8, pipeline_parallel_size=8, sequence_parallel=sp))
        assert megatron.activations == pytest.approx(units * sbhl) and "first" in megatron.notes[0]


def test_pipeline_in_flight_micro_batches_and_interleaving():
    work = Workload(sequence_length=2048, micro_batch_size=1, recompute="selective")
    one_layer = 4.25 * 2048 * 12288
    tp8 = dict(tensor_parallel_size=8, pipeline_parallel_size=8, sequence_parallel=True)
    fewer = estimate_memory(GPT3_175B, strategy="megatron", workload=work,
                            parallel=Parallelism(num_microbatches=2, **tp8))
    assert fewer.activations == pytest.approx(12 * 2 * one_layer)
    interleaved = estimate_memory(GPT3_175B, strategy="megatron", workload=work,
                                  parallel=Parallelism(virtual_pipeline_parallel_size=2, **tp8))
    assert interleaved.activations == pytest.approx(96 * (1 + 7 / 16) * one_layer)


def test_flash_attention_drops_the_score_term():
    assert per_layer_175b(flash_attention=True) == 13 == per_layer_175b(recompute="selective")
    assert per_layer_175b(flash_attention=True, sequence_parallel=True) == 4.25
    assert per_layer_175b(flash_attention=True, tensor_parallel_size=1) == 34


def test_full_recompute_keeps_layer_inputs_and_one_rebuilt_layer():
    sbh = 4096 * 2 * 4096
    llama = shape(LLAMA2_7B)
    full = stack_activation_bytes(llama, num_layers=32, sequence_length=4096, micro_batch_size=2, recompute="full")
    assert full == 32 * 2 * sbh + 34 * sbh


def test_output_logits_are_fp32_and_vocab_parallel():
    assert output_activation_bytes(sequence_length=4096, micro_batch_size=2, vocab_size=151936) == 4 * 4096 * 2 * 151936
    assert output_activation_bytes(sequence_length=4096, micro_batch_size=2, vocab_size=151936,
                                   tensor_parallel_size=4) == 4096 * 2 * 151936


def test_a_picking_head_keeps_its_logits_in_the_compute_dtype_while_they_are_small():
    """models/logprob_head.py: the logits kept for the backward up to 4 GiB, else recomputed there; one
    1 GiB chunk of fp32 logits and its gradient at a time. Qwen2.5's 151,936-entry vocabulary: 8,192 bf16
    tokens keep 2.5 GB; 32,768 (10 GB) keep none."""
    gib = 1 << 30
    assert picked_output_bytes(tokens=8192, vocab_size=151936, compute_bytes=2) == 2 * 8192 * 151936 + 2 * gib
    assert picked_output_bytes(tokens=32768, vocab_size=151936, compute_bytes=2) == 2 * gib
    assert picked_output_bytes(tokens=100, vocab_size=1000, compute_bytes=4) == 4 * 100 * 1000 + 2 * 4 * 100 * 1000
    qwen, mixtral, capped = shape(QWEN25_15B), shape(MIXTRAL_8X7B), shape({**MIXTRAL_8X7B, "model_type": "gemma2"})
    assert qwen.picking_head and mixtral.picking_head and not capped.picking_head  # Gemma 2 caps its logits
    assert shape({**MIXTRAL_8X7B, "model_type": "gemma2", "final_logit_softcapping": None}).picking_head
    long = Workload(sequence_length=32768, micro_batch_size=1)
    layers = stack_activation_bytes(qwen, num_layers=28, sequence_length=32768, micro_batch_size=1)
    assert estimate_memory(qwen, strategy="fsdp2", workload=long).activations == layers + 2 * gib  # 18 GB less
    layers = stack_activation_bytes(mixtral, num_layers=32, sequence_length=4096, micro_batch_size=1)
    eight = Parallelism(data_parallel_size=8)
    assert estimate_memory(mixtral, strategy="zero2", workload=WORK, parallel=eight).activations == layers + PICKED
    # a Hugging Face head whose logits are soft-capped computes them whole on DeepSpeed; Megatron's own output layer
    # picks whatever the architecture, but not under context parallelism
    assert estimate_memory(capped, strategy="zero2", workload=WORK, parallel=eight).activations == layers + LOGITS
    megatron = estimate_memory(capped, strategy="megatron", workload=WORK, parallel=eight)
    assert megatron.activations == layers + PICKED
    split = estimate_memory(mixtral, strategy="megatron", workload=WORK,
                            parallel=Parallelism(data_parallel_size=4, context_parallel_size=2))
    assert split.activations == stack_activation_bytes(mixtral, num_layers=32, sequence_length=2048,
                                                       micro_batch_size=1) + LOGITS / 2


# --------------------------------------------------------------------- strategies
LLAMA = shape(LLAMA2_7B)
P = LLAMA.parameters                      # 6,738,415,616
LAYER = LLAMA.layer_parameters            # 202,383,360
ROOT = P - 32 * LAYER                     # embeddings + final norm + lm_head = 262,148,096
WORK = Workload(sequence_length=4096, micro_batch_size=1)
SBH = 4096 * 4096
LOGITS = 4 * 4096 * 32000
PICKED = 2 * 4096 * 32000 + 2 * LOGITS
"""A picking head's (Llama is PLAIN_CAUSAL): its bf16 logits kept, one chunk of fp32 logits and its gradient."""


def estimate(strategy: str, work: Workload = WORK, **parallel) -> MemoryBreakdown:
    return estimate_memory(LLAMA, strategy=strategy, workload=work, parallel=Parallelism(**parallel))


def test_data_parallel_strategies_llama2_7b():
    activations = 32 * 34 * SBH + PICKED
    ddp, z1, z2, z3 = (estimate(s, data_parallel_size=8) for s in ("ddp", "zero1", "zero2", "zero3"))
    assert (ddp.params, ddp.grads, ddp.optimizer) == (2 * P, 2 * P, 12 * P)
    assert z1.model_states == pytest.approx(4 * P + 12 * P / 8)
    assert z2.model_states == pytest.approx(2 * P + 14 * P / 8)
    assert z3.model_states == pytest.approx(16 * P / 8)
    assert all(r.activations == activations for r in (ddp, z1, z2, z3))
    assert z3.gathered_params == 2 * (ROOT + 2 * LAYER) + 4 * LAYER and ddp.gathered_params == 0
    assert round(ddp.gb(), 2) == 127.38 and round(z3.gb(), 2) == 35.18


def test_fsdp2_matches_zero3_states_with_fp32_shards():
    fsdp, zero3 = estimate("fsdp2", data_parallel_size=8), estimate("zero3", data_parallel_size=8)
    assert (fsdp.params, fsdp.grads, fsdp.optimizer) == (4 * P / 8, 4 * P / 8, 8 * P / 8)
    assert fsdp.model_states == pytest.approx(zero3.model_states)
    fp32 = estimate("fsdp2", Workload(sequence_length=4096, micro_batch_size=1, precision="float32"),
                    data_parallel_size=8)
    assert fp32.model_states == pytest.approx(16 * P / 8)
    assert fp32.gathered_params == 4 * (ROOT + 2 * LAYER) + 4 * LAYER


def test_one_device_holds_a_bf16_copy_of_each_weight_and_one_weights_gradient_without_fsdp2():
    """On one device the DTensor backend's model is not FSDP2's (backends/training/one_device.py): FSDP2's
    states, a bf16 copy of every weight through a pass, and one weight's bf16 gradient at a time (Llama-2-7B's
    largest: its embedding, 32,000 x 4,096); in float32 nothing beside the states; with offload FSDP2's units."""
    from novarl.backends.contract.model_shape import largest_weight

    one = estimate("fsdp2", data_parallel_size=1)
    assert (one.params, one.grads, one.optimizer) == (4 * P, 4 * P, 8 * P)
    assert largest_weight(LLAMA) == 32000 * 4096 > 2 * 11008 * 4096
    assert one.gathered_params == 2 * (P + 32000 * 4096)
    fp32 = estimate("fsdp2", Workload(sequence_length=4096, micro_batch_size=1, precision="float32"),
                    data_parallel_size=1)
    assert fp32.gathered_params == 0
    offload = estimate("fsdp2_offload", data_parallel_size=1)
    assert offload.gathered_params == 2 * (ROOT + 2 * LAYER) + 4 * LAYER


def test_fsdp2_cpu_offload_keeps_only_working_copies_and_activations_on_gpu():
    offload, fsdp = estimate("fsdp2_offload", data_parallel_size=8), estimate("fsdp2", data_parallel_size=8)
    assert offload.model_states == 0 and offload.cpu_offloaded == pytest.approx(16 * P / 8)
    assert offload.training == offload.gathered_params + offload.activations
    assert offload.total == pytest.approx(fsdp.total - fsdp.model_states)
    assert "host memory" in offload.notes[0]


def test_fsdp2_tp_splits_layers_and_the_vocabulary():
    """Llama's head picks: the embeddings and the head split over the vocabulary too (models/vocab_parallel.py),
    each rank's head picking over half of it; the final norm whole."""
    tp = estimate("fsdp2_tp", data_parallel_size=4, tensor_parallel_size=2)
    root = ROOT - (LLAMA.embedding_parameters + LLAMA.lm_head_parameters) / 2
    assert root == 4096 + 2 * 32000 * 4096 / 2
    assert tp.model_states == pytest.approx(16 * (root + 32 * LAYER / 2) / 4)
    assert tp.activations == 32 * (10 + 24 / 2) * SBH + PICKED / 2
    sp = estimate("fsdp2_tp", data_parallel_size=4, tensor_parallel_size=2, sequence_parallel=True)
    assert sp.activations == 32 * 34 / 2 * SBH + PICKED / 2
    assert tp.gathered_params == 2 * (root + LAYER) + 4 * LAYER / 2


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp2_tp_keeps_a_head_that_does_not_pick_whole(tied):
    """A soft-capped head (Gemma 2's) gives its full logits: it stays whole on each rank, with the embeddings
    where they are tied to it; untied embeddings split (as a critic's, whose value head is its own)."""
    import dataclasses

    capped = dataclasses.replace(LLAMA, picking_head=False, tie_word_embeddings=tied)
    tp = estimate_memory(capped, strategy="fsdp2_tp", workload=WORK,
                         parallel=Parallelism(data_parallel_size=4, tensor_parallel_size=2))
    root = capped.parameters - 32 * LAYER - (0 if tied else capped.embedding_parameters / 2)
    assert tp.model_states == pytest.approx(16 * (root + 32 * LAYER / 2) / 4)
    assert tp.gathered_params == 2 * (root + LAYER) + 4 * LAYER / 2


def test_context_parallel_splits_the_sequence():
    cp = estimate("fsdp2", data_parallel_size=4, context_parallel_size=2)
    # each rank's half of the sequence, plus the other half's keys and values, all-gathered and
    # kept for the backward in every layer (bf16; Llama-2-7B has 32 KV heads of 128)
    gathered_kv = 32 * 2 * 2048 * 32 * 128 * 2
    assert cp.activations == 32 * 34 * 2048 * 4096 + PICKED / 2 + gathered_kv
    recomputed = estimate("fsdp2", Workload(sequence_length=4096, micro_batch_size=1, recompute="full"),
                          data_parallel_size=4, context_parallel_size=2)
    assert recomputed.activations - estimate(
        "fsdp2", Workload(sequence_length=2048, micro_batch_size=1, recompute="full"),
        data_parallel_size=8).activations == gathered_kv / 32  # one layer's under full recomputation
    assert cp.model_states == pytest.approx(16 * P / 8)


def test_megatron_tp2_pp2_reports_the_first_stage():
    result = estimate("megatron", data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2)
    first_stage = 32000 * 4096 / 2 + 16 * LAYER / 2
    assert result.params == 2 * first_stage and result.grads == 2 * first_stage
    assert result.optimizer == pytest.approx(16 * first_stage / 2)  # distributed over dp=2
    assert result.activations == 16 * 2 * (10 + 24 / 2) * SBH   # 2 micro-batches in flight, no logits
    assert result.notes == ("first pipeline stage (16 layers), the heavier one",)
    single = estimate("megatron", tensor_parallel_size=2)
    assert single.activations == 32 * 22 * SBH + PICKED / 2  # each tp rank picks over its half of the vocabulary
    assert estimate("megatron").activations == 32 * 34 * SBH + PICKED  # its output layer picks at tp 1
    assert single.params == pytest.approx(2 * (P - 4096) / 2 + 2 * 4096)  # final norm replicated


def test_megatron_expert_parallel_shards_experts_and_their_optimizer():
    mixtral = shape(MIXTRAL_8X7B)
    experts = 32 * mixtral.expert_parameters_per_layer
    dense = mixtral.parameters - experts
    result = estimate_memory(mixtral, strategy="megatron", workload=WORK,
                             parallel=Parallelism(data_parallel_size=8, expert_parallel_size=8))
    assert result.params == pytest.approx(2 * (dense + experts / 8))
    # dense state over dp=8; expert state over expert-dp = 8 x 1 / (8 x 1) = 1
    assert result.optimizer == pytest.approx(16 * (dense / 8 + experts / 8))


@pytest.mark.parametrize(("strategy", "parallel", "message"), [
    ("zero4", {}, "'zero4' is not one of ddp, zero1"),
    ("ddp", {"tensor_parallel_size": 2}, "'ddp' has no tensor_parallel_size=2"),
    ("fsdp2", {"pipeline_parallel_size": 2}, "'fsdp2' has no pipeline_parallel_size=2"),
    ("megatron", {"pipeline_parallel_size": 64}, "more than the model's 32 layers"),
    ("megatron", {"expert_parallel_size": 3}, "must divide"),
    ("megatron", {"data_parallel_size": 0}, "at least 1: data_parallel_size=0"),
])
def test_bad_strategy_or_sizes_are_user_errors(strategy, parallel, message):
    with pytest.raises(UserError, match=re_escape(message)):
        estimate(strategy, **parallel)


def test_every_strategy_gives_a_positive_total_and_gb_dict():
    for strategy in STRATEGIES:
        extra = {"tensor_parallel_size": 2} if strategy in ("fsdp2_tp", "megatron") else {}
        result = estimate(strategy, data_parallel_size=4, **extra)
        numbers = result.as_dict_gb()
        assert result.total > 0 and numbers["total"] == pytest.approx(result.total / GB)
        assert numbers["total"] == pytest.approx(numbers["training"] + numbers["generation"])


# ---------------------------------------------------------------------- generator
def test_kv_cache_per_token():
    assert kv_cache_bytes_per_token(LLAMA) == 2 * 32 * 32 * 128 * 2 == 512 * 1024  # 0.5 MiB per token
    llama70 = shape(LLAMA3_70B)
    assert kv_cache_bytes_per_token(llama70) == 327_680
    assert kv_cache_bytes_per_token(llama70, tensor_parallel_size=8) == 40_960
    qwen = shape(QWEN25_15B)
    assert kv_cache_bytes_per_token(qwen) == 28_672
    assert kv_cache_bytes_per_token(qwen, tensor_parallel_size=4) == 14_336  # 2 KV heads replicated over 4
    assert kv_cache_bytes(LLAMA, num_tokens=64 * 4096) == 64 * 4096 * 512 * 1024


def test_generator_weights_and_utilization_rule():
    assert generator_weight_bytes(LLAMA, tensor_parallel_size=2) == P
    kv = kv_cache_bytes_from_utilization(gpu_memory_bytes=80e9, gpu_memory_utilization=0.6, weight_bytes=2 * P)
    assert kv == pytest.approx(48e9 - 2 * P)
    assert kv_cache_bytes_from_utilization(gpu_memory_bytes=16e9, gpu_memory_utilization=0.5,
                                           weight_bytes=2 * P) == 0
    assert max_kv_cache_tokens(LLAMA, kv_bytes=kv) == int(kv // (512 * 1024))


def test_colocated_generator_adds_to_the_total():
    by_tokens = ColocatedGenerator(num_sequences=32, max_model_len=4096)
    result = estimate_memory(LLAMA, strategy="fsdp2", workload=WORK, parallel=Parallelism(data_parallel_size=8),
                             generator=by_tokens)
    alone = estimate("fsdp2", data_parallel_size=8)
    assert (result.generator_weights, result.kv_cache) == (2 * P, 32 * 4096 * 512 * 1024)
    assert result.total == pytest.approx(alone.total + 2 * P + 32 * 4096 * 512 * 1024)
    assert result.training == alone.training
    by_share = ColocatedGenerator(gpu_memory_utilization=0.5, gpu_memory_bytes=80e9)
    weights, kv = by_share.footprint(LLAMA)
    assert weights + kv == pytest.approx(40e9)
    with pytest.raises(UserError, match="num_sequences and max_model_len"):
        ColocatedGenerator().footprint(LLAMA)
    with pytest.raises(UserError, match="needs gpu_memory_bytes"):
        ColocatedGenerator(gpu_memory_utilization=0.5).footprint(LLAMA)


def test_memory_modules_import_nothing_heavy():
    allowed = {"__future__", "collections.abc", "json", "math", "os", "re", "dataclasses", "pathlib", "typing",
               "novarl.errors", "novarl.backends.contract.model_shape", "novarl.models.architectures"}
    for module in (memory, __import__("novarl.backends.contract.model_shape", fromlist=["x"]),
                   __import__("novarl.models.architectures", fromlist=["x"])):
        tree = ast.parse(Path(module.__file__).read_text())
        top = {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
        top |= {node.module for node in tree.body if isinstance(node, ast.ImportFrom)}
        assert top <= allowed, top - allowed


def test_float32_activations_take_four_bytes():
    half = estimate("fsdp2")
    full = estimate("fsdp2", Workload(sequence_length=4096, micro_batch_size=1, precision="float32"))
    chunk = 2 * LOGITS  # a chunk of fp32 logits and its gradient in both; the kept logits in the compute dtype
    assert full.activations - chunk == 2 * (half.activations - chunk)
