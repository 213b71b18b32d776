"""PPO's critic on the DTensor backend, one in-process rank: a scalar head on the policy's
architecture, values read like logprobs (each token's from its predecessor's state), trained by
the clipped value loss, and its state resumable."""

from __future__ import annotations

import pytest
import torch

from novarl.algorithms.losses import ValueLossSettings, value_loss
from novarl.config import load_config
from novarl.models.scores import Logprobs, Values
from tests.helpers.packing import mixed_batch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def critic():
    from novarl.backends.training.dtensor import DTensorCritic
    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.loading import resolve_model_path

    ensure_single_process_group()
    cfg = load_config(None, overrides=["policy.train_micro_batch_size=4", "policy.logprob_batch_size=4",
                                       "policy.scheduler=[]", "policy.optimizer.kwargs={lr: 1.0e-2}"])
    return DTensorCritic(cfg.policy, resolve_model_path("tiny-arith"), torch.device("cpu"), total_steps=100)


def test_values_start_at_zero_and_read_each_tokens_predecessor(critic):
    batch = mixed_batch(rows=6, longest=9)
    assert torch.equal(critic.forward(batch, Values()), torch.zeros(batch.num_tokens))
    with pytest.raises(TypeError, match="scalar value head"):  # no vocabulary: no logprobs
        critic.forward(batch, Logprobs())
    with torch.no_grad():  # a head that reads the hidden state: the values must come from position t-1
        critic.model.lm_head.weight.normal_(0, 0.1)
        critic.model.lm_head.bias.fill_(0.25)
    values = critic.forward(batch, Values())
    head = critic.model.lm_head  # one device: the plain module (backends/training/one_device.py), float32
    weight, bias = head.weight, head.bias
    for s in range(len(batch)):
        tokens = batch.token_index([s])
        ids = batch.input_ids[tokens][None]
        with torch.no_grad():
            hidden = critic.model.model(input_ids=ids).last_hidden_state[0]
        expected = torch.cat([torch.zeros(1), (hidden[:-1] @ weight.T + bias).squeeze(-1)])
        assert torch.allclose(values[tokens], expected, atol=1e-5)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()


def test_the_value_loss_trains_the_values_towards_the_returns_and_resumes(critic, tmp_path):
    batch = mixed_batch(rows=8, longest=9)
    returns = torch.where(batch.loss_mask, torch.linspace(-1, 1, batch.num_tokens), torch.zeros(batch.num_tokens))
    batch.returns, batch.old_values = returns, critic.forward(batch, Values())
    settings = ValueLossSettings(scale=0.5, cliprange=None)
    losses = []
    for _ in range(30):
        trained = critic.forward_backward(batch, lambda v, mb: value_loss(v, mb, settings), Values())
        losses.append(trained["value_loss"])
        critic.optim_step()
    assert losses[-1] < 0.5 * losses[0]
    critic.save(tmp_path / "critic")
    critic.forward_backward(batch, lambda v, mb: value_loss(v, mb, settings), Values())
    critic.optim_step()
    after_one_more = critic.forward(batch, Values())
    critic.load(tmp_path / "critic")  # weights, Adam's moments and the schedule: the same next step
    critic.forward_backward(batch, lambda v, mb: value_loss(v, mb, settings), Values())
    critic.optim_step()
    assert torch.equal(critic.forward(batch, Values()), after_one_more)


def test_the_clipped_value_loss_holds_values_near_the_old_ones():
    mask = torch.tensor([[False, True, True]])
    from novarl.types import TrainBatch

    batch = TrainBatch.from_rows(torch.zeros((1, 3), dtype=torch.long), torch.ones((1, 3), dtype=torch.bool), mask,
                                 torch.zeros(1))
    batch.returns, batch.old_values = torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 0.0, 0.0])
    values = torch.tensor([0.0, 0.5, 0.1], requires_grad=True)
    loss, metrics = value_loss(values, batch, ValueLossSettings(scale=2.0, cliprange=0.2))
    # token 1: max((0.5-1)^2, (0.2-1)^2) = 0.64; token 2: max(0.81, 0.81) = 0.81 -> 2 x 0.5 x (0.64 + 0.81) / 2
    assert float(loss.detach()) == pytest.approx(0.725)
    assert float(metrics["value_clip_fraction"]) == pytest.approx(0.5)
    loss.backward()  # the clipped branch has no gradient: token 1's value is held
    assert values.grad.tolist() == pytest.approx([0.0, 0.0, 2 * 0.5 * 2 * (0.1 - 1) / 2])


def test_the_critic_on_zero3_over_two_ranks_trains_like_one_dtensor_rank(tmp_path):
    """The same values, trained the same way, on DeepSpeed ZeRO-3 over 2 Ray ranks (gloo) as on
    one DTensor rank; and its partitioned state resumes to the same next step."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("deepspeed")
    import os
    from functools import partial

    from novarl.backends.training.deepspeed import DeepSpeedCritic
    from novarl.backends.training.dtensor import DTensorCritic
    from novarl.distributed.ray_group import RayWorkerGroup
    from novarl.models.loading import resolve_model_path

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    overrides = ["policy.train_micro_batch_size=4", "policy.logprob_batch_size=4", "policy.scheduler=[]",
                 "policy.optimizer.kwargs={lr: 1.0e-2}"]
    path = resolve_model_path("tiny-arith")
    batch = mixed_batch(rows=8, longest=9)
    batch.returns = torch.where(batch.loss_mask, torch.linspace(-1, 1, batch.num_tokens), 0.0)
    batch.old_values = torch.zeros(batch.num_tokens)
    loss = partial(value_loss, settings=ValueLossSettings(scale=0.5, cliprange=0.5))

    def train(call, steps: int) -> torch.Tensor:
        for _ in range(steps):
            call("forward_backward", batch, loss, Values())
            call("optim_step")
        return call("forward", batch, Values())

    one = DTensorCritic(load_config(None, overrides=overrides).policy, path, torch.device("cpu"), total_steps=100)
    expected = train(lambda method, *args: getattr(one, method)(*args), 4)
    cfg = load_config(None, overrides=[*overrides, "cluster.gpus_per_node=2", "policy.deepspeed_cfg.enabled=true",
                                       "policy.deepspeed_cfg.zero_stage=3"])
    group = RayWorkerGroup(DeepSpeedCritic, dict(policy=cfg.policy, model_path=path, total_steps=100), world_size=2)
    try:
        assert torch.allclose(train(group.call, 4), expected, atol=1e-5)
        group.call("save", tmp_path / "critic")
        after_one_more = train(group.call, 1)
        group.call("load", tmp_path / "critic")
        assert torch.allclose(train(group.call, 1), after_one_more, atol=1e-7)
    finally:
        group.shutdown()
        ray.shutdown()
