"""Typed, frozen configuration models.

Key names follow the seed documents (NeMo RL, ROLL, NovaRL) so their YAML
files load as they are. Where two seeds name one thing differently, the loader
(`novarl.config.loading`) rewrites the alias to the canonical name before these
models see it: `dtensor_config` -> `dtensor_cfg`, `max_total_sequence_length`
-> `max_seq_length`, `algorithm` -> `grpo`.

Every section forbids unknown keys and is immutable once validated. Fields whose
backend is not built yet are still typed here; `novarl.backends.contract.resolve` reports
them as "not available yet" only when a run would need them.

Rules every section applies: floats are finite (no field takes inf or nan; a
float | None field takes None for "no limit"), integers fit in 64 bits, and
file and folder names (`PathText`) are names a file system can hold.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Field, PrivateAttr, Tag, field_validator, model_validator

from novarl.config.sections.algorithm import (  # noqa: F401 (re-exported: the schema is read as one)
    AdvEstimatorConfig, AsyncGRPOConfig, GRPOConfig, LossConfig, RewardScalingConfig, RewardShapingConfig,
    ValueLossConfig)
from novarl.config.sections.base import (  # noqa: F401
    NAME_MAX_BYTES, PATH_MAX_BYTES, PathText, Precision, Section, _finite_numbers)
from novarl.config.sections.data import (  # noqa: F401
    BUNDLED_TASKS, DataConfig, DatasetBlock, EnvConfig, RewardConfig, check_domains)
from novarl.config.sections.generation import (  # noqa: F401
    FOREIGN_GENERATION, VLLM_LORA_RANKS, ColocatedConfig, GenerationConfig, McoreGenerationConfig, ResourcesConfig,
    VllmConfig)
from novarl.config.sections.training import (  # noqa: F401
    DeepSpeedConfig, DTensorConfig, DynamicBatchingConfig, FP8Config, LoraConfig, MegatronConfig, MegatronDDPConfig,
    MegatronOptimizerConfig, MegatronSchedulerConfig, SequencePackingConfig)


# --------------------------------------------------------------------- cluster
class ClusterConfig(Section):
    gpus_per_node: int = Field(1, ge=0)
    """GPUs per node given to the run; 0 means CPU ranks."""
    num_nodes: int = Field(1, ge=1)
    """Nodes in the run."""


# -------------------------------------------------------------- policy (the generation and backends'
# sections are in config/sections/generation.py and training.py)
TORCH_OPTIMIZERS = frozenset({"ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS", "NAdam",
                              "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam"})
"""torch.optim's optimizer classes, known without importing torch (validation stays light: `novarl
validate` on a config without a local model imports no torch). Any other name is looked up in torch."""

TORCH_SCHEDULERS = frozenset({"ChainedScheduler", "ConstantLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts",
                              "CyclicLR", "ExponentialLR", "LambdaLR", "LinearLR", "MultiStepLR",
                              "MultiplicativeLR", "OneCycleLR", "PolynomialLR", "ReduceLROnPlateau",
                              "SequentialLR", "StepLR"})
"""torch.optim.lr_scheduler's classes, known without importing torch."""


def _torch_has(module: str, name: str) -> bool:
    """Whether `module` (imported only for a name the lists above do not hold) has the class `name`."""
    import importlib

    return isinstance(getattr(importlib.import_module(module), name, None), type)


class OptimizerConfig(Section):
    name: str = "torch.optim.AdamW"
    """A class in torch.optim, by its import path."""
    kwargs: Annotated[dict[str, Any], AfterValidator(_finite_numbers)] = {
        "lr": 5e-6, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}

    @field_validator("name")
    @classmethod
    def _torch_optimizer(cls, name: str) -> str:
        short = name.removeprefix("torch.optim.")
        if "." in short or short not in TORCH_OPTIMIZERS and not _torch_has("torch.optim", short):
            raise ValueError(f"'{name}' is not an optimizer class in torch.optim (e.g. torch.optim.AdamW)")
        return name


class SchedulerStep(Section):
    name: str
    """A class in torch.optim.lr_scheduler, by its import path."""
    kwargs: Annotated[dict[str, Any], AfterValidator(_finite_numbers)] = {}

    @field_validator("name")
    @classmethod
    def _torch_scheduler(cls, name: str) -> str:
        short = name.removeprefix("torch.optim.lr_scheduler.")
        if "." in short or short not in TORCH_SCHEDULERS and not _torch_has("torch.optim.lr_scheduler", short):
            raise ValueError(f"'{name}' is not a scheduler class in torch.optim.lr_scheduler")
        return name


class SchedulerMilestones(Section):
    milestones: list[int]
    """Steps at which the next scheduler in the list takes over."""


def _scheduler_kind(item: Any) -> str:
    """SchedulerMilestones for {milestones: [...]} (or one already built), else SchedulerStep,
    whose validation then says what is wrong with an item that is not a mapping."""
    if isinstance(item, SchedulerMilestones) or isinstance(item, dict) and "milestones" in item:
        return "SchedulerMilestones"
    return "SchedulerStep"


SchedulerItem = Annotated[
    Annotated[SchedulerStep, Tag("SchedulerStep")] | Annotated[SchedulerMilestones, Tag("SchedulerMilestones")],
    Discriminator(_scheduler_kind),
]


def _default_scheduler() -> list[SchedulerItem]:
    return [
        SchedulerStep(name="torch.optim.lr_scheduler.LinearLR",
                      kwargs={"start_factor": 0.1, "end_factor": 1.0, "total_iters": 10}),
        SchedulerStep(name="torch.optim.lr_scheduler.ConstantLR",
                      kwargs={"factor": 1.0, "total_iters": 10_000_000_000}),
        SchedulerMilestones(milestones=[10]),
    ]


class TokenizerConfig(Section):
    name: PathText | None = None
    """Tokenizer folder or hub id; None: the model's own."""
    chat_template: str | None = "default"
    """NeMo RL's meanings: 'default' the tokenizer's own template (prompts as plain text when it
    has none); null the pass-through template (the messages' contents, no role markers); a
    Jinja string, or the path of a .jinja / .j2 / .txt file holding one."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Passed to the template (e.g. {enable_thinking: false} for Qwen3)."""


class PolicyConfig(Section):
    model_name: PathText = "tiny-arith"
    """Hugging Face hub id, local folder, or a bundled model name (tiny-arith)."""
    backend: Literal["auto"] | None = None
    """novarl's own key. 'auto': the planner picks the training backend, parallel sizes,
    generation backend and placement (see `novarl plan`), overriding the *_cfg flags; None:
    the flags decide (megatron > deepspeed > dtensor)."""
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    trust_remote_code: bool = False
    hf_config_overrides: dict[str, Any] = {}
    """Keys of the model's config.json replaced for the whole run (NeMo RL's key; as transformers'
    from_pretrained(path, **overrides) replaces them), e.g. {max_position_embeddings: 16384}: training,
    generation, Megatron's conversion and the exported folder all read the overridden config
    (models/config_overrides.py)."""
    train_global_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step; None: all samples of a GRPO step."""
    train_micro_batch_size: int = Field(4, ge=1)
    """Samples per forward/backward on one data-parallel rank."""
    generation_batch_size: int | None = Field(None, ge=1)
    logprob_batch_size: int | None = Field(None, ge=1)
    """Samples per logprob forward; None: train_micro_batch_size."""
    max_seq_length: int = Field(512, ge=2)
    """Prompt + completion tokens, at most (alias max_total_sequence_length)."""
    precision: Precision | None = None
    """None: bfloat16 on GPU, float32 on CPU."""
    logprob_chunk_size: int | None = Field(None, ge=1)
    """Tokens whose float32 logits are computed at once for their logprobs (models/logprob_head.py);
    None: as many as 1 GiB of them holds. DTensor, DeepSpeed, and Megatron-core without context
    parallelism (backends/megatron/picking.py: under tensor parallelism over each rank's part of the
    vocabulary)."""
    dtensor_cfg: DTensorConfig = Field(default_factory=DTensorConfig)
    megatron_cfg: MegatronConfig = Field(default_factory=MegatronConfig)
    deepspeed_cfg: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    sequence_packing: SequencePackingConfig = Field(default_factory=SequencePackingConfig)
    make_sequence_length_divisible_by: int = Field(1, ge=1)
    max_grad_norm: float | None = Field(1.0, ge=0)
    optimizer: OptimizerConfig | None = Field(default_factory=OptimizerConfig)
    """None (NeMo RL's way to say it): the Megatron backend's own optimizer (megatron_cfg.optimizer)."""
    scheduler: list[SchedulerItem] | None = Field(default_factory=_default_scheduler)
    """None: a constant learning rate (Megatron: megatron_cfg.scheduler)."""
    generation: GenerationConfig = Field(default_factory=GenerationConfig)

    @property
    def sends_adapter(self) -> bool:
        """Whether the weight syncs carry the LoRA adapters alone (generation.lora_sync: adapter, with LoRA on):
        see WeightSender in backends/protocols.py."""
        return self.dtensor_cfg.lora_cfg.enabled and self.generation.lora_sync == "adapter"

    @model_validator(mode="after")
    def _optimizer_given(self) -> "PolicyConfig":
        if self.optimizer is None and not self.megatron_cfg.enabled:
            raise ValueError("policy.optimizer is null, which only the Megatron backend allows (it reads "
                             "policy.megatron_cfg.optimizer): give policy.optimizer {name, kwargs}, or set "
                             "policy.megatron_cfg.enabled=true")
        return self

    @field_validator("scheduler")
    @classmethod
    def _one_milestone_list(cls, steps: list | None) -> list | None:
        if steps is None:
            return None
        schedulers = [s for s in steps if isinstance(s, SchedulerStep)]
        milestones = [s for s in steps if isinstance(s, SchedulerMilestones)]
        if len(milestones) > 1:
            raise ValueError("give at most one {milestones: [...]} entry")
        if milestones and len(milestones[0].milestones) != len(schedulers) - 1:
            raise ValueError(
                f"{len(schedulers)} schedulers need {len(schedulers) - 1} milestones, "
                f"got {len(milestones[0].milestones)}")
        if len(schedulers) > 1 and not milestones:
            raise ValueError(f"{len(schedulers)} schedulers need a {{milestones: [...]}} entry")
        return steps


class RewardModelConfig(Section):
    """NeMo RL's value.reward_model_cfg: the critic is a causal LM with a scalar (regression) head."""

    enabled: bool = True
    reward_model_type: Literal["regression"] = "regression"

    @model_validator(mode="after")
    def _a_scalar_head(self) -> "RewardModelConfig":
        if not self.enabled:
            raise ValueError("value.reward_model_cfg.enabled=false: the critic is a model with a scalar "
                             "(regression) head; leave it true")
        return self


class ValueConfig(PolicyConfig):
    """PPO's value model (its critic), NeMo RL's `value` section: the policy's settings (loading
    merges this section over the policy's, config/loading.py) with these changes. It runs on the
    policy's training backend and ranks, beside it, like the reference policy; its output head is
    a zero-initialised scalar (models/critic.py) on model_name's architecture."""

    reward_model_cfg: RewardModelConfig = Field(default_factory=RewardModelConfig)
    backend: None = None
    """The critic runs on the policy's backend (policy.backend)."""
    generation: None = None
    """The critic generates nothing."""


# ------------------------------------------------------------------ outputs
class CheckpointingConfig(Section):
    enabled: bool = True
    checkpoint_dir: PathText = "results/grpo"
    metric_name: str | None = "val_reward"
    """The summary value keep_top_k ranks by (NeMo RL's "val:accuracy" is val_accuracy); None: the newest."""
    higher_is_better: bool = True
    keep_top_k: int | None = Field(3, ge=1)
    save_period: int = Field(10, ge=1)
    checkpoint_must_save_by: str | None = None
    model_save_format: Literal["safetensors", "torch_save"] | None = "safetensors"
    """The Hugging Face folders' file format (the run's policy/ and `novarl convert`): safetensors,
    or torch_save (pytorch_model.bin); None: safetensors."""
    save_consolidated: bool = False


class WandbConfig(Section):
    project: str = "novarl"
    name: str | None = None
    entity: str | None = None


class MlflowConfig(Section):
    experiment_name: str = "novarl"
    run_name: str | None = None
    """None: the run folder's name (exp_001, ...)."""
    tracking_uri: str | None = None
    """None: $MLFLOW_TRACKING_URI, else MLflow's default."""
    artifact_location: str | None = None


class GpuMonitoringConfig(Section):
    collection_interval: float = Field(10, gt=0)
    flush_interval: float = Field(10, gt=0)


class LoggerConfig(Section):
    log_dir: PathText = "logs"
    """Each run writes to a new numbered folder under it (exp_001, ...)."""
    num_val_samples_to_print: int = Field(0, ge=0)
    """The first this many samples of each evaluation: printed, and written whole (an episode's every turn
    and observation, as the tokens were) to samples/eval_step_<N>.jsonl in the run folder."""
    progress_bar: bool = True
    print_every_n_steps: int = Field(10, ge=1)
    wandb_enabled: bool = False
    tensorboard_enabled: bool = False
    mlflow_enabled: bool = False
    swanlab_enabled: bool = False
    monitor_gpus: bool = False
    """Each step's GPU memory (allocated, peak, reserved; GB) and utilisation (%), the maximum over
    the training ranks, in the step's metrics (novarl/distributed/gpu_monitor.py); none without CUDA."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    tensorboard: dict[str, Any] = {}
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    gpu_monitoring: GpuMonitoringConfig = Field(default_factory=GpuMonitoringConfig)


# ------------------------------------------------------------------ the whole
GENERATION_ON_THE_POLICY = {"megatron": "megatron_cfg"}
"""Generation backends that sample with the policy's own model -> the training backend's section they need."""


class NovaRLConfig(Section):
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    loss_fn: LossConfig = Field(default_factory=LossConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    value: ValueConfig | None = None
    """PPO's critic (grpo.adv_estimator.name: gae); None: no critic."""
    value_loss_fn: ValueLossConfig = Field(default_factory=ValueLossConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    env: dict[str, EnvConfig] = {}
    """NeMo RL's environments: env.math (scored by reward.function math_verify, or dapo_math_verify), and the
    environments that play episodes (actor_class_fqn, or an agent): several in a run, each example
    in the one its data names (data.*.env_name; rollout/routing.py); an agent plays a run alone."""
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    _load_warnings: tuple[str, ...] = PrivateAttr(default=())
    _load_notes: tuple[str, ...] = PrivateAttr(default=())

    @property
    def load_warnings(self) -> tuple[str, ...]:
        """What loading said about the file (settings accepted and not used, names rewritten),
        one line each; novarl validate, plan and train print them (config/loading.py: with_warnings)."""
        return self._load_warnings

    @property
    def load_notes(self) -> tuple[str, ...]:
        """What loading rewrote that is worth a line (a ROLL config: what each role block became)."""
        return self._load_notes

    @model_validator(mode="after")
    def _cross_checks(self) -> "NovaRLConfig":
        gen = self.policy.generation
        section = GENERATION_ON_THE_POLICY.get(gen.backend or "")
        if section and not getattr(self.policy, section).enabled:
            raise ValueError(
                f"policy.generation.backend='{gen.backend}' needs the {gen.backend.capitalize()} training backend: "
                f"set policy.{section}.enabled=true or pick backend 'vllm' or 'hf'")
        if section and not gen.colocated.enabled:
            raise ValueError(
                f"policy.generation.backend='{gen.backend}' samples with the policy's own model on its own GPUs, "
                "so it cannot be dedicated: set policy.generation.colocated.enabled=true, or use 'vllm' "
                "for generation on GPUs of its own")
        self._critic_checks()
        self._forced_ratio_checks()
        played = [name for name, block in self.env.items() if block.plays_episodes]
        check_domains(self.data, self.reward, played)
        agents = [name for name in played if self.env[name].agent is not None]
        if agents and (len(played) > 1 or self.reward.domains):
            others = [f"env.{name}" for name in played if name != agents[0]] + [f"reward.domains.{name}"
                                                                              for name in self.reward.domains]
            raise ValueError(f"env.{agents[0]} names an agent, which plays every episode of its run: it shares a "
                             f"run with no other environment or reward domain yet ({', '.join(others)})")
        if self.loss_fn.ratio_clip_min > 1:
            raise ValueError(f"loss_fn.ratio_clip_min={self.loss_fn.ratio_clip_min} must be <= 1 "
                             "(the ratio is clipped to [1 - min, 1 + max]; 1: no lower bound, as NeMo RL's CISPO "
                             "recipe sets it)")
        return self

    def _critic_checks(self) -> None:
        """PPO's critic: wanted exactly when the estimator is GAE, on the policy's backend and
        parallel layout (it shares the policy's ranks)."""
        gae = self.grpo.adv_estimator.name == "gae"
        if gae and self.value is None:
            raise ValueError("grpo.adv_estimator.name='gae' needs a critic: add a `value` section (it starts from "
                             "the policy's settings; `value: {}` takes them all, value.model_name=... another "
                             "model), or pick grpo, rloo or reinforce_plus_plus")
        if self.value is not None and not gae:
            raise ValueError(f"value: a critic is trained only for grpo.adv_estimator.name='gae' (PPO), and the "
                             f"estimator is '{self.grpo.adv_estimator.name}': remove the value section, or set "
                             "grpo.adv_estimator.name=gae")
        if self.grpo.policy_training_start_step and not gae:
            raise ValueError(f"grpo.policy_training_start_step={self.grpo.policy_training_start_step} warms up a "
                             "critic, and there is none (grpo.adv_estimator.name is not 'gae')")
        if self.value is None:
            return
        value, policy = self.value, self.policy
        for key in ("megatron_cfg.enabled", "deepspeed_cfg.enabled", "deepspeed_cfg.zero_stage",
                    "dtensor_cfg.tensor_parallel_size", "dtensor_cfg.context_parallel_size",
                    "megatron_cfg.tensor_model_parallel_size", "megatron_cfg.pipeline_model_parallel_size",
                    "megatron_cfg.context_parallel_size", "megatron_cfg.expert_model_parallel_size",
                    "megatron_cfg.expert_tensor_parallel_size", "megatron_cfg.virtual_pipeline_model_parallel_size"):
            mine, theirs = _get(value, key), _get(policy, key)
            if mine != theirs:
                raise ValueError(f"value.{key}={mine!r} differs from policy.{key}={theirs!r}: the critic runs on "
                                 "the policy's backend and ranks, laid out like it; give the same value")
        if value.dtensor_cfg.lora_cfg.enabled:
            raise ValueError("value.dtensor_cfg.lora_cfg.enabled=true: LoRA on the critic is not built yet "
                             "(the critic trains all its weights)")


    def _forced_ratio_checks(self) -> None:
        """loss_fn.force_on_policy_ratio holds only for a batch trained once by the policy that
        generated it (NeMo RL's rules: grpo.py's and ppo.py's setup assert the batch sizes, and
        its KL-in-reward check refuses the pair below)."""
        if not self.loss_fn.force_on_policy_ratio:
            return
        grpo, policy, key = self.grpo, self.policy, "loss_fn.force_on_policy_ratio=true"
        samples = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
        shown = (f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {grpo.num_prompts_per_step} x "
                 f"{grpo.num_generations_per_prompt} = {samples}")
        if policy.train_global_batch_size not in (None, samples):
            raise ValueError(f"{key} needs one optimizer step per batch (NeMo RL's rule): "
                             f"policy.train_global_batch_size={policy.train_global_batch_size} must equal {shown}; "
                             f"set it to {samples}, or force_on_policy_ratio=false")
        if policy.train_global_batch_size is None and grpo.gradient_accumulation_steps is not None:
            raise ValueError(f"{key} needs one optimizer step per batch: with grpo.gradient_accumulation_steps="
                             f"{grpo.gradient_accumulation_steps} the samples per step depend on the data-parallel "
                             f"size; set policy.train_global_batch_size={samples} ({shown}) instead")
        if grpo.ppo_epochs > 1:
            raise ValueError(f"{key} needs one optimizer step per batch: grpo.ppo_epochs={grpo.ppo_epochs} trains "
                             "each batch again with a changed policy, whose ratio is not 1; set ppo_epochs=1, or "
                             "force_on_policy_ratio=false")
        if self.loss_fn.use_kl_in_reward and self.loss_fn.reference_policy_kl_penalty > 0:
            raise ValueError(f"{key} with loss_fn.use_kl_in_reward (reference_policy_kl_penalty="
                             f"{self.loss_fn.reference_policy_kl_penalty:g}) is refused, as NeMo RL refuses it (a "
                             "forced ratio skips the forward of the policy before the update, which the KL in the "
                             "reward reads); turn one of them off")


def _get(section: Section, dotted: str) -> Any:
    for part in dotted.split("."):
        section = getattr(section, part)
    return section
