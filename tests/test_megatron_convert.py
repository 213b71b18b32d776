"""Hugging Face <-> Megatron-core weight conversion, on CPU.

Bit-exact round trips for a tiny Llama and a tiny Qwen2 (GQA, qkv biases, untied
head), at TP=1 and TP=2; megatron-core's own GPTModel, built on CPU, loads the
result strictly and its q/k/v projections, MLP and norms compute what the Hugging
Face layers compute, split over two gloo ranks. Qwen2-MoE's shared expert and Qwen3-MoE's
query/key norms round-trip too. The cache folder
follows the seeds' environment variables and redoes stale or partial conversions.
"""

from __future__ import annotations

import json

import pytest
import torch

from novarl.backends.megatron.cache import checkpoint_root, check_conversion, converted_checkpoint, load_shard
from novarl.backends.megatron.convert import LayerShape, hf_to_megatron, megatron_to_hf, shard, unshard
from novarl.errors import UserError


def tiny_qwen2():
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=23, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, max_position_embeddings=64))


def tiny_llama():
    """tiny-arith's shape with 4 query and 2 key/value heads, so that TP=2 splits whole groups."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=19, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, max_position_embeddings=64))


def bundled_tiny_arith():
    from transformers import AutoModelForCausalLM

    from novarl.models.loading import resolve_model_path

    return AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-arith"))


MODELS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "tiny-arith": bundled_tiny_arith}



@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_bit_exact(model, tp):
    shape = LayerShape.from_hf_config(model.config)
    if shape.num_kv_heads % tp:
        pytest.skip("one key/value head cannot be split over 2 ranks")
    hf = model.state_dict()
    full = hf_to_megatron(hf, shape, tensor_parallel_size=tp)
    parts = [shard(full, rank=r, tensor_parallel_size=tp) for r in range(tp)]
    back = megatron_to_hf(unshard(parts), shape, tensor_parallel_size=tp)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    # the vocabulary is padded to a multiple of TP, and each rank holds its share
    assert parts[0]["embedding.word_embeddings.weight"].shape[0] == shape.padded_vocab_size(tp) // tp
    if shape.qkv_bias:
        assert "decoder.layers.0.self_attention.linear_qkv.bias" in full


def test_fused_norm_names_for_the_transformer_engine_spec(model):
    shape = LayerShape.from_hf_config(model.config)
    full = hf_to_megatron(model.state_dict(), shape, fused_norms=True)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in full
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in full
    back = megatron_to_hf(full, shape, fused_norms=True)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_unsupported_model_type_and_tp_are_user_errors(model):
    from transformers import GPT2Config

    with pytest.raises(UserError, match="supports model types llama, qwen2, qwen3, mistral, mixtral, qwen2_moe, "
                                        "qwen3_moe; this model is 'gpt2'"):
        LayerShape.from_hf_config(GPT2Config())
    with pytest.raises(UserError, match="tensor_parallel_size=3 must divide"):
        hf_to_megatron(model.state_dict(), LayerShape.from_hf_config(model.config), tensor_parallel_size=3)


def tiny_mixtral():
    from tests.helpers.models import tiny_moe

    return tiny_moe("mixtral")


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("fused_norms", [False, True])
def test_mixtral_round_trip_and_expert_parallel_cuts(tp, fused_norms):
    """Mixtral's router and stacked experts become Megatron's router and per-expert MLPs (whole on
    every tensor-parallel rank), and come back bit for bit; expert-parallel ranks each take
    their contiguous share of the experts, numbered from 0."""
    from novarl.backends.megatron.convert import experts_of_rank, experts_to_global

    model = tiny_mixtral()
    shape = LayerShape.from_hf_config(model.config)
    assert (shape.num_experts, shape.experts_per_token, shape.ffn_hidden_size) == (4, 2, 96)
    hf = model.state_dict()
    full = hf_to_megatron(hf, shape, tensor_parallel_size=tp, fused_norms=fused_norms)
    assert full["decoder.layers.1.mlp.router.weight"].shape == (4, 64)
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in full  # never fused into an expert
    parts = [shard(full, rank=r, tensor_parallel_size=tp) for r in range(tp)]
    expert = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    assert all(torch.equal(p[expert], full[expert]) for p in parts)
    back = megatron_to_hf(unshard(parts), shape, tensor_parallel_size=tp, fused_norms=fused_norms)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    second = experts_of_rank(full, rank=1, expert_parallel_size=2, num_experts=4)
    assert torch.equal(second["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"], full[expert])
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in second
    assert experts_to_global(second, rank=1, expert_parallel_size=2, num_experts=4).keys() == \
        {k for k in full if ".local_experts.0." not in k and ".local_experts.1." not in k}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_qwen_moe_round_trip_shared_expert_and_query_key_norms(model_type, tp):
    """Qwen2-MoE's gated shared expert (split like a dense MLP) and Qwen3-MoE's query/key norms map
    to megatron-core's names and back bit for bit; each expert's MLP cut over 2 expert-tensor-
    parallel ranks joins back whole. A model with dense layers among its MoE ones is refused."""
    from novarl.backends.megatron.convert import expert_tensor_part, join_expert_tensor_parts
    from tests.helpers.models import tiny_moe

    model = tiny_moe(model_type)
    shape = LayerShape.from_hf_config(model.config)
    assert (shape.num_experts, shape.experts_per_token, shape.ffn_hidden_size) == (4, 2, 48)
    assert (shape.qkv_bias, shape.qk_norm, shape.shared_expert_size, shape.router_pre_softmax) == \
        ((True, False, 80, True) if model_type == "qwen2_moe" else (False, True, 0, False))
    hf = model.state_dict()
    full = hf_to_megatron(hf, shape, tensor_parallel_size=tp)
    layer = "decoder.layers.1."
    if model_type == "qwen2_moe":
        assert full[layer + "mlp.shared_experts.linear_fc1.weight"].shape == (160, 64)
        assert full[layer + "mlp.shared_experts.gate_weight"].shape == (1, 64)
    else:
        assert full[layer + "self_attention.q_layernorm.weight"].shape == (16,)
    parts = [shard(full, rank=r, tensor_parallel_size=tp) for r in range(tp)]
    if model_type == "qwen2_moe":  # each tensor-parallel rank its [gate; up] share of the shared expert
        assert parts[-1][layer + "mlp.shared_experts.linear_fc1.weight"].shape == (160 // tp, 64)
    back = megatron_to_hf(unshard(parts), shape, tensor_parallel_size=tp)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)

    cut = [expert_tensor_part(full, rank=r, expert_tensor_parallel_size=2) for r in range(2)]
    expert = layer + "mlp.experts.local_experts.3."
    assert cut[1][expert + "linear_fc1.weight"].shape == (48, 64) and cut[1][expert + "linear_fc2.weight"].shape == (64, 24)
    gate = full[expert + "linear_fc1.weight"][:48]
    assert torch.equal(cut[1][expert + "linear_fc1.weight"][:24], gate[24:])  # rank 1's half of the gate rows
    joined = join_expert_tensor_parts(cut)
    assert joined.keys() == full.keys() and all(torch.equal(joined[k], full[k]) for k in full)

    with pytest.raises(UserError, match="has dense layers"):
        LayerShape.from_hf_config(tiny_moe(model_type, mlp_only_layers=[0]).config)


# ------------------------------------------------ megatron-core checks the layout
def megatron_rank(rank: int, world: int, rendezvous: str, results) -> None:
    """Build GPTModel with TP=world on CPU for each test model, load this rank's shard strictly,
    compare its layers with Hugging Face's."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.helpers.spawn import send

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    checks = {}
    for name in ("llama", "qwen2"):
        hf = MODELS[name]()
        shape = LayerShape.from_hf_config(hf.config)
        config = TransformerConfig(
            num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_heads,
            num_query_groups=shape.num_kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn_hidden_size,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            add_qkv_bias=shape.qkv_bias, layernorm_epsilon=hf.config.rms_norm_eps, use_cpu_initialization=True,
            params_dtype=torch.float32, tensor_model_parallel_size=world)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                         vocab_size=shape.padded_vocab_size(world), max_sequence_length=64,
                         position_embedding_type="rope", share_embeddings_and_output_weights=shape.tied)
        full = hf_to_megatron(hf.state_dict(), shape, tensor_parallel_size=world)
        missing, unexpected = model.load_state_dict(shard(full, rank=rank, tensor_parallel_size=world), strict=False)
        checks[f"{name} strict"] = not unexpected and all(m.endswith("_extra_state") for m in missing)
        torch.manual_seed(1)
        x = torch.randn(5, 2, shape.hidden_size)  # [sequence, batch, hidden]
        with torch.no_grad():
            for i, (ours, theirs) in enumerate(zip(model.decoder.layers, hf.model.layers)):
                q, k, v = ours.self_attention.get_query_key_value_tensors(x)[:3]
                heads = slice(rank * shape.num_heads // world, (rank + 1) * shape.num_heads // world)
                groups = slice(rank * shape.num_kv_heads // world, (rank + 1) * shape.num_kv_heads // world)
                attn = theirs.self_attn
                want_q = attn.q_proj(x).reshape(5, 2, shape.num_heads, shape.head_dim)[:, :, heads]
                want_k = attn.k_proj(x).reshape(5, 2, shape.num_kv_heads, shape.head_dim)[:, :, groups]
                want_v = attn.v_proj(x).reshape(5, 2, shape.num_kv_heads, shape.head_dim)[:, :, groups]
                checks[f"{name} qkv{i}"] = all(torch.allclose(a.reshape(b.shape), b, atol=1e-6)
                                               for a, b in ((q, want_q), (k, want_k), (v, want_v)))
                mlp, _ = ours.mlp(x)  # row-parallel fc2 all-reduces over the TP ranks
                checks[f"{name} mlp{i}"] = torch.allclose(mlp, theirs.mlp(x), atol=1e-5)
                checks[f"{name} norm{i}"] = torch.allclose(ours.input_layernorm(x), theirs.input_layernorm(x),
                                                           atol=1e-6)
        checks[f"{name} picking output"] = picking_output_check(model, shape.vocab_size, x)
    checks.update(core_attention_checks(world))
    send(results, rank, checks)


def picking_output_check(model, vocab_size: int, hidden: torch.Tensor) -> bool:
    """The output layer's logprobs of the following tokens at temperature 0.7 and their gradients (in its
    input and weight) picked chunk by chunk over this tensor-parallel rank's part of the vocabulary
    (backends/megatron/picking.py), as from megatron-core's logits with its vocab-parallel cross entropy."""
    from megatron.core import parallel_state, tensor_parallel

    from novarl.backends.megatron.picking import picking, use_picking_output

    layer, weight = model.output_layer, model.shared_embedding_or_output_weight()
    s, b = hidden.shape[:2]
    generator = torch.Generator().manual_seed(3)
    following, upstream = torch.randint(0, vocab_size, (b, s), generator=generator), torch.randn(s, b)
    part = weight.shape[0]
    columns = torch.arange(part) + parallel_state.get_tensor_model_parallel_rank() * part
    measured = []
    for picks in (False, True):
        x = hidden.clone().requires_grad_()
        weight.grad = None
        if picks:
            assert use_picking_output(layer, vocab_size, rows=4, fused=False)
            with picking(layer, following, 0.7):
                scores = layer(x, weight=weight)[0]
        else:  # as megatron_model.py's _position_scores takes the whole logits
            logits = (layer(x, weight=weight)[0].float() / 0.7).masked_fill(columns >= vocab_size, float("-inf"))
            scores = -tensor_parallel.vocab_parallel_cross_entropy(logits, following.t().contiguous())
        (scores * upstream).sum().backward()
        measured.append((scores.detach(), x.grad, weight.grad.clone()))
    layer.__class__ = tensor_parallel.ColumnParallelLinear
    return all(torch.allclose(got, want, atol=1e-5) for got, want in zip(*measured, strict=True))


def core_attention_checks(world: int) -> dict[str, bool]:
    """novarl's SDPAttention against megatron-core's DotProductAttention on this rank's heads
    (4 query heads on 2 key/value heads, of 8 on 4): outputs and q/k/v gradients of causal
    attention on padded rows, and a prompt chunk's queries on its keys so far with an explicit
    mask (Megatron generation's chunked prefill)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from novarl.backends.megatron import cpu
    from novarl.backends.megatron.attention import SDPAttention

    cpu.install()  # DotProductAttention forks megatron-core's CUDA RNG (for its dropout, off here)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=8, num_query_groups=4,
                               kv_channels=16, attention_dropout=0.0, tensor_model_parallel_size=world)
    built = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    heads, groups = 8 // world, 4 // world
    torch.manual_seed(2)
    q, k, v = (torch.randn(7, 3, n, 16) for n in (heads, groups, groups))  # [s, b, heads, dim]
    weights = torch.randn(7, 3, heads * 16)
    chunk = torch.ones(3, 7, dtype=torch.bool).triu(4 + 1)[None, None]  # queries 4-6 on keys 0-6, True = hidden
    results = []
    for module in (SDPAttention(**built), DotProductAttention(**built)):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = module(*inputs, None)
        (out * weights).sum().backward()
        with torch.no_grad():
            chunked = module(q[4:], k, v, chunk)
        results.append((out.detach(), *(t.grad for t in inputs), chunked))
    (out, *grads, chunked), (want, *want_grads, want_chunked) = results
    return {"core attention": torch.allclose(out, want, atol=1e-5) and
            all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, want_grads)),
            "core attention, a chunk with a mask": torch.allclose(chunked, want_chunked, atol=1e-5)}


def test_megatron_core_loads_and_computes_like_hugging_face():
    """Llama and Qwen2 (q/k/v biases) split over 2 tensor-parallel gloo ranks, their output layers picking
    logprobs over each rank's part of the vocabulary, and novarl's core attention against megatron-core's
    on them. (Whole models on one rank, the bundled one among
    them, are held against Hugging Face end to end in tests/test_megatron_backend.py and
    tests/test_megatron_layouts.py.)"""
    pytest.importorskip("megatron.core")
    from tests.helpers.spawn import spawned

    for checks in spawned(megatron_rank, 2):
        assert checks and all(checks.values()), checks
        # per model: strict load, qkv/mlp/norm for each of 2 layers, the picking output layer; then the core
        # attention, twice
        assert len(checks) == 2 * (1 + 3 * 2 + 1) + 2


def test_a_bf16_policy_without_transformer_engine_holds_every_weight_in_bf16(one_megatron_rank):
    """megatron-core's local spec makes its torch norms with fp32 weights whatever params_dtype; novarl casts
    them (backends/megatron/model.py norms_in_params_dtype), so that in bf16 every weight is bf16 and a norm
    is not torch's unfused mixed-dtype path. The policy's logprobs are Hugging Face's fp32 ones to bf16's
    resolution, on one spawned rank (megatron-core's parallel state is the process's). Its checkpoints' layout
    says so: one written with fp32 norms (before the cast) is refused as another layout on resume."""
    dtypes, norms, difference, layout = one_megatron_rank["bf16"]
    assert norms and dtypes == {torch.bfloat16}, dtypes
    assert difference.mean() < 0.05 and difference.max() < 0.5, (difference.mean(), difference.max())
    assert layout["norms"] == "bfloat16" and "norms" not in one_megatron_rank["fp32 layout"]


def bf16_measures(folder: str) -> tuple:
    """A bf16 Megatron policy's weights' dtypes, its norms' names, its logprobs' distance to Hugging Face's fp32
    ones, and its checkpoints' layout."""
    import os

    from megatron.core import parallel_state

    from novarl.backends.training.megatron import MegatronPolicy
    from novarl.config import load_config
    from novarl.models.loading import resolve_model_path, token_logprobs
    from novarl.models.scores import Logprobs
    from novarl.types import TrainBatch

    os.environ.update(NOVARL_MEGATRON_ON_CPU="1", NOVARL_MEGATRON_CHECKPOINT_DIR=folder)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    cfg = load_config(None, overrides=["policy.megatron_cfg.enabled=true", "policy.precision=bfloat16"])
    policy = MegatronPolicy(cfg.policy, resolve_model_path("tiny-arith"), total_steps=1, emulate_cuda=True)
    params = dict(policy.modules[0].named_parameters())
    ids = torch.randint(3, 18, (4, 30), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.bool)
    ours = TrainBatch.from_rows(ids, mask, mask, torch.zeros(4))
    ours = ours.to_rows(policy.forward(ours, Logprobs()))[:, 1:].float()
    with torch.no_grad():
        theirs = token_logprobs(bundled_tiny_arith()(input_ids=ids).logits, ids)[:, 1:]
    return ({p.dtype for p in params.values()}, [n for n in params if "norm" in n], (ours - theirs).abs(),
            policy._layout())


@pytest.fixture(scope="module")
def one_megatron_rank(tmp_path_factory) -> dict:
    """What one spawned Megatron rank (CPU emulation) measured: the compiled layers' step against the eager
    ones' ("compile"), a packed row of alike pieces run side by side against the varlen path ("alike"), a bf16
    policy ("bf16") and the fp32 policy's checkpoint layout."""
    pytest.importorskip("megatron.core")
    from tests.helpers.spawn import spawned

    return spawned(stepping_rank, 1, str(tmp_path_factory.mktemp("megatron")))[0]


def test_compiled_layers_train_as_the_eager_ones(one_megatron_rank, monkeypatch):
    """policy.megatron_cfg.torch_compile: each local-spec transformer layer compiled in place (inductor on the
    CPU), each one graph; one training step (logprobs through the layers, the loss, its gradients, Adam's update) as
    the eager layers give it, on one spawned rank. Over Transformer Engine's layers it is not applied."""
    from novarl.backends.megatron import model
    from novarl.config import load_config

    eager, compiled = one_megatron_rank["compile"]
    assert eager["compiled"] == [False, False] and compiled["compiled"] == [True, True]
    # a layer is one graph (one with gradients: the step's logprobs are the loss's), traced once for both layers:
    # nothing runs eager between its pieces (megatron-core's row-parallel linears warned, a break; issue 35)
    assert compiled["graph breaks"] == {} and compiled["graphs"] == 1
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-5)
    assert compiled["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-4)
    assert compiled["weights"].keys() == eager["weights"].keys()
    for name, tensor in eager["weights"].items():
        # Adam's first step is lr x the gradient's sign where it is tiny: its rounding shows at 2 % of lr (1e-3)
        torch.testing.assert_close(compiled["weights"][name], tensor, rtol=1e-5, atol=5e-5, msg=name)
    mc = load_config(None, overrides=["policy.megatron_cfg.torch_compile=true"]).policy.megatron_cfg
    assert model.compiles_layers(mc)
    monkeypatch.setattr(model, "transformer_engine_available", lambda: True)
    assert not model.compiles_layers(mc)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_parked_megatron_policy_trains_on_as_one_never_parked(one_megatron_rank, precision):
    """Megatron's training states parked in host memory while colocated engines generate (distributed/parking.py):
    the weights with their gradient buffers, then the fp32 masters and Adam's moments (in float32 the optimizer
    steps the weights themselves: they stay in the weights' group); the next step, which wakes them, is the never
    parked policy's, bit for bit."""
    found = one_megatron_rank["parked"][precision]
    assert found["freed"]["weights"] > 0 and found["freed"]["optimizer"] > 0
    assert found["emptied"]
    assert found["steps"]["parked"] == found["steps"]["plain"]
    assert found["same_weights"]


def test_a_packed_row_of_alike_pieces_runs_as_padded_rows_side_by_side(one_megatron_rank):
    """A packed row whose pieces all hold 16 tokens runs through megatron-core as padded rows [4, 16] (causal
    SDPA over rows, megatron-core's own rotary positions), not as a packed thd row (novarl's varlen path and
    packed_rotary, which a packed attention kernel asked by name keeps): the same logprobs, loss and
    gradients; a row of unlike pieces stays packed."""
    alike = one_megatron_rank["alike"]
    (side_by_side, rows), (packed, want) = alike["side by side"], alike["asked"]
    assert side_by_side == {"padded": 2 * 2, "packed": 0}  # each layer, in the logprob and the training pass
    assert packed == {"padded": 0, "packed": 2 * 2}
    assert alike["unlike"] == {"padded": 0, "packed": 2}
    torch.testing.assert_close(rows["logprobs"], want["logprobs"], rtol=1e-5, atol=1e-5)
    assert rows["loss"] == pytest.approx(want["loss"], rel=1e-5)
    for got, expected in zip(rows["grads"], want["grads"], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def stepping_rank(rank: int, world: int, rendezvous: str, results, folder: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from tests.helpers.spawn import send

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    eager, eager_step = one_step(folder, compile_layers=False)
    measured = {"alike": alike_pieces(eager), "fp32 layout": eager._layout()}
    measured["compile"] = (eager_step, one_step(folder, compile_layers=True)[1])
    measured["bf16"] = bf16_measures(folder)
    measured["parked"] = {precision: parked_against_plain(folder, precision) for precision in ("float32", "bfloat16")}
    send(results, rank, measured)


def parked_against_plain(folder: str, precision: str) -> dict:
    """Two Megatron policies on the same weights, one of them parked (distributed/parking.py: host storages
    too, on this CPU rank) after its first step: whether that emptied its weights, fp32 masters, Adam's moments
    and gradient buffers, and both policies' second steps and weights."""
    import os

    from megatron.core import parallel_state

    from novarl.algorithms.losses import make_loss
    from novarl.backends.training.megatron import MegatronPolicy
    from novarl.config import load_config
    from novarl.distributed.parking import GROUPS, module_tensors
    from novarl.models.loading import resolve_model_path
    from tests.helpers.packing import HEAD, LOSS, mixed_batch

    os.environ.update(NOVARL_MEGATRON_ON_CPU="1", NOVARL_MEGATRON_CHECKPOINT_DIR=folder)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    cfg = load_config(None, overrides=[
        "policy.megatron_cfg.enabled=true", f"policy.precision={precision}", "policy.train_micro_batch_size=6",
        "policy.megatron_cfg.optimizer.lr=1.0e-3", "policy.megatron_cfg.scheduler.lr_warmup_iters=0",
        "policy.megatron_cfg.scheduler.lr_decay_style=constant"])
    plain, parked = (MegatronPolicy(cfg.policy, resolve_model_path("tiny-arith"), total_steps=3, emulate_cuda=True)
                     for _ in range(2))
    steps: dict[str, list] = {"plain": [], "parked": []}
    for step in range(2):
        for name, policy in (("plain", plain), ("parked", parked)):
            batch = mixed_batch(rows=6, longest=24, seed=step).with_own_counts()
            batch.old_logprobs = batch.generator_logprobs
            metrics = policy.forward_backward(batch, make_loss(LOSS), HEAD)
            steps[name].append({**metrics, **policy.optim_step()})
        if step == 0:
            freed = {group: parked.park(group, host_too=True) for group in GROUPS}
            weights = [t for module in parked.modules for t in module_tensors(module)]
            held = [*weights, *(p.main_grad for p in weights if getattr(p, "main_grad", None) is not None),
                    *(t for o in parked._optimizers() for g in o.optimizer.param_groups for t in g["params"]),
                    *(t for o in parked._optimizers() for state in o.optimizer.state.values()
                      for t in state.values() if isinstance(t, torch.Tensor))]
            emptied = all(t.untyped_storage().nbytes() == 0 for t in held)
    plain_weights, parked_weights = plain.full_state_dict(), parked.full_state_dict()
    return {"freed": freed, "emptied": emptied, "steps": steps,
            "same_weights": all(torch.equal(parked_weights[k], t) for k, t in plain_weights.items())}


def alike_pieces(policy) -> dict:
    """The policy's logprobs, loss and gradients over a batch of 4 sequences of 16 tokens in packed rows of 64,
    as it runs them and with a packed attention kernel asked by name; the attention calls of each, by the
    rows' kind (megatron-core's [s, b] rows, or packed thd ones), and of a batch of unlike lengths."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from novarl.backends.megatron.attention import SDPAttention

    calls = {"padded": 0, "packed": 0}
    original = SDPAttention.forward

    def counted(self, query, key, value, mask, *args, packed_seq_params: PackedSeqParams | None = None, **kw):
        calls["padded" if packed_seq_params is None else "packed"] += 1
        return original(self, query, key, value, mask, *args, packed_seq_params=packed_seq_params, **kw)

    SDPAttention.forward = counted
    try:
        return _alike_pieces_counted(policy, calls)
    finally:
        SDPAttention.forward = original


def _alike_pieces_counted(policy, calls: dict) -> dict:
    from novarl.algorithms.losses import make_loss
    from novarl.models import attention
    from novarl.types import TrainBatch
    from tests.helpers.packing import HEAD, LOSS, batchings, mixed_batch

    policy.train_batching, policy.logprob_batching = batchings("packed")
    ids = torch.randint(3, 18, (4, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    batch = TrainBatch.from_rows(ids, mask, mask & (torch.arange(16) >= 4), torch.randn(4))
    batch.old_logprobs = batch.generator_logprobs = -torch.rand(batch.num_tokens)
    measured = {}
    for case, asked in (("side by side", None), ("asked", "padded_sdpa")):
        attention.ASKED = asked
        calls.update(padded=0, packed=0)
        logprobs = policy.forward(batch, HEAD)
        loss = policy.forward_backward(batch, make_loss(LOSS), HEAD)["loss"]
        grads = [p.main_grad.clone() for p in policy.modules[0].parameters() if p.requires_grad]
        policy._zero_grad_buffers()
        measured[case] = (dict(calls), {"logprobs": logprobs, "loss": loss, "grads": grads})
    attention.ASKED = None
    calls.update(padded=0, packed=0)
    policy.forward(mixed_batch(rows=3, longest=12), HEAD)
    measured["unlike"] = dict(calls)
    return measured


def one_step(folder: str, compile_layers: bool):
    """A Megatron policy (megatron_cfg.torch_compile as asked) after one training step, and what it measured:
    its layers compiled or not, the step's loss and gradient norm, the weights after it."""
    import os

    from megatron.core import parallel_state
    from torch._dynamo.utils import counters

    from novarl.algorithms.losses import make_loss
    from novarl.backends.training.megatron import MegatronPolicy
    from novarl.config import load_config
    from novarl.models.loading import resolve_model_path
    from tests.helpers.packing import HEAD, LOSS, mixed_batch

    os.environ.update(NOVARL_MEGATRON_ON_CPU="1", NOVARL_MEGATRON_CHECKPOINT_DIR=folder)
    batch = mixed_batch(rows=6, longest=24).with_own_counts()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    cfg = load_config(None, overrides=[
        "policy.megatron_cfg.enabled=true", f"policy.megatron_cfg.torch_compile={str(compile_layers).lower()}",
        "policy.train_micro_batch_size=6", "policy.megatron_cfg.optimizer.lr=1.0e-3",
        "policy.megatron_cfg.scheduler.lr_warmup_iters=0", "policy.megatron_cfg.scheduler.lr_decay_style=constant"])
    policy = MegatronPolicy(cfg.policy, resolve_model_path("tiny-arith"), total_steps=2, emulate_cuda=True)
    batch.old_logprobs = batch.generator_logprobs
    counters.clear()
    metrics = policy.forward_backward(batch, make_loss(LOSS), HEAD)
    metrics.update(policy.optim_step())
    return policy, {"compiled": [layer._compiled_call_impl is not None for layer in policy.modules[0].decoder.layers],
                    "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "weights": policy.full_state_dict(),
                    "graph breaks": dict(counters["graph_break"]), "graphs": counters["stats"]["unique_graphs"]}


# ---------------------------------------------------------------- the cache
def test_cache_folder_follows_the_seeds_order_and_names(monkeypatch, tmp_path):
    # Seed 002: NRL_MEGATRON_CHECKPOINT_DIR, else $HF_HOME/nemo_rl, else ~/.cache/huggingface/nemo_rl;
    # novarl's NOVARL_MEGATRON_CHECKPOINT_DIR is an alias the seed's variable wins over.
    for variable in ("NRL_MEGATRON_CHECKPOINT_DIR", "NOVARL_MEGATRON_CHECKPOINT_DIR", "HF_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert checkpoint_root() == (tmp_path / "home" / ".cache" / "huggingface" / "nemo_rl", "the default")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert checkpoint_root() == (tmp_path / "hf" / "nemo_rl", "HF_HOME")
    monkeypatch.setenv("NOVARL_MEGATRON_CHECKPOINT_DIR", str(tmp_path / "alias"))
    assert checkpoint_root() == (tmp_path / "alias", "NOVARL_MEGATRON_CHECKPOINT_DIR")
    monkeypatch.setenv("NRL_MEGATRON_CHECKPOINT_DIR", str(tmp_path / "seed"))
    assert checkpoint_root() == (tmp_path / "seed", "NRL_MEGATRON_CHECKPOINT_DIR")


def test_conversion_is_cached_and_stale_or_partial_ones_are_redone(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("NOVARL_MEGATRON_CHECKPOINT_DIR", str(tmp_path / "cache"))
    source = tmp_path / "qwen"
    tiny_qwen2().save_pretrained(source)
    folder = converted_checkpoint(source, tensor_parallel_size=2)
    assert folder.parent.parent == tmp_path / "cache" and "converting qwen" in capsys.readouterr().err
    parts = [load_shard(folder, r) for r in range(2)]
    shape = LayerShape.from_hf_config(tiny_qwen2().config)
    back = megatron_to_hf(unshard(parts), shape, tensor_parallel_size=2)
    assert all(torch.equal(back[k], v) for k, v in tiny_qwen2().state_dict().items())

    assert converted_checkpoint(source, tensor_parallel_size=2) == folder  # reused
    assert "(cached;" in capsys.readouterr().err

    (folder / "rank_1.pt").write_bytes(b"torn")  # a partial write
    manifest = json.loads((folder / "manifest.json").read_text())
    assert check_conversion(folder, {k: manifest[k] for k in ("format", "source", "tensor_parallel_size",
                                                             "fused_norms")}) is not None
    assert converted_checkpoint(source, tensor_parallel_size=2) == folder
    assert "redoing the Megatron conversion" in capsys.readouterr().err
    assert torch.equal(load_shard(folder, 1)["decoder.final_layernorm.weight"],
                       parts[1]["decoder.final_layernorm.weight"])

    tiny_llama().save_pretrained(source)  # the source changes: a new fingerprint, a new folder
    assert converted_checkpoint(source, tensor_parallel_size=2) != folder


def test_megatron_on_a_host_without_cuda_is_a_clear_refusal(capsys, tmp_path):
    from novarl.cli import main

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    assert main(["train", f"logger.log_dir={tmp_path}", "policy.megatron_cfg.enabled=true"]) == 2
    err = capsys.readouterr().err
    assert "Megatron-core trains and generates on CUDA GPUs only, and this host has none" in err
    assert "Traceback" not in err and not any(tmp_path.iterdir())  # nothing written
