"""Building the roles a GRPO run needs from a validated config.

Everything that can fail on bad input (backends, data, reward function, model
path) is checked here, before any output folder is written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from novarl.config.schema import NovaRLConfig
from novarl.data.arithmetic import Example
from novarl.data.datasets import PromptSampler, load_examples, read_prompt_template, to_prompts
from novarl.errors import UserError
from novarl.logging.console import info
from novarl.models.loading import load_tokenizer, resolve_model_path
from novarl.plan.resolve import BackendChoice, BatchPlan, plan_batches, require_available, resolve_backends
from novarl.rewards.registry import RewardScorer
from novarl.types import Prompt


@dataclass
class RunInputs:
    """What is read and checked before anything heavy starts."""

    choice: BackendChoice
    batches: BatchPlan
    model_path: str
    tokenizer: object
    scorer: RewardScorer
    sampler: PromptSampler
    val_prompts: list[Prompt]


def prepare_inputs(cfg: NovaRLConfig, reward_fn: str | Callable[..., float] | None = None,
                   train_examples: list[Example] | None = None) -> RunInputs:
    """Check the backends, batch arithmetic, model, tokenizer, reward and data.

    train_examples: in-memory examples used for training and (the first
    grpo.max_val_samples) for evaluation, instead of the configured data.
    """
    choice = resolve_backends(cfg)
    availability = require_available(cfg, choice)
    batches = plan_batches(cfg)
    info(choice.describe())
    for note in (*choice.notes, *availability.warnings):
        info(note)
    info(batches.describe())

    model_path = resolve_model_path(cfg.policy.model_name)
    tokenizer = load_tokenizer(cfg.policy.tokenizer.name or model_path,
                               trust_remote_code=cfg.policy.trust_remote_code)
    scorer = RewardScorer.from_spec(reward_fn or cfg.reward.function)
    train = split_prompts(cfg, tokenizer, "train", train_examples)
    val = split_prompts(cfg, tokenizer, "validation", train_examples)[:cfg.grpo.max_val_samples]
    sampler = PromptSampler(train, cfg.grpo.num_prompts_per_step, seed=cfg.grpo.seed, shuffle=cfg.data.shuffle)
    info(f"model: {cfg.policy.model_name} ({model_path}); {len(train)} train / {len(val)} held-out prompts; "
         f"reward: {scorer.name}")
    return RunInputs(choice, batches, model_path, tokenizer, scorer, sampler, val)


def split_prompts(cfg: NovaRLConfig, tokenizer, split: str,
                  examples: list[Example] | None = None) -> list[Prompt]:
    """Tokenised prompts of a split that fit the sequence budget (at least one)."""
    template, system = read_prompt_template(cfg.data)
    examples = examples if examples is not None else load_examples(cfg.data, split)
    max_prompt = min(cfg.data.max_input_seq_length or cfg.policy.max_seq_length,
                     cfg.policy.max_seq_length - 1)
    prompts = to_prompts(examples, tokenizer, template=template, system_prompt=system,
                         max_prompt_tokens=max_prompt)
    if not prompts:
        raise UserError(f"No {split} prompt fits in {max_prompt} tokens (policy.max_seq_length="
                        f"{cfg.policy.max_seq_length}); raise it or shorten the prompts.")
    if len(prompts) < len(examples):
        info(f"{len(examples) - len(prompts)} {split} prompts longer than {max_prompt} tokens were dropped")
    return prompts


def generation_precision(cfg: NovaRLConfig, device: torch.device) -> str:
    return cfg.policy.generation.vllm_cfg.precision or cfg.policy.precision or \
        ("bfloat16" if device.type == "cuda" else "float32")


def prepare_eval(cfg: NovaRLConfig, model: str, device: torch.device):
    """(generator, held-out prompts, scorer) to evaluate the model `model`."""
    from novarl.backends.generation.hf import HFGeneration

    model_path = resolve_model_path(model)
    tokenizer = load_tokenizer(model_path, trust_remote_code=cfg.policy.trust_remote_code)
    scorer = RewardScorer.from_spec(cfg.reward.function)
    prompts = split_prompts(cfg, tokenizer, "validation")[:cfg.grpo.max_val_samples]
    generator = HFGeneration(model_path, tokenizer, device, precision=generation_precision(cfg, device),
                             max_seq_length=cfg.policy.max_seq_length, trust_remote_code=cfg.policy.trust_remote_code)
    return generator, prompts, scorer


@dataclass
class Roles:
    policy: object
    """TrainingBackend."""
    reference: object | None
    """Frozen reference with .logprobs(batch), or None when the KL penalty is 0."""
    generator: object
    """GenerationBackend."""


def build_roles(cfg: NovaRLConfig, inputs: RunInputs, device: torch.device) -> Roles:
    from novarl.backends.generation.hf import HFGeneration
    from novarl.backends.training.dtensor import DTensorPolicy, DTensorReference
    from novarl.distributed.local import ensure_single_process_group

    ensure_single_process_group()
    temperature = cfg.policy.generation.temperature
    policy = DTensorPolicy(cfg.policy, inputs.model_path, device,
                           total_steps=cfg.grpo.max_num_steps * inputs.batches.optimizer_steps_per_step,
                           temperature=temperature)
    reference = None
    if cfg.loss_fn.reference_policy_kl_penalty > 0:
        reference = DTensorReference(cfg.policy, inputs.model_path, device, temperature=temperature)
    generator = HFGeneration(inputs.model_path, inputs.tokenizer, device,
                             precision=generation_precision(cfg, device),
                             batch_size=cfg.policy.generation.generation_batch_size or cfg.policy.generation_batch_size,
                             max_seq_length=cfg.policy.max_seq_length,
                             trust_remote_code=cfg.policy.trust_remote_code)
    return Roles(policy, reference, generator)
