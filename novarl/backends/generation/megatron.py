"""Megatron generation: sampling with the Megatron policy's own model, on its own ranks.

For models already loaded with Megatron (the seeds' >70B branch), there is no second
copy of the weights and so nothing to sync: after each optimizer step the generator
samples from the weights that were just trained. The driver's `MegatronGeneration`
(GenerationBackend) asks the policy's ranks to run `sample_tokens`; each
data-parallel replica samples a contiguous share of the prompts. Where expert
parallelism spans the replicas (their tokens meet in every MoE layer's
all-to-all), the replicas decode in lockstep: as many batches (a shorter share
padded with copies, dropped), the same positions, until every replica is done.

Decoding uses megatron-core's static KV cache (StaticInferenceContext): rows
advance together one position at a time; a row whose prompt is longer than the
position reached is fed its own prompt token there, as megatron-core's static
engine does. Pipeline stages pass hidden states point to point; the last stage
samples, from the full vocabulary (gathered over tensor-parallel ranks; tensor-
parallel rank 0's draw is the one kept), and sends the tokens back to the other
stages.

`mcore_generation_config`:
- buffer_size_gb caps the KV cache: prompts are decoded in batches whose cache
  fits in it;
- block_size_tokens: the cache length is rounded up to a multiple of it, and
  with enable_chunked_prefill the shared prompt prefix is encoded in chunks of
  that many tokens (one pass otherwise, and always with Transformer Engine's
  layers, whose attention takes no explicit mask once the cache holds keys);
- num_cuda_graphs: decoding runs eagerly (CUDA graphs are not captured).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from novarl.backends.generation.hf import make_completion
from novarl.config.schema import McoreGenerationConfig
from novarl.backends.generation.engines import Ready
from novarl.backends.protocols import GenerationBackend
from novarl.distributed.local import collective_device
from novarl.types import Completion, Prompt, SamplingConfig

Sampled = tuple[list[int], list[float]]
"""Generated token ids (stop token included) and their logprobs at the sampling temperature."""


class MegatronGeneration(GenerationBackend):
    """Implements GenerationBackend with the Megatron policy's model (local or on Ray ranks)."""

    def __init__(self, policy, tokenizer, *, max_seq_length: int, config: McoreGenerationConfig) -> None:
        self.policy = policy
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.config = config
        self.version = 0

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> list[Completion]:
        """One completion per prompt (repeat a prompt for several samples)."""
        stop_ids = {self.tokenizer.eos_token_id, *sampling.stop_token_ids}
        sampled = self.policy.sample_tokens([list(p.token_ids) for p in prompts], sampling, sorted(stop_ids),
                                            self.max_seq_length, self.config)
        return [make_completion(p, tokens, logprobs, stop_ids=stop_ids, tokenizer=self.tokenizer,
                                max_seq_length=self.max_seq_length, version=self.version,
                                stop_strings=sampling.stop_strings)
                for p, (tokens, logprobs) in zip(prompts, sampled, strict=True)]

    def submit(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> Ready:
        """The policy's ranks sample the step's prompts (each data-parallel replica a share)."""
        return Ready(self.generate(prompts, sampling))

    def sync_weights(self, version: int) -> dict[str, float]:
        """The policy stepped: its weights are the ones this generator samples from; nothing moves."""
        self.version = version
        return {}

    def describe(self) -> str:
        return "generation: megatron on the policy's own ranks and model (no second copy, no weight sync)"

    def shutdown(self) -> None:
        """The policy's ranks are the policy's to stop."""


# ------------------------------------------------------------ on the ranks
@torch.no_grad()
def sample_tokens(model, prompts: list[list[int]], sampling: SamplingConfig, stop_ids: list[int],
                  max_seq_length: int, config: McoreGenerationConfig) -> list[Sampled]:
    """Collective over every rank of a MegatronModel: rank 0 returns every prompt's sample,
    the others []. Each data-parallel replica decodes a contiguous share; where experts span the
    replicas, in lockstep (`lockstep_group`)."""
    share = -(-len(prompts) // model.dp_size)
    start = model.dp_rank * share
    mine = prompts[start:start + share]
    seeds = None if sampling.seeds is None else list(sampling.seeds[start:start + share])
    real = len(mine)
    group = lockstep_group(model)
    if group is not None and prompts:  # as many batches on every replica: copies, finished from the start, dropped
        mine = mine + [prompts[0]] * (share - real)
        if seeds is not None and sampling.seeds:
            seeds += [sampling.seeds[0]] * (share - real)
    cache = _cache_length(mine, sampling, max_seq_length, config, group) if mine else 0
    batch = max_batch(model, config, cache) if mine else 1
    out: list[Sampled] = []
    training = model.module.training
    model.module.eval()  # no recomputation while decoding
    try:
        for index, first in enumerate(range(0, len(mine), batch)):
            seed = None if sampling.seed is None else sampling.seed * 1_000_003 + start + index
            if seeds is not None:  # the prompts' own: a batch draws from its first one's
                seed = seeds[first]
            rows = mine[first:first + batch]
            copies = len(rows) - max(0, min(real - first, len(rows)))
            out.extend(_decode(model, rows, sampling, set(stop_ids), max_seq_length, config, seed,
                               cache if group is not None else None, group, copies))
    finally:
        model.module.train(training)
    out = out[:real]
    keep = out if model.tp_rank == 0 and model.pp_rank == 0 else None
    parts: list = [None] * dist.get_world_size()
    dist.gather_object((model.dp_rank, keep), parts if dist.get_rank() == 0 else None, dst=0, group=model.cpu_group)
    if dist.get_rank() != 0:
        return []
    by_replica = dict(p for p in parts if p[1] is not None)
    return [sample for replica in sorted(by_replica) for sample in by_replica[replica]]


def max_batch(model, config: McoreGenerationConfig, cache_length: int) -> int:
    """Sequences whose KV cache (the layers of the largest pipeline stage, this rank's heads)
    fits in buffer_size_gb."""
    from novarl.backends.megatron.model import largest_stage

    shape, cfg = model.shape, model.config
    bytes_per_value = 2 if cfg.params_dtype in (torch.bfloat16, torch.float16) else 4
    # the same on every stage (the largest one decides), so their batches line up
    per_sequence = (2 * largest_stage(cfg) * max(shape.num_kv_heads // model.tp_size, 1) * shape.head_dim
                    * cache_length * bytes_per_value)
    return max(1, int(config.buffer_size_gb * 1e9 // per_sequence))


def lockstep_group(model) -> dist.ProcessGroup | None:
    """The data-parallel group whose replicas must decode in lockstep, where the experts span them (their
    tokens meet in each MoE layer's all-to-all: every replica must run every forward, or the others wait in
    it); None where each replica decodes on its own."""
    return model.dp_group if model.experts_span_data and model.dp_size > 1 else None


def _agreed(value: int, group: dist.ProcessGroup | None, op) -> int:
    """`value` reduced with `op` over the lockstep group (the value itself without one)."""
    if group is None:
        return value
    box = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(box, op=op, group=group)
    return int(box.item())


def _cache_length(prompts: list[list[int]], sampling: SamplingConfig, max_seq_length: int,
                  config: McoreGenerationConfig, group: dist.ProcessGroup | None = None) -> int:
    """The KV cache's length for these prompts (the longest over the lockstep group's replicas)."""
    longest = min(max(len(p) for p in prompts) + sampling.max_new_tokens, max_seq_length)
    longest = _agreed(longest, group, dist.ReduceOp.MAX)
    return -(-longest // config.block_size_tokens) * config.block_size_tokens


def _decode(model, prompts: list[list[int]], sampling: SamplingConfig, stop_ids: set[int], max_seq_length: int,
            config: McoreGenerationConfig, seed: int | None, cache: int | None = None,
            group: dist.ProcessGroup | None = None, copies: int = 0) -> list[Sampled]:
    """One batch's samples. cache: the KV cache's length (None: the batch's own). With a lockstep group, every
    replica runs as many forwards over the same positions: the prefix every row of every replica has, then one
    position at a time until every replica is done; its last `copies` rows are padding, finished from the start."""
    from megatron.core.inference.contexts import StaticInferenceContext

    rows, device = len(prompts), model.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    limit = torch.clamp(lengths + sampling.max_new_tokens, max=max_seq_length)
    total = _agreed(int(limit.max()), group, dist.ReduceOp.MAX)
    tokens = torch.zeros(rows, total, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(prompt[:total], device=device)
    logprobs = torch.zeros(rows, total, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    if copies:
        finished[rows - copies:] = True
    context = StaticInferenceContext(rows, cache or _cache_length(prompts, sampling, max_seq_length, config))
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(seed)
    position = _agreed(int(lengths.min()), group, dist.ReduceOp.MIN)
    # Transformer Engine's attention drops the explicit mask once the cache holds keys, so a chunk
    # after the first would see its own later tokens: with it, the prefix goes in one pass.
    chunked = config.enable_chunked_prefill and not model.fused_norms
    chunk = config.block_size_tokens if chunked else position
    for begin in range(0, position, chunk):  # the prefix every row has
        logits = _forward_stage(model, tokens, begin, min(begin + chunk, position), context)
    stops = torch.tensor(sorted(stop_ids), device=device)
    while position < total:  # one wait for the device a token: whether every row has finished
        chosen, chosen_logprobs = _sample(model, logits, sampling, generator, rows)
        in_prompt = position < lengths
        active = ~in_prompt & ~finished & (position < limit)
        tokens[:, position] = torch.where(in_prompt, tokens[:, position], torch.where(active, chosen, 0))
        logprobs[:, position] = torch.where(active, chosen_logprobs, 0.0)
        finished |= (active & torch.isin(chosen, stops)) | (~in_prompt & (position + 1 >= limit))
        position += 1
        if position >= total or _agreed(int(finished.all()), group, dist.ReduceOp.MIN):
            break
        logits = _forward_stage(model, tokens, position - 1, position, context)
    out = []
    all_tokens, all_logprobs, limits = tokens.tolist(), logprobs.tolist(), limit.tolist()  # one copy each
    for row in range(rows):
        first, end = len(prompts[row]), limits[row]
        generated = all_tokens[row][first:end]
        cut = next((i + 1 for i, t in enumerate(generated) if t in stop_ids), len(generated))
        out.append((generated[:cut], all_logprobs[row][first:first + cut]))
    return out


def _forward_stage(model, tokens: torch.Tensor, begin: int, end: int, context) -> torch.Tensor | None:
    """Positions [begin, end) through this pipeline stage with the KV cache; the last stage
    returns the full-vocabulary logits of position end - 1 ([B, V]), the others None."""
    module = model.module
    rows, width = tokens.shape[0], end - begin
    if not model.first_stage:
        hidden = torch.empty(width, rows, model.shape.hidden_size, dtype=model.config.params_dtype,
                             device=model.device)
        dist.recv(hidden, src=_stage_rank(model, model.pp_rank - 1), group=model.pp_group)
        module.set_input_tensor(hidden)
    positions = torch.arange(begin, end, device=model.device).unsqueeze(0).expand(rows, -1)
    # queries at positions [begin, end) see keys [0, end): causal within the chunk
    mask = torch.ones(width, end, dtype=torch.bool, device=model.device).triu(begin + 1)[None, None]
    output = module(tokens[:, begin:end], positions, mask, inference_context=context, runtime_gather_output=True)
    context.increment_sequence_len_offset(width)
    if not model.last_stage:
        dist.send(output.contiguous(), dst=_stage_rank(model, model.pp_rank + 1), group=model.pp_group)
        return None
    return output[:, -1, :model.shape.vocab_size].float()


def _sample(model, logits: torch.Tensor | None, sampling: SamplingConfig, generator: torch.Generator,
            rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B]) drawn on the last stage and sent to the others. The logprob
    is at the sampling temperature before top-p/top-k, as the trainer computes it."""
    tokens = torch.zeros(rows, dtype=torch.long, device=model.device)
    chosen_logprobs = torch.zeros(rows, device=model.device)
    if model.last_stage:
        assert logits is not None  # the last stage computes them
        greedy = sampling.temperature == 0
        scaled = logits if greedy else logits / sampling.temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        if greedy:
            tokens = scaled.argmax(dim=-1)
        else:
            probs = _filtered(scaled, top_p=sampling.top_p, top_k=sampling.top_k).softmax(dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        chosen_logprobs = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    if model.last_stage and model.tp_size > 1:  # every tensor-parallel rank keeps tp rank 0's draw
        source = dist.get_global_rank(model.tp_group, 0)
        dist.broadcast(tokens, src=source, group=model.tp_group)
        dist.broadcast(chosen_logprobs, src=source, group=model.tp_group)
    if model.pp_size > 1:
        last = _stage_rank(model, model.pp_size - 1)
        dist.broadcast(tokens, src=last, group=model.pp_group)
        dist.broadcast(chosen_logprobs, src=last, group=model.pp_group)
    return tokens, chosen_logprobs


def _filtered(logits: torch.Tensor, *, top_p: float, top_k: int | None) -> torch.Tensor:
    """Logits with everything outside the top k and the top-p nucleus set to -inf."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        before = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)
        drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, before > top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _stage_rank(model, stage: int) -> int:
    return dist.get_global_rank(model.pp_group, stage)
