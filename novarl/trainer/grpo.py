"""The GRPO loop: generate -> reward -> the step's stages (stages.py: old logprobs, reference,
values, advantages, updates) -> weight sync. PPO, REINFORCE++, RLOO and DAPO run in it too: they are
choices of estimator, loss and roles.

Simplifications, on purpose: one rollout turn; the whole step's samples are
generated before any update (synchronous, on-policy); `old_logprobs` are the
trainer's (not the generator's) so the ratio compares like with like -- from the
training forward itself when the batch gets one optimizer step, from a forward
before training otherwise -- and the gap to the generator's logprobs is logged
as `logprob_mismatch`, a check on the weight sync.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch

from novarl.algorithms.losses import make_loss
from novarl.config.schema import GRPOConfig, NovaRLConfig
from novarl.errors import CheckpointLoadFailed, RunFailed, UserError, is_out_of_memory, out_of_memory_message
from novarl.logging.console import Progress, info
from novarl.logging.metrics import JsonlSink
from novarl.logging.samples import write_samples
from novarl.trainer.checkpoint import CRITIC_DIR, POLICY_DIR, Checkpoint, Checkpointer, restore_rng
from novarl.trainer.evaluate import describe, evaluate, evaluation_sampling
from novarl.rollout.collect import collect
from novarl.rollout.batch import MISMATCH_WARNING, build_train_batch, flagged_turns, mismatch_advice, with_segments
from novarl.trainer.setup import Roles, RunInputs, value_section
from novarl.trainer.stages import (Stage, StepWork, build_stages, one_forward_fewer, trains_segments,
                                   zero_advantage_trains_nothing)


class StepTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str | None) -> Iterator[None]:
        """Time the block as time_<name>, added to the step's earlier blocks of that name (None: untimed)."""
        start = time.perf_counter()
        yield
        if name is not None:
            self.seconds[f"time_{name}"] = self.seconds.get(f"time_{name}", 0.0) + time.perf_counter() - start


def run_grpo(cfg: NovaRLConfig, inputs: RunInputs, roles: Roles, sink: JsonlSink,
             checkpointer: Checkpointer | None = None, resume: Checkpoint | None = None) -> dict[str, float]:
    """Train for grpo.max_num_steps (fewer when grpo.max_num_epochs ends first, on
    max_train_seconds, or once an evaluation reaches grpo.stop_at_validation_metric's threshold);
    returns the last metrics, evals included.

    With `resume`, the policy, data position and step count come from that checkpoint
    and the loop continues as the uninterrupted run would have.
    """
    grpo, gen = cfg.grpo, cfg.policy.generation
    stages = build_stages(cfg, inputs, roles, make_loss(cfg.loss_fn, gen.max_new_tokens))
    step = resume_from(resume, inputs, roles, sink) if resume else 0
    max_steps = inputs.max_steps or grpo.max_num_steps  # fewer when grpo.max_num_epochs ends first
    pipeline = start_async_rollouts(cfg, inputs, roles, max_steps, resume, step) if grpo.async_grpo.enabled else None
    progress = Progress(max_steps, enabled=cfg.logger.progress_bar,
                        print_every=cfg.logger.print_every_n_steps, initial=step)
    summary: dict[str, float] = dict(resume.state.get("summary", {})) if resume else {}
    summary.pop("stopped_on_time_budget", None)  # this run's own ending decides
    summary.pop("stopped_on_validation_metric", None)  # likewise
    saved = step
    how = evaluation_sampling(cfg)

    def checkpoint(step: int, *, last: bool) -> None:
        nonlocal saved
        if checkpointer and saved != step and checkpointer.due(step, last=last):
            roles.release_generator()  # a colocated engine's memory back before the save wakes the training states
            checkpointer.save(step, roles.policy, trainer_state(inputs, summary, pipeline), metrics=sink.path,
                              critic=roles.critic, rollouts=pipeline.state() if pipeline is not None else None)
            roles.park_training()  # the save woke them; the next generation comes first
            saved = step

    def validate(step: int) -> dict[str, float]:
        if pipeline is not None:  # the engines evaluate the newest weights
            pipeline.sync(step)
        result = evaluate(roles.generator, inputs.val_prompts, inputs.scorer, how,
                          batch_size=grpo.val_batch_size, samples_to_print=cfg.logger.num_val_samples_to_print,
                          episodes=inputs.episodes,
                          keep=lambda samples, rewards: write_samples(sink.path.parent, step, samples, rewards,
                                                                      inputs.tokenizer,
                                                                      cfg.logger.num_val_samples_to_print))
        sink.write({"kind": "eval", "step": step, **result})
        progress.evaluated(step, result["accuracy"], describe(result, how, source=inputs.val_source))
        summary.update({f"val_{k}": v for k, v in result.items()}, val_step=step)
        summary.setdefault("initial_accuracy", result["accuracy"])
        return result

    def stops_after(step: int, result: dict[str, float]) -> bool:
        """Whether the run ends after this evaluation (grpo.stop_at_validation_metric reached); said if so."""
        reached = validation_stop(grpo, step, result)
        if reached is not None:
            progress.stopped_early(reached)
            summary["stopped_on_validation_metric"] = 1.0
        return reached is not None

    info(old_logprobs_source(cfg, inputs))
    if roles.critic is not None:
        info(ppo_description(cfg))
    if zero_advantage_trains_nothing(cfg):
        info("samples with an advantage of 0 (GRPO groups whose rewards are all equal) are left out of the update: "
             "without a KL penalty their loss and gradient are 0 (the loss still divides by every token)")
    try:
        first = start_evaluation(grpo, resume is not None, summary, step, validate)
        stop = first is not None and stops_after(step, first)
        started = time.perf_counter()
        while step < max_steps and not stop:
            if grpo.max_train_seconds and time.perf_counter() - started > grpo.max_train_seconds:
                progress.stopped_early(time_budget_message(step, max_steps, grpo.max_train_seconds))
                summary["stopped_on_time_budget"] = 1.0
                break
            step += 1
            metrics = grpo_step(cfg, inputs, roles, stages, step, pipeline)
            warn_of_mismatch(step, metrics, summary, asynchronous=pipeline is not None)
            sink.write({"kind": "train", "step": step, **metrics})
            progress.step(step, metrics)
            summary.update(metrics)
            if periodic_validation_due(grpo, step, max_steps):
                stop = stops_after(step, validate(step))
            checkpoint(step, last=False)
        summary["steps"] = step
        if grpo.val_at_end and not stop:
            validate(step)
        checkpoint(step, last=True)  # an early stop's step included
        if pipeline is not None:
            pipeline.finish()
    finally:
        progress.close()  # before any error is printed: it must not land inside the bar
    return summary


def periodic_validation_due(grpo: GRPOConfig, step: int, max_steps: int) -> bool:
    """Whether `step` evaluates on grpo.val_period (NeMo RL's rule: from step grpo.val_start_at on);
    the last step leaves it to val_at_end."""
    return (grpo.val_period > 0 and step >= (grpo.val_start_at or 0) and step % grpo.val_period == 0
            and not (grpo.val_at_end and step == max_steps))


def start_evaluation(grpo: GRPOConfig, resumed: bool, summary: Mapping[str, float], step: int,
                     validate: Callable[[int], dict[str, float]]) -> dict[str, float] | None:
    """What the early stop reads before the first step: the evaluation at start (val_at_start), or for a
    resumed run the one at its checkpoint's step, which its summary holds (a run killed after its stop's
    save, before it ended, ends now as it would have; one whose threshold was raised goes on); None:
    none."""
    if not resumed:
        return validate(0) if grpo.val_at_start else None
    if summary.get("val_step") != step:
        return None
    return {name.removeprefix("val_"): value for name, value in summary.items()
            if name.startswith("val_") and name != "val_step"}


def validation_stop(grpo: GRPOConfig, step: int, result: Mapping[str, float]) -> str | None:
    """Why the run ends after the evaluation of `step` (its grpo.stop_at_validation_metric at or above
    stop_at_validation_threshold), or None. A metric the evaluation did not report is the user's error."""
    metric, threshold = grpo.stop_at_validation_metric, grpo.stop_at_validation_threshold
    if metric is None or threshold is None:
        return None
    if metric not in result:
        raise UserError(f"grpo.stop_at_validation_metric={metric!r}: the evaluation at step {step} reports no such "
                        f"metric; it reports {', '.join(sorted(result))}. Name one of them.")
    if not result[metric] >= threshold:  # below it, or not a number (nan): training goes on
        return None
    return (f"step {step}: validation {metric} reached the early-stop threshold ({result[metric]:.4f} >= "
            f"{threshold:g}, grpo.stop_at_validation_threshold); stopping training")


def warn_of_mismatch(step: int, metrics: dict[str, float], summary: dict[str, float], *, asynchronous: bool) -> None:
    """Once a run: the generator's logprobs far from the trainer's (a weight-sync problem, said with
    advice). Not for asynchronous GRPO, whose generator's weights lag by a step on purpose."""
    if metrics["logprob_mismatch"] > MISMATCH_WARNING and not summary.get("mismatch_warned") and not asynchronous:
        info(f"warning at step {step}: {mismatch_advice(metrics['logprob_mismatch'])}")
        summary["mismatch_warned"] = 1.0


def start_async_rollouts(cfg: NovaRLConfig, inputs: RunInputs, roles: Roles, max_steps: int,
                         resume: Checkpoint | None, step: int):
    """Asynchronous GRPO's rounds in flight (rollout/async_rollouts.py), those of `resume` restored."""
    from novarl.backends.generation.engines import LocalGeneration
    from novarl.rollout.async_rollouts import AsyncRollouts, async_description

    pipeline = AsyncRollouts(cfg, inputs, roles, max_steps)
    pipeline.restore(resume.rollouts() if resume else None, step)
    info(async_description(cfg, in_process=isinstance(roles.generator, LocalGeneration)))
    return pipeline


def trainer_state(inputs: RunInputs, summary: dict[str, float], pipeline=None) -> dict:
    """What a checkpoint's state holds: the data position and the summary so far; with
    asynchronous GRPO the position before the oldest round in flight (the rounds themselves go
    into rollouts.pt, so that a resume trains on them: rollout/async_rollouts.py)."""
    sampler = inputs.sampler.state_dict() if pipeline is None else pipeline.sampler_state()
    return {"sampler": sampler, "summary": summary}


def grpo_step(cfg: NovaRLConfig, inputs: RunInputs, roles: Roles, stages: list[Stage], step: int,
              pipeline=None) -> dict[str, float]:
    """One synchronous step: generate, reward, then the run's stages (stages.py: old logprobs,
    reference, values, advantages, updates), then the weight sync."""
    grpo = cfg.grpo
    timer, tic = StepTimer(), time.perf_counter()
    if pipeline is None:
        rollouts, pipeline_metrics = collect(cfg, inputs, roles, step, timer), {}
    else:  # asynchronous: generated during earlier steps (rollout/async_rollouts.py)
        queued = pipeline.advance(step, timer)
        rollouts, pipeline_metrics = pipeline.take(step, timer)
        pipeline_metrics.update(queued)
    sequences, episodes = with_segments(rollouts.completions) if trains_segments(cfg) else \
        (rollouts.completions, None)  # an agent's rewritten history: a sequence per segment
    trained, positive = (per_sample if per_sample is None or episodes is None else per_sample[episodes]
                         for per_sample in (rollouts.trained, rollouts.positive))
    batch = build_train_batch(sequences, torch.zeros(len(sequences)), overlong_filtering=grpo.overlong_filtering,
                              trained=trained, positive=positive)
    # before grpo.policy_training_start_step: the critic's warm-up
    flagged, flag_metrics = flagged_turns(sequences, batch) if grpo.invalid_tool_call_advantage is not None \
        or grpo.malformed_thinking_advantage is not None else ({}, {})
    work = StepWork(batch, rollouts.rewards, policy_trains=step > grpo.policy_training_start_step,
                    weights=rollouts.weights, episodes=episodes, flagged=flagged, metrics=flag_metrics)
    # a colocated engine's memory back for training, once the step's rounds are done (not between dynamic
    # sampling's rounds); also after an evaluation, or when no round of an asynchronous pipeline released it
    with timer("generation" if pipeline is None else None):  # (asynchronous: the engines' own seconds)
        roles.release_generator()
    for stage in stages:
        with timer(stage.phase):
            stage(work)
    if pipeline is not None:  # the weights go to the engines at the next step's start
        sync_metrics = pipeline_metrics
    else:
        with timer("weight_sync"):  # the engines hold these weights already during the critic's warm-up
            sync_metrics = roles.sync_weights(step) if work.policy_trains else {}
        if not work.policy_trains:
            roles.park_training()  # (the sync parks them)
    gpus = roles.policy.gpu_stats() if cfg.logger.monitor_gpus else {}
    played = inputs.episodes.take_metrics() if inputs.episodes is not None else {}  # the environment's counts
    return {**rollouts.metrics, **inputs.scorer.take_metrics(), **played, **work.metrics, **gpus,
            **sync_metrics, **timer.seconds, "time_step": time.perf_counter() - tic}


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
        roles.release_generator()  # a colocated engine starts awake: its memory back before the states load
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
        if is_out_of_memory(err):  # nor is a GPU out of memory
            if isinstance(err, RunFailed):  # a rank's, which says so already
                raise
            raise RunFailed(out_of_memory_message(err)) from err
        raise CheckpointLoadFailed(resume.path, err) from err
    info(f"resumed from {resume.path} (step {resume.step})")
    return resume.step
