"""Token-level batches: packed, dynamically batched and padded micro-batches give the same
logprobs, loss and gradient norm, on one rank and on several (FSDP2 data and tensor/sequence
parallel, DeepSpeed ZeRO-3); the bin packers, the plan and the layouts by hand."""

import os
import random

import pytest
import torch

from novarl.backends.training.batching import (
    PACKERS,
    dynamic_groups,
    lay_out,
    micro_batch,
    plan_micro_batches,
    prompt_items,
)
from novarl.algorithms.losses import make_loss
from novarl.config import load_config
from novarl.config.schema import LossConfig
from novarl.errors import UserError
from novarl.models.loading import resolve_model_path
from novarl.rollout.batch import build_train_batch
from novarl.types import Completion, Prompt, TrainBatch
from tests.helpers.packing import FROZEN, HEAD, LAYOUTS, LOSS, assert_same, batchings, group_results, measure, mixed_batch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


# ---------------------------------------------------------------- by hand
@pytest.mark.parametrize("algorithm", sorted(PACKERS))
def test_packers_place_every_sequence_once_within_the_budget(algorithm):
    rng = random.Random(algorithm)
    lengths = [rng.randint(1, 70) for _ in range(200)] + [90]  # one longer than the budget: alone
    bins = PACKERS[algorithm](lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 64 or len(b) == 1 for b in bins)
    assert [200] in bins
    if algorithm != "concatenative":  # the decreasing first-fit ones waste little on many items
        assert len(bins) <= 1.15 * sum(lengths) / 64 + 2


def test_modified_first_fit_decreasing_by_hand():
    # large 60 takes the largest medium that fits (40); the rest fill one bin exactly
    assert sorted(map(sorted, PACKERS["modified_first_fit_decreasing"]([60, 40, 35, 30, 30, 5], 100))) == \
        [[0, 1], [2, 3, 4, 5]]


def test_dynamic_groups_pad_within_the_budget():
    lengths = [33, 7, 12, 40, 9, 18, 25, 3]
    groups = dynamic_groups(lengths, 64, 8)
    assert sorted(i for g in groups for i in g) == list(range(8))
    for group in groups:
        width = -(-max(lengths[i] for i in group) // 8) * 8
        assert len(group) * width <= 64 or len(group) == 1
    assert groups[0] == [3]  # longest first: 40 -> 40 padded, alone in 64 tokens


@pytest.mark.parametrize("layout", ["dynamic", "packed"])
@pytest.mark.parametrize("dp_size", [2, 3])
def test_plan_gives_every_rank_as_many_micro_batches_and_balanced_tokens(layout, dp_size):
    lengths = [random.Random(i).randint(5, 40) for i in range(25)]
    train, _ = batchings(layout)
    plan = plan_micro_batches(lengths, dp_size, train)
    assert len({len(r) for r in plan.ranks}) == 1
    assert sorted(i for r in range(dp_size) for i in plan.sequences(r)) == list(range(25))
    tokens = [sum(lengths[i] for i in plan.sequences(r)) for r in range(dp_size)]
    assert max(tokens) - min(tokens) <= train.tokens  # within one micro-batch's worth
    assert plan_micro_batches(lengths, dp_size, train) == plan  # every rank computes the same


def test_fixed_rows_split_uneven_counts_over_ranks():
    train, _ = batchings("fixed")  # 3 rows per micro-batch
    plan = plan_micro_batches([10] * 7, 2, train)
    assert plan.ranks == [[[0, 1, 2], None], [[3, 4, 5], [6]]]
    assert plan_micro_batches([], 2, train).ranks == [[], []]


def test_a_rank_without_work_runs_empty_micro_batches():
    train, _ = batchings("packed")
    plan = plan_micro_batches([30], 2, train)  # one sequence, two ranks
    assert plan.ranks == [[[0]], [None]]
    batch = mixed_batch(rows=1, longest=30)
    empty = micro_batch(batch, None)
    assert (len(empty), empty.num_tokens, int(empty.loss_mask.sum())) == (1, 1, 0)
    assert empty.global_valid_tokens == batch.global_valid_tokens


def test_packed_row_restarts_positions_and_maps_tokens_back():
    batch = mixed_batch(rows=3, longest=9, seed=3)
    inputs = lay_out(batch, "packed", 8, sequence_multiple=4)
    lengths = batch.lengths.tolist()
    slots = [-(-n // 4) * 4 for n in lengths]
    assert inputs.input_ids.shape == (1, -(-sum(slots) // 8) * 8) and inputs.attention_mask is None
    assert inputs.cu_seqlens.tolist()[:4] == [0, slots[0], slots[0] + slots[1], sum(slots)]
    assert torch.equal(inputs.input_ids.view(-1)[inputs.index], batch.input_ids)
    assert torch.equal(inputs.position_ids.view(-1)[inputs.index], batch.position_ids)
    padded = lay_out(batch, "fixed", 4)
    assert padded.input_ids.shape == (3, 12) and torch.equal(padded.input_ids.view(-1)[padded.index], batch.input_ids)
    assert torch.equal(padded.attention_mask.view(-1).nonzero().view(-1), padded.index)
    pipelined = lay_out(batch, "fixed", 4, rows=4, width=16)  # a pipeline's one shape
    for laid in (inputs, padded, pipelined):  # the host copy context parallelism reads, without a device wait
        assert list(laid.bounds) == laid.cu_seqlens.tolist()
    assert pipelined.bounds == (0, 16, 32, 48, 64)


def test_shared_prompt_row_by_hand():
    """Two samples of one 3-token prompt: the prompt once, then each completion; each completion
    attends to the prompt and itself; each token's logits come from its own predecessor."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 10, 0]])
    batch = TrainBatch.from_rows(ids, ids != 0, torch.ones_like(ids, dtype=torch.bool), torch.zeros(2))
    batch.prompt_lengths, batch.group_ids = torch.tensor([3, 3]), torch.tensor([4, 4])
    inputs = lay_out(batch, "packed", 8, share_prompts=True)
    assert inputs.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 0, 0]]
    assert inputs.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1]]
    assert inputs.index.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5]
    assert inputs.previous.tolist() == [-1, 0, 1, 2, 3, -1, 0, 1, 2]
    assert inputs.attention_rows.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 5, 0], [6, 7, 0, 0, 0]]
    assert inputs.attention_take.tolist() == [0, 1, 2, 3, 4, 8, 10, 11]
    assert inputs.bounds == tuple(inputs.cu_seqlens.tolist()) == (0, 8)
    batch.group_ids = torch.tensor([4, 5])  # nothing to share: the plain packed row, no gathered keys
    alone, plain = lay_out(batch, "packed", 8, share_prompts=True), lay_out(batch, "packed", 8)
    assert alone.attention_rows is None and alone.shared_keys is None
    assert torch.equal(alone.input_ids, plain.input_ids) and torch.equal(alone.cu_seqlens, plain.cu_seqlens)
    items, sizes = prompt_items([5, 4, 6], [3, 3, 2], [4, 4, 9], capacity=64)
    assert (items, sizes) == ([[0, 1], [2]], [6, 6])
    assert prompt_items([5, 4], [3, 3], [4, 4], capacity=5) == ([[0], [1]], [5, 4])  # too big together: cut


def test_rollout_batch_is_token_level_with_per_sequence_or_per_token_advantages():
    prompt = Prompt(text="1+1=", token_ids=[1, 5, 6], answer="2")
    completions = [Completion(prompt, [7, 2], [-0.5, -0.25], "2", "stop", 0),
                   Completion(prompt, [8, 9, 9], [-1.0, -2.0, -3.0], "3", "length", 0)]
    batch = build_train_batch(completions, torch.tensor([1.0, -1.0]), overlong_filtering=True)
    assert batch.cu_seqlens.tolist() == [0, 5, 11]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]
    assert batch.loss_mask.tolist() == [False] * 3 + [True, True] + [False] * 6  # the cut one filtered
    assert batch.advantages.tolist() == [1.0] * 5 + [-1.0] * 6
    assert batch.to_rows(batch.generator_logprobs)[1, 3:].tolist() == [-1.0, -2.0, -3.0]
    assert (batch.global_valid_tokens, batch.global_valid_sequences) == (2, 1)
    assert batch.prompt_lengths.tolist() == [3, 3] and batch.group_ids.tolist() == [0, 0]
    per_token = torch.arange(11, dtype=torch.float32)
    assert torch.equal(build_train_batch(completions, per_token).advantages, per_token)
    with pytest.raises(ValueError, match="one per sequence or one per token"):
        build_train_batch(completions, torch.zeros(3))


# ---------------------------------------------------------------- one rank
@pytest.fixture(scope="module")
def one_rank_policy():
    from novarl.backends.training.dtensor import DTensorPolicy
    from novarl.distributed.local import ensure_single_process_group

    ensure_single_process_group()
    cfg = load_config(None, overrides=FROZEN)
    return DTensorPolicy(cfg.policy, resolve_model_path("tiny-arith"), torch.device("cpu"), total_steps=1)


def local_call(policy):
    return lambda method, *args: getattr(policy, method)(*args)


@pytest.mark.parametrize("loss_cfg", [LOSS, LossConfig(token_level_loss=False, sequence_level_importance_ratios=True)],
                         ids=["token-level", "sequence-level"])
def test_one_rank_packed_and_dynamic_match_padded(one_rank_policy, loss_cfg):
    batch = mixed_batch(positive=True)
    results = {}
    for layout in LAYOUTS:
        one_rank_policy.train_batching, one_rank_policy.logprob_batching = batchings(layout)
        results[layout] = measure(local_call(one_rank_policy), batch, loss_cfg)
    assert_same(results["packed"], results["fixed"])
    assert_same(results["dynamic"], results["fixed"])
    assert results["packed"]["tokens_computed"] < results["dynamic"]["tokens_computed"] \
        < results["fixed"]["tokens_computed"]
    # the step's logprobs are the model's: position 0 of each sequence holds 0
    assert not results["packed"]["logprobs"][batch.cu_seqlens[:-1]].any()


def test_packed_logprobs_equal_transformers_on_each_sequence_alone(one_rank_policy):
    """The reference is transformers' own SDPA model, one sequence at a time: packing (with
    novarl's varlen attention) and padding both give its numbers."""
    from novarl.models.loading import load_causal_lm, token_logprobs

    assert one_rank_policy.attention == "novarl_varlen"  # llama: novarl's varlen attention is in use
    batch = mixed_batch(rows=6, seed=5)
    reference = load_causal_lm(resolve_model_path("tiny-arith"))
    assert reference.config._attn_implementation == "sdpa"
    with torch.no_grad():
        expected = torch.cat([token_logprobs(reference(input_ids=batch.input_ids[a:b][None]).logits,
                                             batch.input_ids[a:b][None], 0.7)[0]
                              for a, b in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist())])
    for layout in ("packed", "fixed"):
        one_rank_policy.train_batching, one_rank_policy.logprob_batching = batchings(layout)
        torch.testing.assert_close(one_rank_policy.forward(batch, HEAD), expected, rtol=1e-5, atol=1e-5)


def test_varlen_attention_equals_sdpa_with_a_block_diagonal_mask():
    from novarl.models.attention import varlen_attention

    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    query = torch.randn(1, 4, 16, 8, generator=gen, requires_grad=True)
    key, value = torch.randn(1, 2, 16, 8, generator=gen), torch.randn(1, 2, 16, 8, generator=gen)
    module = torch.nn.Module().eval()
    got, _ = varlen_attention(module, query, key, value, None, scaling=0.3, cu_seq_lens_q=cu)
    sequence = torch.repeat_interleave(torch.arange(4), cu.diff().long())
    allowed = (sequence[:, None] == sequence[None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(2, 1),
                                                            value.repeat_interleave(2, 1), attn_mask=allowed,
                                                            scale=0.3).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    (grad_got,) = torch.autograd.grad(got.sum(), query)
    (grad_want,) = torch.autograd.grad(want.sum(), query)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-5, atol=1e-6)


def test_a_model_that_attends_across_packed_sequences_is_refused():
    """A model whose attention ignores position ids (as some remote-code models' do) would mix
    packed sequences: the start-up check refuses packing for it, naming the way out."""
    from novarl.backends.training.rows import check_packing
    from novarl.models.attention import use_varlen_attention
    from novarl.models.loading import load_causal_lm

    model = load_causal_lm(resolve_model_path("tiny-arith"))
    attention = use_varlen_attention(model)

    class IgnoresPositions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(self, input_ids, position_ids, attention_mask, use_cache, **boundaries):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)

    _, logprob = batchings("packed")
    with pytest.raises(UserError, match="attends across sequences.*dynamic_batching"):
        check_packing(IgnoresPositions(), attention, logprob, torch.device("cpu"))
    check_packing(model, attention, logprob, torch.device("cpu"))  # the real model passes


def test_every_parameter_is_trained_with_packing(one_rank_policy):
    """The optimizer holds the parameters the model trains (FSDP2 swaps a root module's
    parameters while it is unsharded: nothing may run a forward before the optimizer exists)."""
    one_rank_policy.train_batching, one_rank_policy.logprob_batching = batchings("packed")
    batch = mixed_batch(rows=4)
    batch.old_logprobs = None
    one_rank_policy.forward_backward(batch, make_loss(LOSS), HEAD)
    held = {id(p) for group in one_rank_policy.optimizer.param_groups for p in group["params"]}
    assert all(id(p) in held and p.grad is not None for p in one_rank_policy.model.parameters())
    one_rank_policy.optim_step()


# ---------------------------------------------------------------- several ranks
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2-dp2", "tp2-sp", "zero3-dp2"])
def test_two_ranks_packed_and_dynamic_match_padded(ray_session, tmp_path, layout):
    from tests.helpers.models import two_kv_head_copy

    batch = mixed_batch(rows=14, positive=True)
    if layout == "zero3-dp2":
        pytest.importorskip("deepspeed")
        from novarl.backends.training.deepspeed import DeepSpeedPolicy

        results = group_results(DeepSpeedPolicy, resolve_model_path("tiny-arith"),
                                ["policy.deepspeed_cfg.enabled=true", "policy.deepspeed_cfg.zero_stage=3",
                                 "policy.dtensor_cfg.enabled=false"], batch)
    else:
        from novarl.backends.training.dtensor import DTensorPolicy

        overrides, model = [], resolve_model_path("tiny-arith")
        if layout == "tp2-sp":
            model = two_kv_head_copy(tmp_path / "kv2")
            overrides = ["policy.dtensor_cfg.tensor_parallel_size=2", "policy.dtensor_cfg.sequence_parallel=true"]
        results = group_results(DTensorPolicy, model, overrides, batch, sequence_multiple=2 if overrides else 1)
    assert_same(results["packed"], results["fixed"])
    assert_same(results["dynamic"], results["fixed"])
    assert results["packed"]["tokens_computed"] < results["fixed"]["tokens_computed"]


# ---------------------------------------------------------------- config and planner
def test_packing_and_dynamic_batching_exclude_each_other_and_budgets_hold_a_sequence():
    from novarl.errors import ConfigError
    from novarl.backends.contract.resolve import plan_batches

    with pytest.raises(ConfigError, match="exclude each other"):
        plan_batches(load_config(None, overrides=["policy.sequence_packing.enabled=true",
                                                  "policy.dynamic_batching.enabled=true"]))
    with pytest.raises(ConfigError, match=r"policy.dynamic_batching.logprob_mb_tokens=100 is smaller than "
                                          r"policy.max_seq_length=512"):
        plan_batches(load_config(None, overrides=["policy.dynamic_batching.enabled=true",
                                                  "policy.dynamic_batching.logprob_mb_tokens=100"]))
    with pytest.raises(ConfigError, match="pipeline stages exchange buffers of one shape"):
        plan_batches(load_config(None, overrides=[
            "policy.dynamic_batching.enabled=true", "policy.megatron_cfg.enabled=true",
            "policy.megatron_cfg.pipeline_model_parallel_size=2", "cluster.gpus_per_node=2"]))
    with pytest.raises(ConfigError, match="algorithm"):
        load_config(None, overrides=["policy.sequence_packing.algorithm=best_fit"])


def test_validate_and_plan_describe_packing_as_running(capsys):
    from novarl.cli import main

    assert main(["validate", "policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=512",
                 "policy.generation.backend=hf"]) == 0
    out = capsys.readouterr().out
    assert "packed micro-batches: sequences end to end, at most 512 tokens per row" in out
    assert "not available" not in out
    assert main(["plan", "policy.dynamic_batching.enabled=true", "policy.sequence_packing.enabled=false",
                 "policy.generation.backend=hf"]) == 0
    out = capsys.readouterr().out
    assert "dynamic micro-batches: rows of similar length" in out and "not available" not in out


def test_the_advisor_sizes_activations_by_the_packed_row():
    from novarl.plan.advisor import advise
    from novarl.backends.contract.model_shape import ModelShape
    from novarl.backends.contract.resolve import micro_batch_shape

    policy = load_config(None, overrides=["policy.max_seq_length=1024", "policy.train_micro_batch_size=2",
                                          "policy.sequence_packing.enabled=true",
                                          "policy.sequence_packing.train_mb_tokens=8192"]).policy
    assert micro_batch_shape(policy) == {"sequence_length": 1024, "micro_batch_size": 1, "packed_row_tokens": 8192}
    shape = ModelShape.from_parameter_count(1.5e9)

    def activations(**workload) -> float:
        advice = advise(shape, gpus_per_node=1, num_nodes=1, **workload)
        return next(c for c in advice.candidates if c.strategy == "dtensor fsdp2").memory_gb["activations"]

    # a row of 8192 packed tokens holds the activations of 8 sequences of 1024, not of 2
    assert activations(**micro_batch_shape(policy)) == pytest.approx(activations(sequence_length=8192))
    # (4x the layers' activations; the output head's one chunk of float32 logits is the same in both)
    assert activations(**micro_batch_shape(policy)) > 2.5 * activations(sequence_length=1024, micro_batch_size=2)


def test_host_tensors_are_pinned_dense_and_a_batch_on_its_device_keeps_its_host_copy(monkeypatch):
    """torch pins a host tensor into a copy with its strides: lay_out's positions (an expanded arange, stride 0)
    made a copy that overlaps itself, and every padded micro-batch moved to a GPU raised (emulated here on the
    CPU as ATen's _pin_memory does it; types.pinned copies it dense first). A batch already on its CUDA device,
    named without an index, is not moved again (that dropped its host copy: reads back to the host each
    micro-batch after)."""
    from novarl.types import on_device, pinned

    def pin_as_aten(self):  # ATen's _pin_memory: a buffer with the source's sizes and strides, then copy_
        return torch.empty_strided(self.size(), self.stride(), dtype=self.dtype).copy_(self)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_as_aten)
    positions = torch.arange(6).expand(3, 6)
    with pytest.raises(RuntimeError, match="more than one element"):
        positions.pin_memory()
    assert torch.equal(pinned(positions), positions)
    if torch.cuda.is_available():
        batch = mixed_batch(rows=4).to(torch.device("cuda", torch.cuda.current_device()))
        assert on_device(batch.input_ids, torch.device("cuda"))
        assert batch.to(torch.device("cuda")) is batch and batch.host is not None
