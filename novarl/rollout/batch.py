"""From completions and rewards to a TrainBatch, and the step's rollout metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from novarl.rollout.episodes import malformed_thinking
from novarl.types import Completion, TrainBatch


def build_train_batch(completions: Sequence[Completion], advantages: torch.Tensor, *,
                      overlong_filtering: bool = False, trained: torch.Tensor | None = None,
                      positive: torch.Tensor | None = None) -> TrainBatch:
    """Prompt + completion sequences end to end; loss on the tokens the engine sampled only (a
    multi-turn episode's observations have none: Completion.observed). `advantages`: [S] one per
    sequence (repeated over its tokens) or [N] one per token.

    With `overlong_filtering`, completions cut by max_new_tokens get no loss; a failed episode
    (Completion.failed) gets none either, nor a sample `trained` marks False. `positive`: [S] bool,
    the samples VAPO's NLL term trains on (TrainBatch.positive).
    """
    prompt_lengths = torch.tensor([len(c.prompt.token_ids) for c in completions])
    completion_lengths = torch.tensor([len(c.token_ids) for c in completions])
    lengths = prompt_lengths + completion_lengths
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))
    sequence = torch.repeat_interleave(torch.arange(len(completions)), lengths)
    positions = torch.arange(int(cu_seqlens[-1])) - cu_seqlens[sequence]
    generated = positions >= prompt_lengths[sequence]
    sampled = generated.clone()
    for s, c in enumerate(completions):
        first = int(cu_seqlens[s] + prompt_lengths[s])
        for start, end in c.observed:
            sampled[first + start:first + end] = False
    kept = torch.tensor([not (overlong_filtering and c.finish_reason == "length") and c.failed is None
                         for c in completions])
    trained = kept if trained is None else kept & trained
    input_ids = torch.tensor([t for c in completions for t in (*c.prompt.token_ids, *c.token_ids)],
                             dtype=torch.long)
    generator_logprobs = torch.zeros(len(input_ids), dtype=torch.float32)
    generator_logprobs[generated] = torch.tensor([lp for c in completions for lp in c.logprobs], dtype=torch.float32)
    advantages = advantages.float()
    if advantages.numel() == len(completions):
        advantages = advantages[sequence]
    elif advantages.numel() != len(input_ids):
        raise ValueError(f"advantages: {advantages.numel()} values for {len(completions)} sequences of "
                         f"{len(input_ids)} tokens (one per sequence or one per token)")
    batch = TrainBatch(input_ids=input_ids, cu_seqlens=cu_seqlens, position_ids=positions,
                       loss_mask=sampled & trained[sequence], advantages=advantages,
                       generator_logprobs=generator_logprobs, prompt_lengths=prompt_lengths,
                       group_ids=prompt_groups(completions), positive=positive)
    return batch.with_own_counts()


def flagged_turns(completions: Sequence[Completion], batch: TrainBatch) -> tuple[dict[str, torch.Tensor],
                                                                                 dict[str, float]]:
    """The batch's tokens of the turns found wrong, [N] bool by what was wrong (Completion.flagged; a
    one-turn completion's malformed thinking read from its text), and the counts NeMo RL logs: turns
    flagged (num_invalid_tool_calls, num_malformed_thinking), their rates over the step's turns, and
    num_assistant_messages (the turns)."""
    tokens: dict[str, torch.Tensor] = {}
    counts = dict.fromkeys(FLAGS, 0)
    for s, c in enumerate(completions):
        spans = list(c.flagged)
        if not spans and c.turns == 1 and not c.observed and malformed_thinking(c.text):
            spans = [(0, len(c.token_ids), "malformed_thinking")]
        first = int(batch.cu_seqlens[s]) + len(c.prompt.token_ids)
        for start, end, flag in spans:
            tokens.setdefault(flag, torch.zeros(batch.num_tokens, dtype=torch.bool))[first + start:first + end] = True
            counts[flag] = counts.get(flag, 0) + 1
    turns = sum(c.turns for c in completions)
    metrics = {"num_assistant_messages": float(turns)}
    for flag, (count_name, rate_name) in FLAGS.items():
        metrics.update({count_name: float(counts[flag]), rate_name: counts[flag] / max(turns, 1)})
    return tokens, metrics


FLAGS = {"invalid_tool_call": ("num_invalid_tool_calls", "invalid_tool_call_rate"),
         "malformed_thinking": ("num_malformed_thinking", "malformed_thinking_rate")}
"""What a turn may be flagged for (Completion.flagged) -> NeMo RL's metric names."""


def with_segments(completions: Sequence[Completion]) -> tuple[list[Completion], torch.Tensor | None]:
    """Each episode's earlier segments (an agent that rewrote its history: Completion.segments) as
    sequences of their own, before its last, and [S'] the episode (index in `completions`) of each
    sequence; (the completions, None) where no episode has earlier segments. A failed episode's
    segments fail with it (no loss)."""
    if not any(c.segments for c in completions):
        return list(completions), None
    flat = [replace(s, failed=c.failed) if s is not c else c for c in completions for s in (*c.segments, c)]
    episodes = torch.repeat_interleave(torch.arange(len(completions)),
                                       torch.tensor([len(c.segments) + 1 for c in completions]))
    return flat, episodes


def prompt_groups(completions: Sequence[Completion]) -> torch.Tensor:
    """[S] int64 group ids: consecutive completions of the same prompt tokens share one."""
    ids, group, previous = [], -1, None
    for c in completions:
        if c.prompt.token_ids != previous:
            group, previous = group + 1, c.prompt.token_ids
        ids.append(group)
    return torch.tensor(ids, dtype=torch.long)


def rollout_metrics(completions: Sequence[Completion], rewards: torch.Tensor, group_size: int) -> dict[str, float]:
    grouped = rewards.view(-1, group_size)
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    observed = float(sum(end - start for c in completions for start, end in c.observed))
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "groups_without_signal": float((grouped.std(dim=1) == 0).float().mean()) if group_size > 1 else 1.0,
        "completion_length_mean": float(lengths.mean()),
        "truncated_fraction": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "tokens_generated": float(lengths.sum()) - observed,  # sampled: an episode's observations are not
        "tokens_total": float(lengths.sum() + sum(len(c.prompt.token_ids) for c in completions)),
    }


MISMATCH_WARNING = 0.05
"""Mean |p_generator / p_trainer - 1| above which the loop warns (once)."""


def logprob_mismatch(batch: TrainBatch) -> dict[str, float]:
    """|p_generator / p_trainer - 1| over loss tokens, mean and max: near 0 when the
    weight sync worked and both engines compute the same distribution."""
    mask = batch.loss_mask
    if batch.old_logprobs is None or not bool(mask.any()):
        return {"logprob_mismatch": 0.0, "logprob_mismatch_max": 0.0}
    error = (torch.exp(batch.generator_logprobs[mask] - batch.old_logprobs[mask]) - 1).abs()
    return {"logprob_mismatch": float(error.mean()), "logprob_mismatch_max": float(error.max())}


def mismatch_advice(mismatch: float) -> str:
    return (f"the generator's token probabilities differ from the trainer's by {mismatch:.3f} on average "
            f"(warning above {MISMATCH_WARNING}). Check that policy.generation.vllm_cfg.precision matches "
            "policy.precision, that top_p/top_k are off (they change the generator's probabilities), and that "
            "the weight sync reaches the generator (policy_version in the completions).")
