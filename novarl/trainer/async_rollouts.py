"""Asynchronous GRPO's rollouts (`grpo.async_grpo.enabled`): the next step's generation runs on
the dedicated engines while the policy trains on this step's.

Per step s (the policy has trained s - 1 steps, its weights are version s - 1):
  1. wait for step s's rollouts (submitted during step s - 1's training, with weights s - 2), score
     them and build the batch (the driver's work, while the engines are idle: on a small machine
     it would take their cores);
  2. give the engines weights s - 1 (over the weight bridge) and submit step s + 1's prompts: they
     generate while
  3. the policy trains on step s's rollouts (their age: 1 step; the loss's importance-sampling
     correction weighs each token by pi_old / pi_generator).
So no trajectory is older than one step, within `max_trajectory_age_steps` (>= 1). An evaluation
first gives the engines the newest weights (after the step in flight is done).

Resume is exact: a checkpoint holds the sampler's position before the step in flight drew its
prompts and that step's completions (waited for), so a resumed run trains on the same
trajectories as the uninterrupted one, and no prompt is lost or repeated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from novarl.errors import RunFailed
from novarl.trainer.collect import Rollouts, draw_round, round_metrics, score_round
from novarl.types import Completion, Prompt, SamplingConfig


@dataclass
class Round:
    """A step's prompts, submitted to the engines (or restored from a checkpoint)."""

    step: int
    prompts: list[Prompt]
    sampling: SamplingConfig
    sampler_before: dict[str, int]
    """The sampler's position before these prompts were drawn (what a checkpoint resumes from)."""
    future: Any = None
    """The engines' Rollout (submit's handle), None when restored."""
    completions: list[Completion] | None = None

    def result(self) -> list[Completion]:
        if self.completions is None:
            self.completions = self.future.result()
        return self.completions


class AsyncRollouts:
    """One step's generation in flight on the dedicated engines, ahead of the trainer."""

    def __init__(self, cfg, inputs, roles, max_steps: int) -> None:
        self.cfg, self.inputs, self.roles, self.max_steps = cfg, inputs, roles, max_steps
        self.max_age = cfg.grpo.async_grpo.max_trajectory_age_steps
        self.pending: Round | None = None
        self.engine_version = 0
        """The weights the engines hold (the policy's step count when they took them)."""

    # ---------------------------------------------------------------- the loop's side
    def take(self, step: int, timer) -> tuple[Rollouts, dict[str, float]]:
        """Step `step`'s rollouts (scored) and their ages; then `launch(step + 1)` before training."""
        if self.pending is None or self.pending.step != step:
            self.sync(step - 1)
            self._submit(step)
        with timer("generation"):  # the time the trainer waited for its rollouts
            completions = self.pending.result()
        self.pending = None
        ages = [step - 1 - c.policy_version for c in completions]
        if max(ages) > self.max_age:  # an invariant of the schedule above
            raise RunFailed(f"asynchronous GRPO was about to train on a trajectory {max(ages)} steps old at step "
                            f"{step} (grpo.async_grpo.max_trajectory_age_steps={self.max_age}).")
        raw, scaled, shaped = score_round(self.cfg, self.inputs, completions)
        metrics = {"trajectory_age_mean": sum(ages) / len(ages), "trajectory_age_max": float(max(ages))}
        return Rollouts(completions, shaped, round_metrics(self.cfg, completions, raw, shaped)), metrics

    def launch(self, step: int, timer) -> dict[str, float]:
        """Right before the policy trains step `step` - 1 (its batch built: the driver's own work done
        while the engines were idle): the engines take weights step - 2 and start step `step`, which
        generates during that training. The weight sync's metrics."""
        if step > self.max_steps:  # the last step: nothing to generate, the weights go at the next need
            return {}
        with timer("weight_sync"):
            metrics = self.sync(step - 2)
        self._submit(step)
        return metrics

    def sync(self, version: int) -> dict[str, float]:
        """Give the engines the policy's weights `version` unless they hold them: after the round in
        flight is done (the engines are idle then)."""
        if self.engine_version == version:
            return {}
        if self.pending is not None:
            self.pending.result()
        metrics = self.roles.sync_weights(version)
        self.engine_version = version
        return metrics

    def _submit(self, step: int) -> None:
        before = self.inputs.sampler.state_dict()
        prompts, sampling = draw_round(self.cfg, self.inputs, step, 0, self.cfg.grpo.num_prompts_per_step)
        self.pending = Round(step, prompts, sampling, before, future=self.roles.generator.submit(prompts, sampling))

    # ------------------------------------------------------------- checkpoints
    def sampler_state(self) -> dict[str, int]:
        """The sampler's position to save: before the step in flight drew its prompts."""
        return self.pending.sampler_before if self.pending is not None else self.inputs.sampler.state_dict()

    def state(self) -> dict[str, Any] | None:
        """The step in flight, for a checkpoint: its step and completions (waited for; the next step
        waits for them anyway), without the prompts, which the sampler draws again on resume."""
        if self.pending is None:
            return None
        return {"step": self.pending.step, "completions": [
            {"prompt_index": c.prompt.index, "token_ids": c.token_ids, "logprobs": c.logprobs, "text": c.text,
             "finish_reason": c.finish_reason, "policy_version": c.policy_version} for c in self.pending.result()]}

    def restore(self, state: dict[str, Any] | None, version: int) -> None:
        """After a resume (the sampler at sampler_state(), the engines given weights `version`):
        the step that was in flight, drawn again and paired with its saved completions."""
        self.engine_version = version
        if not state:
            return
        before = self.inputs.sampler.state_dict()
        prompts, sampling = draw_round(self.cfg, self.inputs, state["step"], 0, self.cfg.grpo.num_prompts_per_step)
        saved = state["completions"]
        if len(saved) != len(prompts) or any(c.get("prompt_index", p.index) != p.index for p, c in zip(prompts, saved)):
            raise RunFailed(f"the checkpoint's rollouts in flight hold {len(saved)} completions for step "
                            f"{state['step']} that do not answer the {len(prompts)} prompts the sampler draws again: the "
                            "config's batch or data differ from the run that wrote it.")
        completions = [Completion(prompt=p, token_ids=list(c["token_ids"]), logprobs=list(c["logprobs"]), text=c["text"],
                                  finish_reason=c["finish_reason"], policy_version=int(c["policy_version"]))
                       for p, c in zip(prompts, saved)]
        self.pending = Round(state["step"], prompts, sampling, before, completions=completions)


def async_description(cfg) -> str:
    return (f"asynchronous GRPO: step s+1 generates on the dedicated engines while the policy trains on step s "
            f"(trajectories 1 step old, within grpo.async_grpo.max_trajectory_age_steps="
            f"{cfg.grpo.async_grpo.max_trajectory_age_steps}); the weights go to the engines between their rounds")
