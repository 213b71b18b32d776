"""Hugging Face generation backend: `model.generate` with KV cache, logprobs returned; the
samples of one prompt (a GRPO group) share its prompt's KV cache, computed once.

It holds its own copy of the weights (colocated with training in-process, or on
a dedicated worker later); `update_weights` loads the trainer's full tensors
into that copy after each step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import torch

from novarl.backends.generation.stops import stop_string_end
from novarl.backends.protocols import Engine
from novarl.models.loading import DTYPES, load_causal_lm
from novarl.types import Completion, Prompt, SamplingConfig


class HFGeneration(Engine):
    """Implements Engine on a plain (unsharded) transformers model."""

    process_reusable = True
    """Nothing of it outlives it in its process (kept_ranks.REUSE_RANKS_VARIABLE)."""

    @staticmethod
    def engine_kwargs(cfg, *, model_path: str, tokenizer, precision: str) -> dict:
        """The constructor's arguments for a run's config (built where the engine runs)."""
        gen = cfg.policy.generation
        return dict(model_path=model_path, tokenizer=tokenizer, device=None, precision=precision,
                    batch_size=gen.generation_batch_size or cfg.policy.generation_batch_size,
                    max_seq_length=cfg.policy.max_seq_length, trust_remote_code=cfg.policy.trust_remote_code)

    def __init__(self, model_path: str, tokenizer, device: torch.device | None = None, *, precision: str = "float32",
                 batch_size: int | None = None, max_seq_length: int | None = None,
                 trust_remote_code: bool = False) -> None:
        from novarl.distributed.local import default_device

        device = device or default_device()
        self.model = load_causal_lm(model_path, dtype=DTYPES[precision], trust_remote_code=trust_remote_code)
        self.model.to(device)
        self.model.requires_grad_(False)
        self.tokenizer = tokenizer
        self.device = device
        self.batch_size = batch_size
        self.max_seq_length = max_seq_length
        """Prompt + completion tokens at most; longer completions are cut ('length')."""
        self.version = 0

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> list[Completion]:
        """One completion per prompt (repeat a prompt for several samples). With a sampling
        seed, sample i draws from its own random stream, seeded by the seed and its position
        in the step (sampling.seed_offset + i): the same samples whichever engine, batch or
        batch neighbours it gets."""
        size = self.batch_size or len(prompts) or 1
        out: list[Completion] = []
        for start in range(0, len(prompts), size):
            out.extend(self._generate_batch(prompts[start:start + size], sampling, start))
        return out

    @torch.no_grad()
    def _generate_batch(self, prompts: Sequence[Prompt], sampling: SamplingConfig, start: int) -> list[Completion]:
        from transformers import LogitsProcessorList, StoppingCriteriaList

        from novarl.backends.generation.stops import StopOnStrings

        pad = self.tokenizer.pad_token_id
        width = max(len(p.token_ids) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: generation continues at the right edge
            ids[row, width - len(prompt.token_ids):] = torch.tensor(prompt.token_ids)
            mask[row, width - len(prompt.token_ids):] = 1
        stop_ids = [self.tokenizer.eos_token_id, *sampling.stop_token_ids]
        greedy = sampling.temperature == 0
        budget = sampling.max_new_tokens
        if self.max_seq_length is not None:
            budget = max(1, min(budget, self.max_seq_length - min(len(p.token_ids) for p in prompts)))
        seeds = None if greedy else row_seeds(sampling, start, len(prompts))
        seeded = seeds is not None
        sampler = RowSampler(seeds, sampling, self.device) if seeds is not None else None
        ids, mask = ids.to(self.device), mask.to(self.device)
        result = self.model.generate(
            input_ids=ids, attention_mask=mask, past_key_values=shared_prompt_cache(self.model, ids, mask),
            max_new_tokens=budget, do_sample=not greedy and not seeded,
            temperature=None if greedy or seeded else sampling.temperature,
            top_p=None if greedy or seeded else sampling.top_p,
            top_k=None if greedy or seeded else sampling.top_k or 0,
            logits_processor=LogitsProcessorList([sampler] if sampler else []),
            eos_token_id=stop_ids, pad_token_id=pad,
            # a row that completes a stop string stops early (make_completion cuts it at that token)
            stopping_criteria=StoppingCriteriaList(
                [StopOnStrings(sampling.stop_strings, self.tokenizer, width)] if sampling.stop_strings else []),
            return_dict_in_generate=True, output_logits=True)
        new_tokens = result.sequences[:, width:].cpu()
        logits = torch.stack(result.logits, dim=1).float().cpu()  # [B, T, V], raw (before processors)
        if not greedy:
            logits = logits / sampling.temperature
        logprobs = torch.gather(torch.log_softmax(logits, -1), -1, new_tokens[..., None]).squeeze(-1)
        return [make_completion(p, new_tokens[i].tolist(), logprobs[i].tolist(), stop_ids=set(stop_ids),
                                tokenizer=self.tokenizer, max_seq_length=self.max_seq_length, version=self.version,
                                stop_strings=sampling.stop_strings)
                for i, p in enumerate(prompts)]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy full tensors (HF names) into the generator's model; every name must match."""
        params: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers()))
        seen = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in params:
                    raise KeyError(f"weight '{name}' from the trainer has no match in the generator")
                params[name].copy_(tensor.to(params[name].dtype))
                seen.add(name)
        missing = {n for n, _ in self.model.named_parameters()} - seen
        if missing:
            raise KeyError(f"the trainer sent no weights for {sorted(missing)[:5]}")
        self.version = version


def shared_prompt_cache(model, ids: torch.Tensor, mask: torch.Tensor):
    """For left-padded prompt rows [B, W] where consecutive rows repeat a prompt (a GRPO group's
    samples): the KV cache of every row's first W - 1 tokens, computed once per distinct prompt
    and copied to its rows, for `generate` to go on from (it computes the last prompt token and
    samples); None when no prompt repeats."""
    from transformers import DynamicCache

    if ids.shape[1] < 2:
        return None
    repeats = (ids[1:] == ids[:-1]).all(dim=1)
    if not bool(repeats.any()):
        return None
    first = torch.cat([torch.ones(1, dtype=torch.bool, device=ids.device), ~repeats])
    prompt_of_row = torch.cumsum(first.long(), 0) - 1
    unique_ids, unique_mask = ids[first][:, :-1], mask[first][:, :-1]
    positions = (unique_mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers left-padded rows
    cache = DynamicCache(config=model.config)
    model(input_ids=unique_ids, attention_mask=unique_mask, position_ids=positions, past_key_values=cache,
          use_cache=True)
    cache.batch_select_indices(prompt_of_row)
    return cache


def sample_seed(seed: int, position: int) -> int:
    """The random seed of the sample at `position` of a step sampled with `seed`."""
    return (seed * 1_000_003 + position) % 2**63


def row_seeds(sampling: SamplingConfig, start: int, count: int) -> list[int] | None:
    """The random seeds of an engine's prompts start .. start + count - 1 (of the prompts it was
    given): their own (sampling.seeds), else each from the step's seed and its position in the
    step; None when unseeded."""
    if sampling.seeds is not None:
        return list(sampling.seeds[start:start + count])
    if sampling.seed is None:
        return None
    return [sample_seed(sampling.seed, sampling.seed_offset + start + row) for row in range(count)]


class RowSampler:
    """A logits processor that samples every row from its own random stream (temperature, top-k,
    top-p applied) and leaves that token alone for greedy decoding to pick, so that a row's
    draws do not depend on the other rows of its batch. The stream is counter-based (splitmix64
    of the row's seed and the decoding step), so all rows draw in one vectorised call.
    `output_logits` still returns the raw logits, from which the logprobs are computed."""

    def __init__(self, seeds: list[int], sampling: SamplingConfig, device: torch.device) -> None:
        self.seeds = torch.tensor([s - 2**64 if s >= 2**63 else s for s in seeds], dtype=torch.int64, device=device)
        self.sampling = sampling
        self.step = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits = scores.float() / self.sampling.temperature
        if self.sampling.top_k:
            kth = torch.topk(logits, min(self.sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.sampling.top_p < 1:
            ordered, order = torch.sort(logits, dim=-1, descending=True)
            before = torch.softmax(ordered, -1).cumsum(-1) - torch.softmax(ordered, -1)  # mass ranked above
            ordered = ordered.masked_fill(before > self.sampling.top_p, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
        cumulative = torch.softmax(logits.double(), -1).cumsum(-1)
        uniform = uniform_draws(self.seeds, self.step) * cumulative[:, -1]
        tokens = torch.searchsorted(cumulative, uniform[:, None]).squeeze(1).clamp(max=scores.shape[-1] - 1)
        self.step += 1
        chosen = torch.full_like(scores, float("-inf"))
        chosen[torch.arange(len(tokens), device=tokens.device), tokens] = 0.0
        return chosen


def uniform_draws(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """One draw in [0, 1) per seed for decoding step `step`: splitmix64 of (seed, step), in
    wrapping int64 arithmetic (float64 result, 53 random bits)."""
    def signed(value: int) -> int:
        return value - 2**64 if value >= 2**63 else value

    def shifted(x: torch.Tensor, bits: int) -> torch.Tensor:  # a logical right shift
        return (x >> bits) & ((1 << (64 - bits)) - 1)

    z = seeds * signed(0xD1B54A32D192ED03) + signed(0x9E3779B97F4A7C15 * (step + 1) % 2**64)
    z = (z ^ shifted(z, 30)) * signed(0xBF58476D1CE4E5B9)
    z = (z ^ shifted(z, 27)) * signed(0x94D049BB133111EB)
    z = z ^ shifted(z, 31)
    return shifted(z, 11).double() / 2.0**53


def make_completion(prompt: Prompt, tokens: list[int], logprobs: list[float], *, stop_ids: set[int], tokenizer,
                    max_seq_length: int | None, version: int, stop_strings: Sequence[str] = ()) -> Completion:
    """A Completion from generated tokens: cut after the first stop token or the token that
    completes a stop string ('stop'), or at the sequence budget ('length'), decoded without
    special tokens."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), None)
    at_string = stop_string_end(tokens[:end], stop_strings, tokenizer)
    end = at_string if at_string is not None else end
    finish: Literal["stop", "length"] = "stop" if end is not None else "length"
    tokens, logprobs = tokens[:end], logprobs[:end]
    room = None if max_seq_length is None else max_seq_length - len(prompt.token_ids)
    if room is not None and len(tokens) > room:
        tokens, logprobs, finish = tokens[:room], logprobs[:room], "length"
    return Completion(prompt=prompt, token_ids=tokens, logprobs=logprobs,
                      text=tokenizer.decode(tokens, skip_special_tokens=True), finish_reason=finish,
                      policy_version=version)
