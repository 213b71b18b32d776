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
from novarl.plan.resolve import (BackendChoice, BatchPlan, plan_batches, require_available, resolve_backends,
                                 world_size)
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
    if choice.training == "megatron":
        check_megatron_model(cfg, model_path)
    tokenizer = load_tokenizer(cfg.policy.tokenizer.name or model_path,
                               trust_remote_code=cfg.policy.trust_remote_code)
    scorer = RewardScorer.from_spec(reward_fn or cfg.reward.function)
    train = split_prompts(cfg, tokenizer, "train", train_examples)
    val = split_prompts(cfg, tokenizer, "validation", train_examples)[:cfg.grpo.max_val_samples]
    sampler = PromptSampler(train, cfg.grpo.num_prompts_per_step, seed=cfg.grpo.seed, shuffle=cfg.data.shuffle)
    info(f"model: {cfg.policy.model_name} ({model_path}); {len(train)} train / {len(val)} held-out prompts; "
         f"reward: {scorer.name}")
    return RunInputs(choice, batches, model_path, tokenizer, scorer, sampler, val)


def check_megatron_model(cfg: NovaRLConfig, model_path: str) -> None:
    """What megatron_cfg asks of this model, checked here rather than on every rank."""
    from transformers import AutoConfig

    from novarl.backends.megatron.model import check_model, transformer_config

    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.policy.trust_remote_code)
    shape = check_model(hf_config, cfg.policy)
    precision = cfg.policy.precision or ("bfloat16" if torch.cuda.is_available() else "float32")
    transformer_config(hf_config, shape, cfg.policy, precision=precision, world_size=world_size(cfg))


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

    def release_generator(self) -> None:
        """Free a colocated generator's accelerator memory for training (vLLM sleep on GPU);
        it wakes when it next takes weights or generates."""
        offload = getattr(self.generator, "offload", None)
        if offload is not None:
            offload()

    def sync_weights(self, version: int) -> dict[str, float]:
        """The policy's current weights into the generator: rank to rank over the weight-transfer
        group when the generator is dedicated (metrics: MB sent), by reference in this process
        when colocated (no metrics); nothing moves when it samples from the policy's own model."""
        if hasattr(self.generator, "follow_policy"):
            self.generator.follow_policy(version)
            return {}
        if hasattr(self.generator, "pull_weights"):
            return {"weight_sync_mb": self.generator.pull_weights(version) / 1e6}
        self.generator.update_weights(self.policy.named_weights(), version=version)
        return {}

    def shutdown(self) -> None:
        """Stop remote workers (in-process roles need nothing); safe to call twice."""
        for name in ("generator", "reference", "policy"):
            role = getattr(self, name)
            if hasattr(role, "shutdown"):
                role.shutdown()


def build_generator(cfg: NovaRLConfig, inputs: RunInputs, device: torch.device, policy=None):
    """The generation backend the config resolved to: in this process when colocated,
    on its own Ray actor when `policy.generation.colocated.enabled` is false, on the
    policy's own ranks for Megatron generation."""
    gen = cfg.policy.generation
    precision = generation_precision(cfg, device)
    if inputs.choice.generation == "megatron":
        from novarl.backends.generation.megatron import MegatronGeneration

        return MegatronGeneration(policy, inputs.tokenizer, max_seq_length=cfg.policy.max_seq_length,
                                  config=gen.mcore_generation_config)
    if inputs.choice.generation == "vllm":
        from novarl.backends.generation.vllm import VllmGeneration

        factory, kwargs = VllmGeneration, dict(
            model_path=inputs.model_path, tokenizer=inputs.tokenizer, cfg=gen, precision=precision,
            max_seq_length=cfg.policy.max_seq_length, seed=cfg.grpo.seed,
            trust_remote_code=cfg.policy.trust_remote_code)
    else:
        from novarl.backends.generation.hf import HFGeneration

        factory, kwargs = HFGeneration, dict(
            model_path=inputs.model_path, tokenizer=inputs.tokenizer, device=None, precision=precision,
            batch_size=gen.generation_batch_size or cfg.policy.generation_batch_size,
            max_seq_length=cfg.policy.max_seq_length, trust_remote_code=cfg.policy.trust_remote_code)
    if gen.colocated.enabled:
        return factory(**{**kwargs, **({"device": device} if "device" in kwargs else {})})
    from novarl.distributed.ray_group import RayWorkerGroup
    from novarl.distributed.remote import RemoteGenerator

    res = gen.colocated.resources
    gpus = (res.gpus_per_node or 1) * (res.num_nodes or 1) if device.type == "cuda" else 0
    info(f"starting the {inputs.choice.generation} generator on its own Ray actor "
         f"({f'{gpus} GPU(s)' if gpus else '1 CPU'})")
    return RemoteGenerator(RayWorkerGroup(factory, kwargs, world_size=1, gpus_per_rank=gpus, name="generator"))


def build_roles(cfg: NovaRLConfig, inputs: RunInputs, device: torch.device) -> Roles:
    """The policy (and reference) on one in-process rank or on Ray ranks, and the generator.
    If one role fails to start, the ones already started are shut down."""
    roles = Roles(policy=None, reference=None, generator=None)
    try:
        roles.policy, roles.reference = build_trainers(cfg, inputs, device)
        roles.generator = build_generator(cfg, inputs, device, roles.policy)
        if not cfg.policy.generation.colocated.enabled:
            roles.generator.connect(roles.policy)
    except BaseException:
        roles.shutdown()
        raise
    return roles


def build_trainers(cfg: NovaRLConfig, inputs: RunInputs, device: torch.device):
    temperature = cfg.policy.generation.temperature
    total_steps = cfg.grpo.max_num_steps * inputs.batches.optimizer_steps_per_step
    common = dict(policy=cfg.policy, model_path=inputs.model_path, temperature=temperature)
    policy_only: dict = dict(total_steps=total_steps)
    if inputs.choice.training == "deepspeed":
        from novarl.backends.training.deepspeed import DeepSpeedPolicy as Policy
        from novarl.backends.training.deepspeed import DeepSpeedReference as Reference

        policy_only["accumulation_steps"] = inputs.batches.gradient_accumulation_steps
    elif inputs.choice.training == "megatron":
        from novarl.backends.training.megatron import MegatronPolicy as Policy
        from novarl.backends.training.megatron import MegatronReference as Reference

        common["emulate_cuda"] = _megatron_on_cpu(inputs)  # the ranks' processes may not see the variable
        policy_only["seed"] = cfg.grpo.seed
    else:
        from novarl.backends.training.dtensor import DTensorPolicy as Policy
        from novarl.backends.training.dtensor import DTensorReference as Reference
    policy_args, reference_args = {**common, **policy_only}, common
    with_reference = cfg.loss_fn.reference_policy_kl_penalty > 0
    ranks = world_size(cfg)
    if ranks == 1 and cfg.policy.generation.colocated.enabled and not _megatron_on_cpu(inputs):
        from novarl.distributed.local import ensure_single_process_group

        ensure_single_process_group()
        policy = Policy(device=device, **policy_args)
        return policy, Reference(device=device, **reference_args) if with_reference else None
    from novarl.distributed.ray_group import RayWorkerGroup
    from novarl.distributed.remote import RemotePolicy, RemoteReference

    gpus = 1 if device.type == "cuda" else 0
    info(f"starting {ranks} policy ranks on Ray ({'1 GPU' if gpus else '1 CPU'} each)")
    group = RayWorkerGroup(Policy, policy_args, world_size=ranks, gpus_per_rank=gpus, name="policy")
    policy = RemotePolicy(group)
    if not with_reference:
        return policy, None
    try:
        group.add_role(RemoteReference.ROLE, Reference, reference_args)  # on the policy's ranks
        return policy, RemoteReference(group)
    except BaseException:
        policy.shutdown()
        raise


def _megatron_on_cpu(inputs: RunInputs) -> bool:
    """megatron-core emulated on the CPU changes torch process-wide: never in the driver."""
    from novarl.backends.megatron import cpu

    return inputs.choice.training == "megatron" and cpu.requested()
