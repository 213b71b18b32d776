"""Asynchronous GRPO's rollouts (`grpo.async_grpo.enabled`): the engines generate up to
`max_trajectory_age_steps` (k) steps ahead of the trainer, with the weights they have.

The rounds in flight form the replay buffer: one round per step, each tagged with the step it is
for and, once generated, with the weights (the policy's step count) it was generated with. The
trainer takes the oldest. Per step s (the policy has trained s - 1 steps: weights s - 1):
  1. `advance(s)`: weights s - 1 are queued to the engines (the policy's rank 0 keeps a host copy
     and sends it in the background when the engines come to it, after the rounds already
     submitted: the trainer does not wait for them), then rounds up to s + k are submitted (at step
     1, rounds 1 .. 1 + k, all with the initial weights);
  2. `take(s)`: round s is waited for (the trainer's wait: `time_rollout_wait`), scored, and
     trained on while the engines go on with rounds s + 1 .. s + k.
Round r is submitted after weights r - 1 - k are queued, and the engines take weights in the order
they were queued, so it is generated with weights r - 1 - k or newer: at most k steps old when step
r trains on it (checked: an older one stops the run). The schedule does not depend on timing:
the same seed gives the same trajectories, on any number of engines, and in one process (where the
engine generates at submit) as on dedicated ones. Multi-turn episodes (an environment's) are the
exception on dedicated engines: a round's later turns are submitted as its earlier ones come back,
so which weights they meet depends on timing (EpisodesInFlight); an episode's age is its first
turn's.

An evaluation queues the newest weights first (its prompts go behind the rounds in flight).
Resume is exact: a checkpoint holds the sampler's position before the oldest round in flight and
every round's completions (waited for), so a resumed run trains on the same trajectories as the
uninterrupted one, and no prompt is lost or repeated.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch

from novarl.errors import RunFailed
from novarl.logging.console import info
from novarl.rollout.collect import Rollouts, draw_round, episode_rewards, round_metrics, score_round
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
    """The engines' Rollout (submit's handle) or EpisodesInFlight, None when restored."""
    completions: list[Completion] | None = None
    rewards: list[float] | None = None
    """The environment's, per episode (a run with an environment); None: the scorer's, at take."""

    def result(self) -> list[Completion]:
        if self.completions is None:
            self.completions = self.future.result()
            if isinstance(self.future, EpisodesInFlight):
                self.rewards = self.future.rewards
        return self.completions

    def engine_times(self) -> dict[str, float]:
        """The engines' busy and idle seconds for this round (a Rollout that measures them)."""
        times = getattr(self.future, "times", None)
        return times() if times else {}


class AsyncRollouts:
    """The rounds in flight on the engines, up to max_trajectory_age_steps steps ahead of the trainer."""

    def __init__(self, cfg, inputs, roles, max_steps: int) -> None:
        self.cfg, self.inputs, self.roles, self.max_steps = cfg, inputs, roles, max_steps
        self.max_age = cfg.grpo.async_grpo.max_trajectory_age_steps
        self.rounds: deque[Round] = deque()
        self.next_round = 1
        """The step of the next round to submit."""
        self.engine_version = 0
        """The newest weights queued to the engines (the policy's step count when they were sent)."""

    # ---------------------------------------------------------------- the loop's side
    def advance(self, step: int, timer) -> dict[str, float]:
        """Before step `step` takes its rollouts: queue weights step - 1 to the engines (unless
        queued) and submit rounds up to step + max_age (none past the run's last step). Metrics
        of the weight transfer."""
        last = min(step + self.max_age, self.max_steps)
        if self.next_round > last:
            return {}
        metrics = self.queue_weights(step - 1, timer)
        while self.next_round <= last:
            self._submit(self.next_round)
        self.roles.release_generator()  # an engine in this process: its device memory back for training
        return metrics

    def take(self, step: int, timer) -> tuple[Rollouts, dict[str, float]]:
        """Step `step`'s rollouts (the oldest round), scored, and the metrics of their ages and of the
        wait: time_rollout_wait (the trainer's), time_generation and time_generator_idle (the
        engines' busy time on the round and their idle time before it, waiting for the trainer)."""
        if not self.rounds or self.rounds[0].step != step:
            raise RunFailed(f"asynchronous GRPO has no rollouts in flight for step {step} "
                            f"(in flight: {[r.step for r in self.rounds]}); this is a bug in novarl.")
        round_ = self.rounds[0]
        with timer("rollout_wait"):
            completions = round_.result()
        self.rounds.popleft()
        ages = [step - 1 - c.policy_version for c in completions]
        if max(ages) > self.max_age:  # an invariant of the schedule above (a restored round may break it)
            raise RunFailed(f"asynchronous GRPO was about to train on a trajectory {max(ages)} steps old at step "
                            f"{step} (grpo.async_grpo.max_trajectory_age_steps={self.max_age}).")
        if round_.rewards is not None:  # an environment's episodes
            raw, scaled, shaped = episode_rewards(self.cfg, self.inputs, completions, round_.rewards, step)
        else:
            raw, scaled, shaped = score_round(self.cfg, self.inputs, completions)
        metrics = {"trajectory_age_mean": sum(ages) / len(ages), "trajectory_age_max": float(max(ages)),
                   **age_histogram(ages, self.max_age), **round_.engine_times()}
        return Rollouts.of(self.cfg, completions, raw, shaped, round_metrics(self.cfg, completions, raw, shaped)), \
            metrics

    def sync(self, version: int) -> dict[str, float]:
        """Queue the policy's weights `version` to the engines (for an evaluation, which goes behind
        the rounds in flight): the same as the step's own queueing."""
        return self.queue_weights(version)

    def queue_weights(self, version: int, timer=None) -> dict[str, float]:
        """Weights `version` to the engines, behind the rounds they have, unless queued already:
        first the wait for them to take the previous weights (time_rollout_wait: the engines'
        progress), then the gather and host copy (time_weight_sync)."""
        if self.engine_version == version:
            return {}
        with timer("rollout_wait") if timer else nullcontext():
            self.roles.generator.weights_taken()
        with timer("weight_sync") if timer else nullcontext():
            metrics = self.roles.queue_weights(version)
        self.engine_version = version
        return metrics

    def finish(self) -> None:
        """At the run's end: the engines have taken the last weights queued (raising what they raised)."""
        self.roles.generator.weights_taken()

    def _submit(self, step: int) -> None:
        before = self.inputs.sampler.state_dict()
        prompts, sampling = draw_round(self.cfg, self.inputs, step, 0, self.cfg.grpo.num_prompts_per_step)
        from novarl.backends.generation.engines import LocalGeneration

        generator, episodes = self.roles.generator, self.inputs.episodes
        future = generator.submit(prompts, sampling) if episodes is None else EpisodesInFlight(
            episodes, generator, prompts, sampling, in_thread=not isinstance(generator, LocalGeneration))
        self.rounds.append(Round(step, prompts, sampling, before, future=future))
        self.next_round = step + 1

    # ------------------------------------------------------------- checkpoints
    def sampler_state(self) -> dict[str, int]:
        """The sampler's position to save: before the oldest round in flight drew its prompts."""
        return self.rounds[0].sampler_before if self.rounds else self.inputs.sampler.state_dict()

    def state(self) -> list[dict[str, Any]]:
        """The rounds in flight, for a checkpoint (rollouts.pt): each one's step and completions
        (waited for) as tensors, without the prompts, which the sampler draws again on resume."""
        return [pack_round(r.step, r.result(), r.rewards) for r in self.rounds]

    def restore(self, state: list[dict[str, Any]] | dict[str, Any] | None, version: int) -> None:
        """After a resume at step `version` (the sampler at sampler_state(), the engines given weights
        `version`): the rounds that were in flight, drawn again and paired with their saved
        completions. Those this run's bound would not take (a smaller max_trajectory_age_steps),
        and every one after them, are dropped, to be drawn and generated again in order."""
        self.engine_version = version
        self.next_round = version + 1
        saved_rounds = [state] if isinstance(state, dict) else list(state or [])  # one round: an older checkpoint
        saved_rounds = [unpack_round(saved) for saved in saved_rounds]
        for saved in saved_rounds:
            step = saved["step"]
            if step != self.next_round or step > min(version + self.max_age, self.max_steps) or any(
                    step - 1 - c["policy_version"] > self.max_age for c in saved["completions"]):
                dropped = [s["step"] for s in saved_rounds if s["step"] >= step]
                info(f"the checkpoint's rollouts for steps {dropped} are not within this run's "
                     f"grpo.async_grpo.max_trajectory_age_steps={self.max_age} (or grpo.max_num_steps): "
                     "they are generated again")
                break
            self.rounds.append(self._restored(saved))
            self.next_round = step + 1

    def _restored(self, saved: dict[str, Any]) -> Round:
        before = self.inputs.sampler.state_dict()
        prompts, sampling = draw_round(self.cfg, self.inputs, saved["step"], 0, self.cfg.grpo.num_prompts_per_step)
        completions = saved["completions"]
        if len(completions) != len(prompts) or any(c.get("prompt_index", p.index) != p.index
                                                   for p, c in zip(prompts, completions)):
            raise RunFailed(f"the checkpoint's rollouts in flight hold {len(completions)} completions for step "
                            f"{saved['step']} that do not answer the {len(prompts)} prompts the sampler draws again: "
                            "the config's batch or data differ from the run that wrote it.")
        return Round(saved["step"], prompts, sampling, before, rewards=saved.get("rewards"), completions=[
            Completion(prompt=p, token_ids=list(c["token_ids"]), logprobs=list(c["logprobs"]), text=c["text"],
                       finish_reason=c["finish_reason"], policy_version=int(c["policy_version"]),
                       observed=tuple(c.get("observed", ())), turns=c.get("turns", 1), failed=c.get("failed"),
                       segments=tuple(segment_of(s, p) for s in c.get("segments", ())))
            for p, c in zip(prompts, completions)])


class EpisodesInFlight:
    """A round of episodes on their way (the Rollout an episodes' round is): played on a thread of
    its own (in_thread: engines in other processes), which submits each turn to the engines as the
    last one's answers come while the trainer trains; else at once (an engine in this process:
    nothing would overlap, and its weights are loaded between rounds). Weights queued meanwhile are
    taken between the turns' submissions, so an episode's later turns may be generated with newer
    weights than its first, as the engines' progress has it (with engines elsewhere, multi-turn
    trajectories depend on timing, unlike single-turn ones): its age is its first turn's
    (Completion.policy_version), and each turn's logprobs are its engine's, which the
    importance-sampling correction compares the trainer's with."""

    def __init__(self, episodes, generator, prompts: list[Prompt], sampling: SamplingConfig, *,
                 in_thread: bool) -> None:
        import threading
        import time

        self.rewards: list[float] | None = None
        self.completions: list[Completion] | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0

        def run() -> None:
            start = time.perf_counter()
            try:
                self.completions, self.rewards = episodes.play(generator, prompts, sampling)
            except BaseException as err:  # raised again by result(), in the trainer's thread
                self.error = err
            self.seconds = time.perf_counter() - start

        self.thread = threading.Thread(target=run, daemon=True, name="novarl-episodes") if in_thread else None
        if self.thread is None:
            run()
        else:
            self.thread.start()

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def result(self) -> list[Completion]:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.completions is not None
        return self.completions

    def times(self) -> dict[str, float]:
        return {"time_generation": self.seconds}


def pack_round(step: int, completions: list[Completion], rewards: list[float] | None = None) -> dict[str, Any]:
    """A round's completions as a few flat tensors (what rollouts.pt holds); episodes' also their
    observations' spans, turns, failures and the environment's rewards."""
    packed = {"step": step, "prompt_index": torch.tensor([c.prompt.index for c in completions]),
              "policy_version": torch.tensor([c.policy_version for c in completions]),
              "lengths": torch.tensor([len(c.token_ids) for c in completions]),
              "token_ids": torch.tensor([t for c in completions for t in c.token_ids], dtype=torch.int64),
              "logprobs": torch.tensor([x for c in completions for x in c.logprobs], dtype=torch.float32),
              "text": [c.text for c in completions], "finish_reason": [c.finish_reason for c in completions]}
    if rewards is not None:
        packed.update(rewards=torch.tensor(rewards, dtype=torch.float64),
                      turns=torch.tensor([c.turns for c in completions]),
                      observed=[torch.tensor(c.observed, dtype=torch.int64).view(-1, 2) for c in completions],
                      failed=[c.failed for c in completions])
    if any(c.segments for c in completions):  # an agent's rewritten histories: their earlier segments
        packed["segments"] = [[segment_record(s) for s in c.segments] for c in completions]
    return packed


def segment_record(segment: Completion) -> dict[str, Any]:
    """An earlier segment of an episode (Completion.segments), as rollouts.pt holds it: its own prompt too."""
    return {"prompt_text": segment.prompt.text, "prompt_token_ids": list(segment.prompt.token_ids),
            "token_ids": list(segment.token_ids), "logprobs": list(segment.logprobs), "text": segment.text,
            "finish_reason": segment.finish_reason, "policy_version": segment.policy_version,
            "observed": [list(span) for span in segment.observed], "turns": segment.turns}


def segment_of(record: dict[str, Any], example: Prompt) -> Completion:
    """segment_record's dict back into a Completion (its prompt: the example's, with the segment's own tokens)."""
    prompt = dataclasses.replace(example, text=record["prompt_text"], token_ids=list(record["prompt_token_ids"]))
    return Completion(prompt=prompt, token_ids=list(record["token_ids"]), logprobs=list(record["logprobs"]),
                      text=record["text"], finish_reason=record["finish_reason"],
                      policy_version=int(record["policy_version"]),
                      observed=tuple(tuple(span) for span in record["observed"]), turns=int(record["turns"]))


def unpack_round(saved: dict[str, Any]) -> dict[str, Any]:
    """pack_round's dict back into {"step", "completions": [per-completion dicts], "rewards"} (the
    form an older checkpoint's trainer_state.json held, which passes as it is)."""
    if "completions" in saved:
        return saved
    ends = saved["lengths"].cumsum(0).tolist()
    starts = [0, *ends[:-1]]
    token_ids, logprobs = saved["token_ids"].tolist(), saved["logprobs"].tolist()
    completions = [
        {"prompt_index": index, "token_ids": token_ids[a:b], "logprobs": logprobs[a:b], "text": text,
         "finish_reason": reason, "policy_version": version}
        for index, version, a, b, text, reason in zip(saved["prompt_index"].tolist(), saved["policy_version"].tolist(),
                                                      starts, ends, saved["text"], saved["finish_reason"])]
    if "rewards" not in saved:
        return {"step": saved["step"], "completions": completions}
    for completion, turns, observed, failed, segments in zip(completions, saved["turns"].tolist(), saved["observed"],
                                                             saved["failed"], saved.get("segments") or repeat([])):
        completion.update(turns=turns, observed=[tuple(span) for span in observed.tolist()], failed=failed,
                          segments=segments)
    return {"step": saved["step"], "completions": completions, "rewards": saved["rewards"].tolist()}


def age_histogram(ages: list[int], max_age: int) -> dict[str, float]:
    """The share of a step's trajectories of each age 0 .. max_age (trajectory_age/<age>)."""
    counts = Counter(ages)
    return {f"trajectory_age/{age}": counts.get(age, 0) / len(ages) for age in range(max_age + 1)}


def async_description(cfg, in_process: bool) -> str:
    k = cfg.grpo.async_grpo.max_trajectory_age_steps
    where = ("the engine is in this process, so nothing overlaps: the run has asynchronous GRPO's schedule "
             "(the same trajectories as with dedicated engines), not its speed" if in_process else
             "the dedicated engines generate while the policy trains; each step's weights go to them in the "
             "background, taken between their rounds (the policy's rank 0 holds one host copy of them meanwhile)")
    return (f"asynchronous GRPO: generation runs up to {k} step(s) ahead of training, trajectories at most {k} "
            f"step(s) old (grpo.async_grpo.max_trajectory_age_steps); {where}")
