"""Context parallelism on the DTensor backend (models/context_parallel.py): every sequence split in
2 x cp load-balanced chunks over the cp ranks, the keys and values all-gathered. On 4 gloo ranks:
over cp groups of 2, a Llama with grouped-query attention gives the same logprobs and gradients on
long packed rows of several sequences (and on padded rows) as the whole rows on one rank; and the
DTensor policy on dp 2 x cp 2 (FSDP2 over all four), and on cp 2 x tp 2, takes the same optimizer
step as one rank.
What cp does not run is refused at validate."""

from __future__ import annotations

import pytest
import torch

from novarl.models.context_parallel import balanced_chunks
from novarl.types import TrainBatch
from tests.helpers.spawn import send, spawned

LENGTHS = (200, 37, 64, 23)
"""A long sequence and three short ones, packed into one row (or padded rows)."""
LAYOUTS = ("packed", "fixed")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).float()


def batch():
    generator = torch.Generator().manual_seed(3)
    longest = max(LENGTHS)
    ids = torch.randint(1, 64, (len(LENGTHS), longest), generator=generator)
    mask = torch.arange(longest) < torch.tensor(LENGTHS)[:, None]
    return TrainBatch.from_rows(ids, mask, mask.clone(), torch.zeros(len(LENGTHS)))


def logprobs_and_grads(context, layout: str):
    """The batch's logprobs and the gradient of a weighted sum of them, on this process's ranks."""
    from novarl.backends.training.batching import MicroBatching
    from novarl.backends.training.rows import model_logprobs

    model = tiny_llama()
    attention = None
    if context is not None:
        from novarl.models.context_parallel import use_context_parallel_attention

        attention = use_context_parallel_attention(model)
    mb = batch()
    batching = MicroBatching(layout, len(LENGTHS), 1024, 8)
    logprobs, _ = model_logprobs(model, attention, mb, batching, 0.7, context=context)
    weights = torch.linspace(-1, 1, len(logprobs))
    (logprobs * weights).sum().backward()
    return logprobs.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_each_rank_gets_two_balanced_chunks_of_every_sequence():
    cu = (0, 8, 24)  # two sequences of 8 and 16 tokens, cp = 2: chunks of 2 and 4
    first, second = balanced_chunks(cu, 2)
    assert first == [(0, 0, 2), (6, 0, 2), (8, 8, 4), (20, 8, 4)]  # chunks 0 and 3 of each
    assert second == [(2, 0, 2), (4, 0, 2), (12, 8, 4), (16, 8, 4)]  # chunks 1 and 2
    with pytest.raises(ValueError, match="multiple of 4 tokens; one has 6"):
        balanced_chunks((0, 6), 2)


def test_context_parallelism_is_refused_where_it_does_not_run(capsys):
    from novarl.cli import main
    from tests.helpers import HF

    assert main(["validate", HF, "cluster.gpus_per_node=4", "policy.dtensor_cfg.context_parallel_size=2",
                 "policy.dtensor_cfg.tensor_parallel_size=2", "policy.dtensor_cfg.sequence_parallel=true"]) == 2
    assert "context_parallel_size=2 with sequence_parallel" in capsys.readouterr().err
    assert main(["validate", HF, "cluster.gpus_per_node=2", "policy.dtensor_cfg.context_parallel_size=2",
                 "policy.deepspeed_cfg.enabled=true", "policy.dtensor_cfg.enabled=false"]) == 2
    assert "splits sequences on the DTensor backend; this run trains on deepspeed" in capsys.readouterr().err


# ------------------------------------------------ 4 gloo ranks: cp groups of 2, the policy on dp 2 x cp 2
def attention_check(world: int) -> dict:
    """Per layout, the bare model's logprobs and gradients (logprobs_and_grads): whole rows on one
    rank, or over a cp group of 2 (ranks 0-1 and 2-3), each gradient summed over it and halved
    (each cp rank holds cp x its share: see models/context_parallel.py)."""
    import torch.distributed as dist

    groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)] if world > 1 else []
    group = groups[dist.get_rank() // 2] if groups else None
    out = {}
    for layout in LAYOUTS:
        logprobs, grads = logprobs_and_grads(group, layout)
        for grad in grads.values() if group is not None else ():
            dist.all_reduce(grad, group=group)
            grad /= 2
        out[layout] = (logprobs, grads)
    return out


def one_step(model_path: str, world: int, *parallel: str) -> tuple:
    """One optimizer step of the DTensor policy on a batch of 6 sequences, then the batch's logprobs:
    (loss, grad norm, tokens computed, logprobs, the rows the picking head scored: no logits over the
    vocabulary were made)."""
    from novarl.algorithms.losses import make_loss
    from novarl.backends.training.dtensor import DTensorPolicy
    from novarl.models import logprob_head
    from novarl.models.scores import Logprobs
    from novarl.cli import BUNDLED_RECIPE
    from novarl.config import load_config
    from tests.helpers import HF

    cfg = load_config(BUNDLED_RECIPE, overrides=[
        HF, f"cluster.gpus_per_node={world}", *parallel, "policy.sequence_packing.share_prompts=false",
        "policy.train_micro_batch_size=2"])
    policy = DTensorPolicy(cfg.policy, model_path, torch.device("cpu"), total_steps=4, seed=cfg.grpo.seed)
    generator = torch.Generator().manual_seed(5)
    lengths = torch.tensor([29, 7, 18, 12, 25, 9])
    ids = torch.randint(3, 19, (len(lengths), int(lengths.max())), generator=generator)
    mask = torch.arange(ids.shape[1]) < lengths[:, None]
    loss_mask = mask & (torch.arange(ids.shape[1]) >= 4)  # a 4-token prompt
    batch = TrainBatch.from_rows(ids, mask, loss_mask, torch.linspace(-1, 1, len(lengths))).with_own_counts()
    picked, chunked = [], logprob_head.chunked_logprobs

    def counted(hidden, *args):
        picked.append(len(hidden))
        return chunked(hidden, *args)

    logprob_head.chunked_logprobs = counted
    metrics = policy.forward_backward(batch, make_loss(cfg.loss_fn), Logprobs())
    metrics.update(policy.optim_step())
    logprobs = policy.forward(batch, Logprobs())
    logprob_head.chunked_logprobs = chunked
    return metrics["loss"], metrics["grad_norm"], metrics["tokens_computed"], logprobs, sum(picked)


def identical_loss_gradient(world: int) -> torch.Tensor:
    """A loss every rank of a cp group of 2 computes alike from the gathered per-position scores
    (ContextShard.gather_identical_loss, Megatron's context parallelism), its gradient summed over
    the group; world 1: the whole row on one rank."""
    import torch.distributed as dist

    from novarl.models.context_parallel import shard_rows

    weight = torch.linspace(-1, 1, 24, requires_grad=True)
    cu = (0, 8, 24)  # two sequences
    if world == 1:
        full = weight * 3
    else:
        groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank makes every group
        group = groups[dist.get_rank() // 2]
        shard = shard_rows(cu, group, torch.device("cpu"))
        full = shard.gather_identical_loss(weight.index_select(0, shard.local) * 3)
    (full.pow(2) * torch.arange(24)).sum().backward()
    grad = weight.grad
    if world > 1:
        dist.all_reduce(grad, group=group)
    return grad


def policy_rank(rank: int, world: int, rendezvous: str, results, two_kv: str) -> None:
    """The attention check, then one step of the DTensor policy: tiny-arith (world 1: cp 1; world 4:
    dp 2 x cp 2) and its two-key/value-head copy (world 1; world 4: cp 2 x tp 2)."""
    import torch.distributed as dist

    from novarl.models.loading import resolve_model_path

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    torch.set_num_threads(1)
    attention = attention_check(world)
    attention["identical loss"] = identical_loss_gradient(world)
    split = world > 1
    dp_cp = one_step(str(resolve_model_path("tiny-arith")), world,
                     f"policy.dtensor_cfg.context_parallel_size={2 if split else 1}")
    cp_tp = one_step(two_kv, world, f"policy.dtensor_cfg.context_parallel_size={2 if split else 1}",
                     f"policy.dtensor_cfg.tensor_parallel_size={2 if split else 1}")
    send(results, rank, (dp_cp, cp_tp, attention))


def test_context_parallel_attention_and_the_policy_on_dp2_x_cp2_and_cp2_x_tp2_match_one_rank(tmp_path):
    from tests.helpers.models import two_kv_head_copy

    two_kv = str(two_kv_head_copy(tmp_path / "kv2"))
    (one_dp_cp, one_cp_tp, whole), = spawned(policy_rank, 1, two_kv)
    for dp_cp, cp_tp, split in spawned(policy_rank, 4, two_kv):  # FSDP2 over dp x cp; TP inside each cp rank
        # the gathered scores' gradient comes back to each rank's own positions once, not cp times
        assert torch.allclose(split["identical loss"], whole["identical loss"])
        for layout in LAYOUTS:  # the attention alone, on long packed rows and on padded ones
            (want, want_grads), (got, grads) = whole[layout], split[layout]
            assert len(got) == sum(LENGTHS) and torch.allclose(got, want, atol=1e-5), layout
            for name, grad in grads.items():
                assert torch.allclose(grad, want_grads[name], atol=1e-5, rtol=1e-4), (layout, name)
        for (loss, grad_norm, tokens, logprobs, _), (rank_loss, rank_norm, rank_tokens, rank_logprobs, picked) in (
                (one_dp_cp, dp_cp), (one_cp_tp, cp_tp)):
            assert 0.45 < rank_tokens / tokens < 0.65  # a cp rank computes half of each sequence (padded to 4)
            assert picked > 0  # the rank's positions scored by the picking head: no logits over the vocabulary
            assert rank_loss == pytest.approx(loss, abs=1e-6)
            assert rank_norm == pytest.approx(grad_norm, rel=1e-4)
            assert torch.allclose(rank_logprobs, logprobs, atol=1e-5)  # after the step: the same update
