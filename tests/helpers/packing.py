"""Shared by the packing tests (tests/test_packing.py, tests/test_megatron_backend.py): a batch
of mixed lengths, the three micro-batch layouts, and a policy measured under each in turn."""

from __future__ import annotations

import pytest
import torch

from novarl.algorithms.losses import make_loss
from novarl.backends.training.batching import MicroBatching
from novarl.config import load_config
from novarl.config.schema import LossConfig
from novarl.models.scores import Logprobs
from novarl.types import TrainBatch

LAYOUTS = {
    "fixed": [],
    "dynamic": ["policy.dynamic_batching.enabled=true", "policy.dynamic_batching.train_mb_tokens=72",
                "policy.dynamic_batching.logprob_mb_tokens=96", "policy.dynamic_batching.sequence_length_round=8"],
    "packed": ["policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=64",
               "policy.sequence_packing.logprob_mb_tokens=80", "policy.sequence_packing.sequence_length_round=8"],
}
"""Budgets small enough that every layout cuts the test batch into several micro-batches."""
FROZEN = ["policy.train_micro_batch_size=3", "policy.logprob_batch_size=4", "policy.scheduler=[]",
          "policy.optimizer.kwargs={lr: 0.0, weight_decay: 0.0}"]
"""lr 0: an optimizer step reports the gradient norm and changes nothing, so one policy can be
measured under every layout in turn."""


def mixed_batch(rows: int = 12, longest: int = 40, seed: int = 0, *, positive: bool = False) -> TrainBatch:
    """Sequences of 5 to `longest` tokens (a 4-token prompt, then a completion), random tokens of
    the bundled vocabulary, advantages, generator and reference logprobs (with `positive`, about
    half of them VAPO's positive examples); in groups of 1 to 3 consecutive sequences that share their prompt (as a
    GRPO group's samples do)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, longest + 1, (rows,), generator=gen)
    lengths[0] = longest
    attention_mask = torch.arange(longest) < lengths[:, None]
    loss_mask = attention_mask.clone()
    loss_mask[:, :4] = False
    ids = torch.randint(3, 18, (rows, longest), generator=gen)
    group_ids = torch.tensor([row - row % 3 if row % 7 else row for row in range(rows)])  # 3s, some cut short
    ids[:, :4] = ids[group_ids, :4]
    batch = TrainBatch.from_rows(ids, attention_mask, loss_mask, torch.randn(rows, generator=gen),
                                 -torch.rand(rows, longest, generator=gen) * loss_mask)
    batch.reference_logprobs = -torch.rand(batch.num_tokens, generator=gen)
    batch.prompt_lengths, batch.group_ids = torch.full((rows,), 4), group_ids
    if positive:  # VAPO's NLL term (LOSS) trains on these
        batch.positive = torch.rand(rows, generator=gen) < 0.5
    return batch.with_own_counts()


def batchings(layout: str, sequence_multiple: int = 1) -> tuple[MicroBatching, MicroBatching]:
    """(training, logprob) micro-batching of `layout`; sequence_multiple: what the backend pads
    lengths to a multiple of (the TP size under sequence parallelism)."""
    policy = load_config(None, overrides=[*FROZEN, *LAYOUTS[layout]]).policy
    return (MicroBatching.from_policy(policy, training=True, sequence_multiple=sequence_multiple),
            MicroBatching.from_policy(policy, training=False, sequence_multiple=sequence_multiple))


LOSS = LossConfig(reference_policy_kl_penalty=0.05, use_importance_sampling_correction=True,
                  positive_example_nll_weight=0.1)
HEAD = Logprobs(0.7)
"""The policy's head in these tests: logprobs at a sampling temperature other than 1."""


def measure(call, batch: TrainBatch, loss_cfg: LossConfig = LOSS) -> dict:
    """logprobs, then one step with the old logprobs taken from the training forward: `call(method,
    *args)` runs a policy method (in this process or on every rank of a group)."""
    logprobs = call("forward", batch, HEAD)
    batch.old_logprobs = None
    metrics = {**call("forward_backward", batch, make_loss(loss_cfg), HEAD), **call("optim_step")}
    return {"logprobs": logprobs, **metrics}


def assert_same(got: dict, expected: dict) -> None:
    torch.testing.assert_close(got["logprobs"], expected["logprobs"], rtol=1e-5, atol=1e-5)
    for name in ("loss", "grad_norm", "kl_to_reference", "logprob_mismatch", "nll_loss"):
        if name in expected:
            assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name


def group_results(factory, model_path, overrides, batch, *, sequence_multiple: int = 1) -> dict:
    """One policy on 2 Ray ranks, measured under every layout in turn (set on every rank)."""
    from novarl.distributed.ray_group import RayWorkerGroup

    cfg = load_config(None, overrides=[*FROZEN, "cluster.gpus_per_node=2", *overrides])
    group = RayWorkerGroup(factory, dict(policy=cfg.policy, model_path=str(model_path), total_steps=1),
                              world_size=2)
    try:
        return layout_results(group, batch, sequence_multiple=sequence_multiple)
    finally:
        group.shutdown()


def layout_results(group, batch, *, sequence_multiple: int = 1) -> dict:
    """A group's policy (built with FROZEN's lr 0) measured under every layout in turn."""
    results = {}
    for layout in LAYOUTS:
        train, logprob = batchings(layout, sequence_multiple)
        group.call_all("__setattr__", "train_batching", train)
        group.call_all("__setattr__", "logprob_batching", logprob)
        results[layout] = measure(group.call, batch)
    return results
