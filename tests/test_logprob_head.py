"""Logprobs without the full logits (models/logprob_head.py): the chunked computation and its
gradients equal log_softmax over the whole logits, and a Hugging Face model whose head picks
gives the training forward's logprobs and weight gradients of the plain head, packed and padded."""

from __future__ import annotations

import copy

import pytest
import torch

from novarl.models.logprob_head import PickingHead, chunk_rows, chunked_logprobs, picking_head, use_picking_head
from novarl.types import TrainBatch


def full_logprobs(hidden, weight, targets, temperature):
    logits = torch.nn.functional.linear(hidden, weight).float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize("rows", [3, 4, 64])  # chunks of 3 (the last one short), of 4, one chunk
def test_chunked_logprobs_and_gradients_equal_the_full_softmax(rows):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (10,), generator=generator)
    upstream = torch.randn(10, dtype=torch.float64, generator=generator)
    expected = full_logprobs(hidden, weight, targets, 0.7).double()
    grads = torch.autograd.grad((expected * upstream).sum(), (hidden, weight))
    picked = chunked_logprobs(hidden, weight, targets, 0.7, rows)
    assert picked.dtype == torch.float32  # as the plain path's .float() gives
    assert torch.allclose(picked.double(), expected, atol=1e-6)
    chunked_grads = torch.autograd.grad((picked.double() * upstream).sum(), (hidden, weight))
    for got, want in zip(chunked_grads, grads, strict=True):
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


def vocabulary_part_rank(rank: int, world: int, rendezvous: str, results) -> None:
    """Over 2 gloo ranks: the logprobs and gradients of chunked_logprobs over a vocabulary of 40 split as
    rows 0-27 / 28-39, and as 0-39 / none (a rank whose part is all padding, as Megatron's padded vocabulary
    gives a tiny model's last rank), next to the whole vocabulary's on one rank."""
    import torch.distributed as dist

    from tests.helpers.spawn import send

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, generator=generator)
    weight = torch.randn(40, 16, generator=generator)
    targets = torch.randint(0, 40, (10,), generator=generator)
    upstream = torch.randn(10, generator=generator)

    def run(first: int, end: int, vocab) -> tuple:
        h, w = hidden.clone().requires_grad_(), weight[first:end].clone().requires_grad_()
        picked = chunked_logprobs(h, w, targets, 0.7, 3, vocab=vocab)
        (picked * upstream).sum().backward()
        return picked.detach(), h.grad, w.grad

    measured = {"whole": run(0, 40, None)}
    for name, cut in (("28 / 12", 28), ("40 / none", 40)):
        first, end = (0, cut) if rank == 0 else (cut, 40)
        picked, grad_hidden, grad_weight = run(first, end, (dist.group.WORLD, first))
        dist.all_reduce(grad_hidden)  # the tensor-parallel region's sum of each rank's part
        measured[name] = (picked, grad_hidden, grad_weight, first)
    measured["models"] = split_models()
    send(results, rank, measured)


def split_models() -> dict:
    """On this rank of 2: a one-layer Llama (untied head) and Gemma (tied, its embeddings scaled) of 19 tokens
    whose padding token (15) is in rank 1's rows, whole and split over the vocabulary (vocab_parallel.py): their
    logits and the logprobs their heads pick, and every parameter's gradient of each (split ones gathered)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM

    from novarl.models.critic import add_value_head
    from novarl.models.vocab_parallel import split_vocabulary

    mesh = init_device_mesh("cpu", (2,))
    shape = dict(vocab_size=19, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=16, pad_token_id=15, bos_token_id=1, eos_token_id=2,
                 max_position_embeddings=32)
    def critic():
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True))
        add_value_head(model)
        torch.nn.init.normal_(model.lm_head.weight)  # (a value head starts at zero)
        return model

    builds = {"llama, untied": lambda: LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False)),
              "gemma, tied": lambda: GemmaForCausalLM(GemmaConfig(**shape)), "critic": critic}
    ids = torch.randperm(38, generator=torch.Generator().manual_seed(3)).remainder(19).view(2, 19)  # every token
    targets = ids.roll(-1, dims=1).flatten()
    upstream = torch.randn(2, 19, 19, generator=torch.Generator().manual_seed(4))
    found = {}
    for name, build in builds.items():
        torch.manual_seed(0)
        whole = build()
        split = copy.deepcopy(whole)
        picks = name != "critic"  # a value head: the embeddings split, the head as it is
        said = split_vocabulary(split, mesh)
        assert said.startswith("the input embeddings " + ("and the output head " if picks else "")
                               + "split over the vocabulary (10 of 19 rows a rank)"), said
        assert use_picking_head(split) == use_picking_head(whole) == picks
        case = {"rows": len(split.get_input_embeddings().weight.to_local()),
                "tied": split.lm_head.weight is split.get_input_embeddings().weight}
        try:  # a token the vocabulary does not have fails as the whole lookup does (before any collective)
            split(ids + 1)
        except RuntimeError as error:
            case["outside"] = str(error)
        for model, key in ((whole, "whole"), (split, "split")):
            logits = model(ids).logits
            picked = torch.zeros(())
            if picks:
                hidden = model.model(ids).last_hidden_state.flatten(0, 1)
                with model.lm_head.picking(None, targets, 0.7):
                    picked = model.lm_head(hidden)
            ((logits * upstream[..., :logits.shape[-1]]).sum() + picked.sum()).backward()
            case[key] = (logits.detach(), picked.detach(), {
                n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                for n, p in model.named_parameters()})
        found[name] = case
    return found


@pytest.fixture(scope="module")
def vocabulary_parts():
    """vocabulary_part_rank's results on 2 gloo ranks (spawned once for the tests that read them)."""
    from tests.helpers.spawn import spawned

    return spawned(vocabulary_part_rank, 2)


def test_a_vocabulary_split_over_ranks_gives_the_whole_vocabularys_logprobs_and_gradients(vocabulary_parts):
    """chunked_logprobs with `vocab` (Megatron's vocabulary-parallel output layer under tensor parallelism):
    each rank's part of the logsumexp and the targets it holds, combined over the group."""
    ranks = vocabulary_parts
    want, want_hidden, want_weight = ranks[0]["whole"]
    for name in ("28 / 12", "40 / none"):
        for measured in ranks:
            picked, grad_hidden, grad_weight, first = measured[name]
            torch.testing.assert_close(picked, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(grad_hidden, want_hidden, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(grad_weight, want_weight[first:first + len(grad_weight)], rtol=1e-5, atol=1e-5)
        assert sum(len(measured[name][2]) for measured in ranks) == 40


def test_embeddings_and_head_split_over_the_vocabulary_compute_the_whole_models_numbers(vocabulary_parts):
    """The DTensor backend's tensor parallelism splits the embeddings and the picking head over the vocabulary
    (models/vocab_parallel.py: 10 / 9 rows of 19): the logits it gathers, the logprobs it picks and every
    gradient are the whole model's (float32 sums in another order: 1e-5), on each rank; the padding token's
    embedding (rank 1's row 5) gets no gradient; tied weights stay one parameter. A critic's embeddings split
    beneath its own value head, the same values and gradients."""
    for rank, measured in enumerate(vocabulary_parts):
        for name, case in measured["models"].items():
            assert case["rows"] == (10, 9)[rank] and case["tied"] == (name == "gemma, tied"), name
            assert "a token id outside the model's vocabulary of 19" in case["outside"]
            (logits, picked, grads), (split_logits, split_picked, split_grads) = case["whole"], case["split"]
            torch.testing.assert_close(split_logits, logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(split_picked, picked, rtol=1e-5, atol=1e-5)
            assert split_grads.keys() == grads.keys()
            for key, grad in grads.items():
                torch.testing.assert_close(split_grads[key], grad, rtol=1e-5, atol=1e-5, msg=f"{name}: {key}")
            if name == "llama, untied":
                assert not split_grads["model.embed_tokens.weight"][15].any()
                assert split_grads["model.embed_tokens.weight"][14].abs().sum() > 0


def test_embeddings_tied_to_a_head_that_does_not_pick_stay_whole():
    """Gemma 2 with its final soft-capping: the head's logits are read as they are, so neither it nor the
    embeddings tied to it are split over the vocabulary; untied, the embeddings are."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from novarl.models.vocab_parallel import splits

    shape = dict(vocab_size=19, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=16, final_logit_softcapping=30.0)
    assert splits(Gemma2ForCausalLM(Gemma2Config(**shape))) == (
        False, False, "the output head gives its logits whole (it does not pick)")
    assert splits(Gemma2ForCausalLM(Gemma2Config(**shape, tie_word_embeddings=False)))[:2] == (True, False)
    assert splits(Gemma2ForCausalLM(Gemma2Config(**{**shape, "final_logit_softcapping": None}))) == (True, True, "")
    renormalising = Gemma2ForCausalLM(Gemma2Config(**{**shape, "final_logit_softcapping": None}))
    renormalising.get_input_embeddings().max_norm = 1.0  # its lookup rewrites the rows it reads: kept whole
    assert splits(renormalising)[:2] == (False, False)


def test_logits_kept_for_the_backward_or_recomputed_give_the_same_gradients(monkeypatch):
    """Small calls keep their logits for the backward (SAVE_LOGITS_BYTES): one head matmul per chunk
    fewer there, the same gradients as recomputing them."""
    from novarl.models import logprob_head

    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(10, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (10,), generator=generator)
    linear, calls = torch.nn.functional.linear, []
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: calls.append(1) or linear(*a))
    results = []
    for budget in (logprob_head.SAVE_LOGITS_BYTES, 0):
        monkeypatch.setattr(logprob_head, "SAVE_LOGITS_BYTES", budget)
        calls.clear()
        picked = chunked_logprobs(hidden, weight, targets, 0.7, 4)
        results.append((picked, torch.autograd.grad(picked.sum(), (hidden, weight)), len(calls)))
    (kept, kept_grads, kept_calls), (again, again_grads, again_calls) = results
    assert (kept_calls, again_calls) == (3, 6)  # 3 chunks of 4 rows: recomputed in the backward, or not
    assert torch.equal(kept, again)
    for k, a in zip(kept_grads, again_grads, strict=True):
        assert torch.allclose(k, a, atol=1e-6)


def test_bfloat16_matches_the_plain_heads_numbers():
    """In bf16 the logits are the head's bf16 matmul, as the plain path computes them; gradients
    within bf16's rounding (the weight's is summed over chunks in float32)."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 32, generator=generator).bfloat16().requires_grad_()
    weight = torch.randn(300, 32, generator=generator).bfloat16().requires_grad_()
    targets = torch.randint(0, 300, (40,), generator=generator)
    expected = full_logprobs(hidden, weight, targets, 1.0)
    picked = chunked_logprobs(hidden, weight, targets, 1.0, 7)
    assert torch.allclose(picked, expected, atol=1e-5)
    want = torch.autograd.grad(expected.sum(), (hidden, weight))
    got = torch.autograd.grad(picked.sum(), (hidden, weight))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        assert torch.allclose(g.float(), w.float(), rtol=2e-2, atol=2e-2)


def test_chunk_rows_keep_the_float32_logits_under_the_budget():
    assert chunk_rows(151_936) == 1766
    assert chunk_rows(151_936, chunk_bytes=1) == 1
    assert chunk_rows(64) == (1 << 30) // 256


def tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).float()


@pytest.mark.parametrize("layout", ["packed", "fixed"])
def test_a_picking_model_trains_on_the_plain_heads_logprobs_and_gradients(layout):
    from novarl.backends.training.batching import MicroBatching
    from novarl.backends.training.rows import model_logprobs
    from novarl.models.attention import use_varlen_attention

    plain = tiny_qwen2()
    picking = copy.deepcopy(plain)
    assert use_picking_head(picking, rows=5) and picking_head(picking) is picking.lm_head  # chunks of 5 rows
    assert picking.lm_head.weight is picking.model.embed_tokens.weight  # still tied
    assert picking_head(plain) is None
    generator = torch.Generator().manual_seed(2)
    lengths = torch.tensor([19, 7, 12])
    ids = torch.randint(1, 96, (3, 19), generator=generator)
    mask = torch.arange(19) < lengths[:, None]
    mb = TrainBatch.from_rows(ids, mask, mask.clone(), torch.zeros(3))
    batching = MicroBatching(layout, 3, 64, 1)
    upstream = torch.linspace(-1, 1, int(lengths.sum()))
    results = []
    for model in (plain, picking):
        attention = use_varlen_attention(model)
        logprobs, computed = model_logprobs(model, attention, mb, batching, 0.8)
        (logprobs * upstream).sum().backward()
        results.append((logprobs.detach(), computed, {n: p.grad for n, p in model.named_parameters()}))
    (want, want_computed, want_grads), (got, got_computed, got_grads) = results
    assert got_computed == want_computed
    assert torch.allclose(got, want, atol=1e-6)
    assert (got[torch.tensor([0, 19, 26])] == 0).all()  # each sequence's first token
    for name, grad in want_grads.items():
        assert torch.allclose(got_grads[name], grad, atol=1e-6), name


def tiny_moe(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=96, hidden_size=32, intermediate_size=48,
                                  moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, num_local_experts=4, num_experts=4, num_experts_per_tok=2,
                                  max_position_embeddings=64, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).float()


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_model_picks_its_heads_logprobs_and_gradients(model_type):
    """Mixtral's and Qwen3-MoE's heads are plain linear layers (PLAIN_HEAD): the picking head gives the plain
    head's logprobs and every gradient (padded rows: their attention is not novarl's packed one)."""
    from novarl.backends.training.batching import MicroBatching
    from novarl.backends.training.rows import model_logprobs

    plain = tiny_moe(model_type)
    picking = copy.deepcopy(plain)
    assert use_picking_head(picking, rows=5)
    generator = torch.Generator().manual_seed(4)
    lengths = torch.tensor([11, 6, 9])
    ids = torch.randint(1, 96, (3, 11), generator=generator)
    mask = torch.arange(11) < lengths[:, None]
    mb = TrainBatch.from_rows(ids, mask, mask.clone(), torch.zeros(3))
    upstream = torch.linspace(-1, 1, int(lengths.sum()))
    results = []
    for model in (plain, picking):
        logprobs, _ = model_logprobs(model, None, mb, MicroBatching("fixed", 3, 64, 1), 0.8)
        (logprobs * upstream).sum().backward()
        results.append((logprobs.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (want, want_grads), (got, got_grads) = results
    assert torch.allclose(got, want, atol=1e-6)
    assert got_grads.keys() == want_grads.keys() and "lm_head.weight" in got_grads
    for name, grad in want_grads.items():
        assert torch.allclose(got_grads[name], grad, atol=1e-6), name


def test_only_a_whole_plain_linear_head_of_a_plain_causal_model_picks():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from novarl.distributed.local import ensure_single_process_group

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    assert not use_picking_head(gpt2)  # not a PLAIN_HEAD architecture
    gemma2 = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gemma2", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, final_logit_softcapping=30.0))
    assert not use_picking_head(gemma2)  # its logits are soft-capped after the head
    gemma2.config.final_logit_softcapping = None
    assert use_picking_head(gemma2)  # not where its config sets no cap
    model = tiny_qwen2()
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(96))
    assert not use_picking_head(model)
    model = tiny_qwen2()  # a head a tensor-parallel plan split over the vocabulary (its weight a DTensor)
    ensure_single_process_group()
    parallelize_module(model, init_device_mesh("cpu", (1,)), {"lm_head": ColwiseParallel()})
    assert not use_picking_head(model)
    model = tiny_qwen2()
    assert use_picking_head(model)
    hidden = torch.randn(2, 3, 32)
    assert isinstance(model.lm_head, PickingHead)
    assert torch.equal(model.lm_head(hidden), hidden @ model.lm_head.weight.t())  # no request: the plain head
