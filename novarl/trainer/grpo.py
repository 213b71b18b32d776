"""The GRPO loop: generate -> reward -> advantage -> update -> weight sync.

Simplifications, on purpose: one rollout turn; the whole step's samples are
generated before any update (synchronous, on-policy); `old_logprobs` are the
trainer's (not the generator's) so the ratio compares like with like -- from the
training forward itself when the batch gets one optimizer step, from a forward
before training otherwise -- and the gap to the generator's logprobs is logged
as `logprob_mismatch`, a check on the weight sync.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch

from novarl.algorithms.advantages import (ADVANTAGE_ESTIMATORS, AdvantageSettings, GAESettings, ppo_advantages,
                                          reinforce_plus_plus_with_kl)
from novarl.algorithms.losses import (ClippedPGSettings, LossFn, ValueLossSettings, aggregation, clamped_kl,
                                      make_loss, value_loss)
from novarl.config.schema import NovaRLConfig
from novarl.errors import CheckpointLoadFailed, UserError
from novarl.logging.console import Progress, info
from novarl.logging.metrics import JsonlSink
from novarl.trainer.checkpoint import CRITIC_DIR, POLICY_DIR, Checkpoint, Checkpointer, restore_rng
from novarl.trainer.evaluate import evaluate
from novarl.trainer.collect import collect
from novarl.trainer.rollout import MISMATCH_WARNING, build_train_batch, logprob_mismatch, mismatch_advice
from novarl.trainer.setup import Roles, RunInputs, critic_global_batch_size, value_section
from novarl.types import TrainBatch


class StepTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[f"time_{name}"] = self.seconds.get(f"time_{name}", 0.0) + time.perf_counter() - start


def run_grpo(cfg: NovaRLConfig, inputs: RunInputs, roles: Roles, sink: JsonlSink,
             checkpointer: Checkpointer | None = None, resume: Checkpoint | None = None) -> dict[str, float]:
    """Train for grpo.max_num_steps (fewer when grpo.max_num_epochs ends first, or on
    max_train_seconds); returns the last metrics, evals included.

    With `resume`, the policy, data position and step count come from that checkpoint
    and the loop continues as the uninterrupted run would have.
    """
    grpo, gen = cfg.grpo, cfg.policy.generation
    loss_fn = make_loss(cfg.loss_fn, gen.max_new_tokens)
    # GAE (PPO) reads the critic's values per token: not one of the per-sequence estimators
    estimate_advantages = None if roles.critic else ADVANTAGE_ESTIMATORS.get(grpo.adv_estimator.name)
    step = resume_from(resume, inputs, roles, sink) if resume else 0
    max_steps = inputs.max_steps or grpo.max_num_steps  # fewer when grpo.max_num_epochs ends first
    pipeline = start_async_rollouts(cfg, inputs, roles, max_steps, resume, step) if grpo.async_grpo.enabled else None
    progress = Progress(max_steps, enabled=cfg.logger.progress_bar,
                        print_every=cfg.logger.print_every_n_steps, initial=step)
    summary: dict[str, float] = dict(resume.state.get("summary", {})) if resume else {}
    summary.pop("stopped_on_time_budget", None)  # this run's own ending decides
    saved = step

    def checkpoint(step: int, *, last: bool) -> None:
        nonlocal saved
        if checkpointer and saved != step and checkpointer.due(step, last=last):
            checkpointer.save(step, roles.policy, trainer_state(inputs, summary, pipeline), metrics=sink.path,
                              critic=roles.critic, rollouts=pipeline.state() if pipeline is not None else None)
            saved = step

    def validate(step: int) -> None:
        if pipeline is not None:  # the engines evaluate the newest weights
            pipeline.sync(step)
        result = evaluate(roles.generator, inputs.val_prompts, inputs.scorer, gen.max_new_tokens,
                          batch_size=grpo.val_batch_size, samples_to_print=cfg.logger.num_val_samples_to_print)
        sink.write({"kind": "eval", "step": step, **result})
        progress.evaluated(step, result["accuracy"], source=inputs.val_source)
        summary.update({f"val_{k}": v for k, v in result.items()}, val_step=step)
        summary.setdefault("initial_accuracy", result["accuracy"])

    info(old_logprobs_source(cfg, inputs))
    if roles.critic is not None:
        info(ppo_description(cfg))
    if zero_advantage_trains_nothing(cfg):
        info("samples with an advantage of 0 (GRPO groups whose rewards are all equal) are left out of the update: "
             "without a KL penalty their loss and gradient are 0 (the loss still divides by every token)")
    try:
        if grpo.val_at_start and step == 0:
            validate(0)
        started = time.perf_counter()
        while step < max_steps:
            if grpo.max_train_seconds and time.perf_counter() - started > grpo.max_train_seconds:
                progress.stopped_early(time_budget_message(step, max_steps, grpo.max_train_seconds))
                summary["stopped_on_time_budget"] = 1.0
                break
            step += 1
            metrics = grpo_step(cfg, inputs, roles, loss_fn, estimate_advantages, step, pipeline)
            # asynchronous: the generator's weights lag by a step, so the gap is not a sync problem
            if metrics["logprob_mismatch"] > MISMATCH_WARNING and not summary.get("mismatch_warned") and not pipeline:
                info(f"warning at step {step}: {mismatch_advice(metrics['logprob_mismatch'])}")
                summary["mismatch_warned"] = 1.0
            sink.write({"kind": "train", "step": step, **metrics})
            progress.step(step, metrics)
            summary.update(metrics)
            if grpo.val_period and step % grpo.val_period == 0 and not (grpo.val_at_end and step == max_steps):
                validate(step)
            checkpoint(step, last=False)
        summary["steps"] = step
        if grpo.val_at_end:
            validate(step)
        checkpoint(step, last=True)
        if pipeline is not None:
            pipeline.finish()
    finally:
        progress.close()  # before any error is printed: it must not land inside the bar
    return summary


def start_async_rollouts(cfg: NovaRLConfig, inputs: RunInputs, roles: Roles, max_steps: int,
                         resume: Checkpoint | None, step: int):
    """Asynchronous GRPO's rounds in flight (async_rollouts.py), those of `resume` restored."""
    from novarl.backends.generation.engines import LocalGeneration
    from novarl.trainer.async_rollouts import AsyncRollouts, async_description

    pipeline = AsyncRollouts(cfg, inputs, roles, max_steps)
    pipeline.restore(resume.rollouts() if resume else None, step)
    info(async_description(cfg, in_process=isinstance(roles.generator, LocalGeneration)))
    return pipeline


def trainer_state(inputs: RunInputs, summary: dict[str, float], pipeline=None) -> dict:
    """What a checkpoint's state holds: the data position and the summary so far; with
    asynchronous GRPO the position before the oldest round in flight (the rounds themselves go
    into rollouts.pt, so that a resume trains on them: async_rollouts.py)."""
    sampler = inputs.sampler.state_dict() if pipeline is None else pipeline.sampler_state()
    return {"sampler": sampler, "summary": summary}


def grpo_step(cfg: NovaRLConfig, inputs: RunInputs, roles: Roles, loss_fn: LossFn, estimate_advantages,
              step: int, pipeline=None) -> dict[str, float]:
    """One synchronous step: generate, reward, (values,) advantages, logprobs, update (ppo_epochs
    passes; the critic first, as NeMo RL and verl do), weight sync."""
    grpo = cfg.grpo
    timer, tic = StepTimer(), time.perf_counter()
    if pipeline is None:
        rollouts, pipeline_metrics = collect(cfg, inputs, roles, step, timer), {}
    else:  # asynchronous: generated during earlier steps (async_rollouts.py)
        queued = pipeline.advance(step, timer)
        rollouts, pipeline_metrics = pipeline.take(step, timer)
        pipeline_metrics.update(queued)
    batch = build_train_batch(rollouts.completions, torch.zeros(len(rollouts.completions)),
                              overlong_filtering=grpo.overlong_filtering)
    critic = roles.critic
    policy_trains = step > grpo.policy_training_start_step  # before: the critic's warm-up
    # REINFORCE++'s KL in the reward and PPO's values: the advantages need the forwards first
    late_advantages = cfg.loss_fn.use_kl_in_reward or critic is not None
    if not late_advantages:
        batch.advantages = step_advantages(cfg, batch, rollouts.rewards, estimate_advantages)
    with timer("logprobs"):
        if not one_forward_fewer(cfg, inputs) or not policy_trains:
            batch.old_logprobs = roles.policy.logprobs(batch)
        if roles.reference is not None:
            batch.reference_logprobs = roles.reference.logprobs(batch)
        values = critic.logprobs(batch).float().cpu() if critic is not None else None
    kl_metrics, token_kl = {}, None
    if cfg.loss_fn.use_kl_in_reward:
        token_kl = reference_kl(cfg, batch)
        kl_metrics["kl_to_reference"] = float(token_kl.sum() / batch.loss_mask.sum().clamp(min=1))
    if values is not None:  # the critic's
        batch.advantages, returns = gae_advantages(cfg, batch, rollouts.rewards, values, token_kl)
        batch.returns, batch.old_values = returns, values
        kl_metrics.update(critic_metrics(batch, values, returns))
    elif late_advantages:
        batch.advantages = step_advantages(cfg, batch, rollouts.rewards, estimate_advantages, token_kl)
    with timer("training"):
        train_metrics = train_epochs(cfg, inputs, roles, batch, loss_fn, policy_trains)
    if pipeline is not None:  # the weights go to the engines at the next step's start
        sync_metrics = pipeline_metrics
    else:
        with timer("weight_sync"):  # the engines hold these weights already during the critic's warm-up
            sync_metrics = roles.sync_weights(step) if policy_trains else {}
    mismatch = logprob_mismatch(batch) if batch.old_logprobs is not None else {}  # else the loss measured it
    gpus = roles.policy.gpu_stats() if cfg.logger.monitor_gpus else {}
    return {**rollouts.metrics, **inputs.scorer.take_metrics(),
            **train_metrics, **kl_metrics, **gpus,
            **sync_metrics, **mismatch, **timer.seconds, "time_step": time.perf_counter() - tic}


def train_epochs(cfg: NovaRLConfig, inputs: RunInputs, roles: Roles, batch: TrainBatch, loss_fn: LossFn,
                 policy_trains: bool = True) -> dict[str, float]:
    """grpo.ppo_epochs passes over the step's batch: each trains the critic (when the run has one;
    its metrics as critic/...), then the policy (unless in the critic's warm-up); metrics
    averaged over the passes, token counts added up, maxima (`_max`) the largest."""
    grpo, passes = cfg.grpo, []
    for _ in range(grpo.ppo_epochs):
        metrics: dict[str, float] = {}
        if roles.critic is not None:
            settings = ValueLossSettings(scale=cfg.value_loss_fn.scale, cliprange=cfg.value_loss_fn.cliprange)
            trained = train_on_batch(roles.critic, batch, partial(value_loss, settings=settings),
                                     critic_global_batch_size(cfg, inputs))
            metrics.update({f"critic/{name}": value for name, value in trained.items()})
        if policy_trains:
            metrics.update(train_on_batch(roles.policy, batch, loss_fn, inputs.batches.global_batch_size,
                                          skip_zero_advantage=zero_advantage_trains_nothing(cfg),
                                          token_level=aggregation(cfg.loss_fn) == "token-mean"))
        passes.append(metrics)
    return {name: max(p[name] for p in passes) if name.endswith("_max")
            else sum(p[name] for p in passes) / (1 if "tokens_" in name else len(passes)) for name in passes[0]}


def gae_advantages(cfg: NovaRLConfig, batch: TrainBatch, rewards: torch.Tensor, values: torch.Tensor,
                   token_kl: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's [N] advantages and [N] critic targets (returns) from the critic's values [N]: GAE over
    each completion (algorithms/advantages.py ppo_advantages, grpo.adv_estimator's keys), rewards
    clipped to +-grpo.reward_clip first and the advantages clipped as step_advantages does."""
    grpo, estimator = cfg.grpo, cfg.grpo.adv_estimator
    if grpo.reward_clip is not None:
        rewards = rewards.clamp(-grpo.reward_clip, grpo.reward_clip)
    settings = GAESettings(gamma=estimator.gae_gamma, lam=estimator.gae_lambda, lam_value=estimator.gae_lambda_value,
                           lam_policy=estimator.gae_lambda_policy,
                           length_adaptive_alpha=estimator.length_adaptive_alpha,
                           normalize=estimator.normalize_advantages)
    mask = batch.to_rows(batch.loss_mask.cpu()).bool()
    kl = batch.to_rows(token_kl.float().cpu()) if token_kl is not None else None
    advantages, returns = ppo_advantages(rewards, batch.to_rows(values.float().cpu()), mask, settings, kl,
                                         cfg.loss_fn.reference_policy_kl_penalty)
    where = batch.sequence_index.cpu(), batch.position_ids.cpu()
    advantages, returns = advantages[where], returns[where]
    if grpo.advantage_clip_low is not None or grpo.advantage_clip_high is not None:
        advantages = advantages.clamp(min=grpo.advantage_clip_low, max=grpo.advantage_clip_high)
    return advantages, returns


def critic_metrics(batch: TrainBatch, values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
    """The critic before this step's update, over the loss tokens: its mean value, the returns'
    mean, and the variance of the returns it explains (1 - Var(R - V) / Var(R); NeMo RL's
    critic/explained_var)."""
    mask = batch.loss_mask.cpu()
    v, r = values[mask], returns[mask]
    if not len(r):
        return {}
    explained = 1 - float((r - v).var(unbiased=False)) / max(float(r.var(unbiased=False)), 1e-8)
    return {"critic/values_mean": float(v.mean()), "critic/returns_mean": float(r.mean()),
            "critic/explained_var": explained}


def ppo_description(cfg: NovaRLConfig) -> str:
    estimator, grpo = cfg.grpo.adv_estimator, cfg.grpo
    warm = (f"; the first {grpo.policy_training_start_step} step(s) train the critic alone"
            if grpo.policy_training_start_step else "")
    value = value_section(cfg)
    return (f"PPO: a critic ({value.model_name}, a scalar {value.reward_model_cfg.reward_model_type} head) "
            "beside the policy; GAE (gamma "
            f"{estimator.gae_gamma:g}, lambda {estimator.gae_lambda:g}"
            f"{', advantages whitened' if estimator.normalize_advantages else ''}), value loss x "
            f"{cfg.value_loss_fn.scale:g} clipped at {cfg.value_loss_fn.cliprange}; {grpo.ppo_epochs} epoch(s) per "
            f"generated batch{warm}")


def step_advantages(cfg: NovaRLConfig, batch: TrainBatch, rewards: torch.Tensor, estimate_advantages,
                    token_kl: torch.Tensor | None = None) -> torch.Tensor:
    """[N] the step's per-token advantages: rewards [S] clipped to +-grpo.reward_clip (ROLL), the
    estimator over each group (weighing each sample by its loss tokens where it does), each
    sequence's advantage on its tokens, then clipped to [advantage_clip_low, advantage_clip_high]
    (NeMo RL). With token_kl [N] (REINFORCE++'s KL in the reward, loss_fn.use_kl_in_reward),
    reference_policy_kl_penalty x each token's KL comes off its return before the normalisation."""
    grpo = cfg.grpo
    if grpo.reward_clip is not None:
        rewards = rewards.clamp(-grpo.reward_clip, grpo.reward_clip)
    settings = AdvantageSettings(normalize_rewards=grpo.normalize_rewards,
                                 use_leave_one_out_baseline=grpo.use_leave_one_out_baseline,
                                 minus_baseline=grpo.adv_estimator.minus_baseline)
    if token_kl is None:
        token_counts = batch.sequence_sum(batch.loss_mask.long())
        advantages = estimate_advantages(rewards, grpo.num_generations_per_prompt, settings, token_counts)
        advantages = advantages[batch.sequence_index]
    else:
        advantages = reinforce_plus_plus_with_kl(rewards, grpo.num_generations_per_prompt, settings, token_kl,
                                                 batch.sequence_index, batch.loss_mask,
                                                 cfg.loss_fn.reference_policy_kl_penalty)
    if grpo.advantage_clip_low is not None or grpo.advantage_clip_high is not None:
        advantages = advantages.clamp(min=grpo.advantage_clip_low, max=grpo.advantage_clip_high)
    return advantages


def reference_kl(cfg: NovaRLConfig, batch: TrainBatch) -> torch.Tensor:
    """[N] each loss token's KL of the policy before the update (old logprobs) to the reference,
    by loss_fn's estimator and clamps; 0 elsewhere."""
    assert batch.old_logprobs is not None and batch.reference_logprobs is not None  # use_kl_in_reward's forwards
    loss = cfg.loss_fn
    settings = ClippedPGSettings(kl_estimator=loss.kl_estimator, kl_input_clamp_value=loss.kl_input_clamp_value,
                                 kl_output_clamp_value=loss.kl_output_clamp_value)
    return clamped_kl(batch.old_logprobs, batch.reference_logprobs, settings) * batch.loss_mask


def one_forward_fewer(cfg: NovaRLConfig, inputs: RunInputs) -> bool:
    """The old logprobs come from the training forward (detached) when the generated batch gets
    exactly one optimizer step: the policy has not changed since it generated (synchronous
    GRPO), so a separate forward before training would compute the same numbers. Not with the
    KL in the reward: the advantages need them before training."""
    return inputs.batches.optimizer_steps_per_step == 1 and cfg.grpo.ppo_epochs == 1 \
        and not cfg.loss_fn.use_kl_in_reward and cfg.value is None


def old_logprobs_source(cfg: NovaRLConfig, inputs: RunInputs) -> str:
    if cfg.loss_fn.force_on_policy_ratio:
        forward = "" if one_forward_fewer(cfg, inputs) else \
            "; a policy forward before training still runs (PPO, or the KL in the reward, reads it)"
        return ("loss_fn.force_on_policy_ratio: the ratio is 1 (exp(log p - log p detached): the gradient of log p, "
                f"unclipped) and pi_old is the training forward's own (1 optimizer step per generated batch){forward}")
    if one_forward_fewer(cfg, inputs):
        return ("old logprobs: from the training forward, detached (1 optimizer step per generated batch: "
                "one policy forward fewer per step)")
    if cfg.loss_fn.use_kl_in_reward or cfg.value is not None:
        return ("old logprobs: a policy forward before training (the advantages need them first: "
                f"{'the KL in the reward' if cfg.loss_fn.use_kl_in_reward else 'PPO'})")
    if cfg.grpo.ppo_epochs > 1:
        return f"old logprobs: a policy forward before training ({cfg.grpo.ppo_epochs} passes over each batch)"
    return (f"old logprobs: a policy forward before training ({inputs.batches.optimizer_steps_per_step} "
            "optimizer steps per generated batch, the policy changes between them)")


def time_budget_message(step: int, max_num_steps: int, seconds: float) -> str:
    return (f"stopped at step {step} of {max_num_steps}: grpo.max_train_seconds={seconds:g} reached. The "
            f"learning-rate schedule, sized for {max_num_steps} steps, did not reach its end; to train to the "
            "end, raise grpo.max_train_seconds (null: no limit) or lower grpo.max_num_steps.")


def resume_from(resume: Checkpoint, inputs: RunInputs, roles: Roles, sink: JsonlSink) -> int:
    """Load a checkpoint into the roles and the data sampler; the step to continue after.
    The run's metrics so far go first into this run's metrics.jsonl, then a "resume" record."""
    sink.write_history(resume.history())
    sink.write({"kind": "resume", "step": resume.step, "checkpoint": str(resume.path)})
    try:
        roles.policy.load(resume.path / POLICY_DIR)
        if roles.critic is not None:
            if not (resume.path / CRITIC_DIR).is_dir():
                raise UserError(f"Checkpoint {resume.path} has no critic ({CRITIC_DIR}/): it was written by a run "
                                "without one (grpo.adv_estimator.name is not gae there); resume with that run's "
                                "config, or give another checkpointing.checkpoint_dir.")
            roles.critic.load(resume.path / CRITIC_DIR)
        inputs.sampler.load_state_dict(resume.state["sampler"])
        restore_rng(resume.state)
        roles.sync_weights(resume.step)
    except BaseException as err:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit, UserError)):
            raise  # an interrupt, or a checkpoint of another layout: not a damaged file
        raise CheckpointLoadFailed(resume.path, err) from err
    info(f"resumed from {resume.path} (step {resume.step})")
    return resume.step


def train_on_batch(policy, batch: TrainBatch, loss_fn: LossFn, global_batch_size: int, *,
                   skip_zero_advantage: bool = False, token_level: bool = True) -> dict[str, float]:
    """One optimizer step per `global_batch_size` samples; metrics averaged over those steps.
    skip_zero_advantage: leave out of each step the samples the loss gives no gradient (see
    `with_signal`); the step's loss divides by the same token count, so nothing changes but
    the compute, and the loss's metrics are means over the tokens trained on."""
    totals: dict[str, float] = {"samples_trained_fraction": 0.0}
    chunks = range(0, len(batch), global_batch_size)
    for start in chunks:
        chunk = batch.slice(start, start + global_batch_size).with_own_counts()
        trained, scale = with_signal(chunk, token_level) if skip_zero_advantage else (chunk, 1.0)
        metrics = policy.forward_backward(trained, loss_fn)
        metrics = {name: value * scale if _mean_share(name) else value for name, value in metrics.items()}
        metrics.update(policy.optim_step(), samples_trained_fraction=len(trained) / len(chunk))
        for name, value in metrics.items():  # counts add up, maxima are the largest, the rest is averaged
            if name.endswith("_max"):
                totals[name] = max(totals.get(name, value), value)
            else:
                totals[name] = totals.get(name, 0.0) + (value if name.startswith("tokens_") else value / len(chunks))
    return totals


def zero_advantage_trains_nothing(cfg: NovaRLConfig) -> bool:
    """A sample whose every advantage is 0 (a GRPO group whose rewards are all equal) adds 0 to
    the clipped policy loss and to its gradient, whatever its ratio, unless a KL penalty
    (which does not depend on the advantage) is part of the loss."""
    loss = cfg.loss_fn
    return loss.loss == "clipped_pg" and (loss.reference_policy_kl_penalty == 0 or loss.use_kl_in_reward) \
        and cfg.value is None  # PPO's advantages are per token, rarely 0


def with_signal(chunk: TrainBatch, token_level: bool = True) -> tuple[TrainBatch, float]:
    """The samples of an optimizer step that give the loss a gradient (a non-zero advantage on
    a loss token), the step's counts kept; and the factor that turns the loss's metrics from
    shares of the step's mean into means over what was trained (by tokens or by sequences, as
    the loss averages). With none, one sample stays, so that the optimizer steps on gradients
    of 0 as it would have."""
    signal = chunk.sequence_sum(((chunk.advantages != 0) & chunk.loss_mask).long()) > 0
    kept = signal.nonzero().view(-1)
    if len(kept) == len(chunk):
        return chunk, 1.0
    trained = chunk.select(kept if len(kept) else torch.zeros(1, dtype=torch.long))
    tokens = int(trained.loss_mask.sum())
    sequences = int((trained.sequence_sum(trained.loss_mask.long()) > 0).sum())
    if token_level:
        return trained, chunk.global_valid_tokens / max(tokens, 1)
    return trained, chunk.global_valid_sequences / max(sequences, 1)


def _mean_share(name: str) -> bool:
    """A loss metric reported as a share of the step's mean (not the loss, a max or a count)."""
    return name != "loss" and not name.endswith("_max") and not name.startswith("tokens_")
