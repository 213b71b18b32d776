"""The algorithm's sections: grpo (NeMo RL's, with its estimator, reward scaling and shaping,
dynamic sampling, PPO's epochs and critic warm-up; NeMo RL's `ppo` section is read as it), loss_fn
and value_loss_fn. Re-exported by novarl.config.schema."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from novarl.config.sections.base import Section


class AsyncGRPOConfig(Section):
    enabled: bool = False
    max_trajectory_age_steps: int = Field(1, ge=1)


class AdvEstimatorConfig(Section):
    """NeMo RL's grpo.adv_estimator (its normalize_rewards and use_leave_one_out_baseline are
    grpo.normalize_rewards and grpo.use_leave_one_out_baseline here, which NeMo RL's files
    interpolate into it)."""

    name: Literal["grpo", "reinforce_plus_plus", "rloo", "gae"] = "grpo"
    """The estimator (novarl.algorithms.advantages): grpo (group baseline, optionally leave-one-out,
    normalised by the group's std with grpo.normalize_rewards), reinforce_plus_plus (REINFORCE++:
    normalised over the whole step), rloo (leave-one-out baseline, not normalised), gae (PPO:
    generalized advantage estimation over each completion's tokens with the critic's values; needs
    the `value` section)."""
    minus_baseline: bool = True
    """reinforce_plus_plus: subtract each group's mean reward before normalising over the step."""
    gae_lambda: float = Field(0.95, ge=0, le=1)
    """gae: the advantages' (and the critic's returns') lambda."""
    gae_gamma: float = Field(1.0, ge=0, le=1)
    """gae: the discount per token."""
    normalize_advantages: bool = True
    """gae: whiten the advantages over the step's loss tokens."""
    gae_lambda_value: float | None = Field(None, ge=0, le=1)
    """gae, VAPO's decoupled GAE: the lambda of the critic's returns; None: gae_lambda."""
    gae_lambda_policy: float | None = Field(None, ge=0, le=1)
    """gae, decoupled: the lambda of the policy's advantages; None: gae_lambda."""
    length_adaptive_alpha: float = Field(0.0, ge=0)
    """gae, VAPO: the policy's lambda per completion of l tokens is 1 - 1/(alpha l) (over
    gae_lambda_policy); 0: off."""


class RewardScalingConfig(Section):
    """NeMo RL's grpo.reward_scaling: rewards clamped to [source_min, source_max], then mapped
    linearly onto [target_min, target_max], before shaping and advantages."""

    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0

    @model_validator(mode="after")
    def _a_range(self) -> "RewardScalingConfig":
        if self.enabled and not self.source_max > self.source_min:
            raise ValueError(f"grpo.reward_scaling: source_max ({self.source_max}) must be above source_min "
                             f"({self.source_min})")
        return self


class RewardShapingConfig(Section):
    """NeMo RL's grpo.reward_shaping (DAPO's overlong reward shaping): a completion longer than
    max_response_length - overlong_buffer_length tokens loses overlong_buffer_penalty x (its
    excess / overlong_buffer_length); or, with stop_properly_penalty_coef set, a completion cut
    by the length limit has its reward multiplied by that coefficient (and the overlong keys
    are not used)."""

    enabled: bool = False
    overlong_buffer_length: int | None = Field(None, ge=1)
    overlong_buffer_penalty: float | None = Field(None, ge=0)
    max_response_length: int | None = Field(None, ge=1)
    """None: policy.generation.max_new_tokens."""
    stop_properly_penalty_coef: float | None = Field(None, ge=0, le=1)

    @model_validator(mode="after")
    def _dapo_keys(self) -> "RewardShapingConfig":
        if self.enabled and self.stop_properly_penalty_coef is None:
            missing = [k for k in ("overlong_buffer_length", "overlong_buffer_penalty")
                       if getattr(self, k) is None]
            if missing:
                raise ValueError(f"grpo.reward_shaping is enabled without {' and '.join(missing)} (DAPO's "
                                 "overlong penalty needs them), and stop_properly_penalty_coef is not set")
        return self


class DifficultyMaskConfig(Section):
    """ROLL's difficulty mask: a group whose mean task reward is not strictly between the thresholds
    (too easy or too hard) gets no loss."""

    enabled: bool = False
    low_threshold: float = 0.0
    high_threshold: float = 1.0

    @model_validator(mode="after")
    def _ordered(self) -> "DifficultyMaskConfig":
        if self.low_threshold >= self.high_threshold:
            raise ValueError(f"grpo.difficulty_mask: low_threshold={self.low_threshold:g} must be below "
                             f"high_threshold={self.high_threshold:g}")
        return self


class GRPOConfig(Section):
    num_prompts_per_step: int = Field(32, ge=1)
    """Prompts drawn per step (alias: algorithm.batch_size)."""
    num_generations_per_prompt: int = Field(16, ge=1)
    """Completions sampled per prompt: the group advantages are normalised in."""
    max_rollout_turns: int = Field(1, ge=1)
    max_num_epochs: int | None = Field(None, ge=1)
    """Passes over the training prompts, at most: the run ends at max_num_steps or here,
    whichever comes first (NeMo RL's rule; its configs set 1). None: max_num_steps decides."""
    max_num_steps: int = Field(1000, ge=1)
    max_train_seconds: float | None = Field(None, gt=0)
    """Stop after this much wall time in the loop (evaluation excluded); None: no limit."""
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    """Micro-batches per optimizer step; None: derived from the batch sizes."""
    normalize_rewards: bool = True
    """Divide group-centred rewards by the group's standard deviation."""
    use_leave_one_out_baseline: bool = False
    advantage_clip_low: float | None = None
    """Advantages below it are raised to it (NeMo RL's key); None: no lower bound."""
    advantage_clip_high: float | None = None
    """Advantages above it are lowered to it; None: no upper bound."""
    reward_clip: float | None = Field(None, gt=0)
    """Rewards are clipped to [-reward_clip, reward_clip] before the advantages (ROLL's key; the
    logged rewards are the unclipped ones); None: not clipped."""
    adv_estimator: AdvEstimatorConfig = Field(default_factory=AdvEstimatorConfig)
    reward_scaling: RewardScalingConfig = Field(default_factory=RewardScalingConfig)
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    use_dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal are dropped and more prompts
    are generated until num_prompts_per_step groups with signal are gathered."""
    batch_multiplier: float = Field(1, ge=1)
    """With dynamic sampling: prompts generated per round = num_prompts_per_step x this."""
    dynamic_sampling_max_gen_batches: int = Field(10, ge=1)
    """With dynamic sampling: generation rounds allowed per step before the run stops with an error."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each generated batch (PPO's epochs), each in optimizer steps of
    policy.train_global_batch_size samples (and the critic's of value.train_global_batch_size);
    the old logprobs (and values) come from a forward before the first."""
    policy_training_start_step: int = Field(0, ge=0)
    """PPO with a critic: the first N steps train the critic alone (its warm-up; NeMo RL's key)."""
    val_period: int = Field(0, ge=0)
    """Evaluate every N steps; 0: only at start (if val_at_start) and end."""
    val_at_start: bool = True
    val_at_end: bool = True
    overlong_filtering: bool = False
    difficulty_mask: DifficultyMaskConfig = Field(default_factory=DifficultyMaskConfig)
    difficulty_loss_weight: bool = False
    """ROLL's: each sample's policy loss weighted by 0.5 + 1.5 x its example's `difficulty` column
    (clamped to [0, 1]), the weights scaled to mean 1 over the step (ROLL scales per micro-batch):
    the advantages are scaled, so a KL penalty in the loss is not weighted (one in the reward is)."""
    val_start_at: int | None = -1
    """The first step a periodic evaluation (val_period) may run at (NeMo RL's key); -1 (or null), or
    any step up to val_period: no delay."""
    val_num_generations_per_prompt: int = Field(1, ge=1)
    """Completions per evaluation prompt (NeMo RL's key). 1: one greedy completion each. k > 1: k
    sampled ones, at policy.generation.val_temperature / val_top_p / val_top_k (unset: the training
    sampling's); `accuracy` is then over all of them and `pass_k` is the share of prompts with at
    least one correct (reward >= 1)."""
    stop_at_validation_metric: str | None = None
    """End the run once this evaluation metric (accuracy, reward, pass_k, or a reward function's
    own) reaches stop_at_validation_threshold: after that step's checkpoint, or before the first
    step for the evaluation at start (NeMo RL's key); None: never."""
    stop_at_validation_threshold: float | None = None
    """The value stop_at_validation_metric stops at (>=)."""
    max_val_samples: int | None = Field(256, ge=1)
    """At most this many evaluation prompts (each val_num_generations_per_prompt times); None: all
    of the held-out split (NeMo RL's null)."""
    val_batch_size: int = Field(256, ge=1)
    invalid_tool_call_advantage: float | None = None
    """NeMo RL's key: the advantage of every token of a turn whose tool call could not be run (malformed,
    or of a tool that does not exist: novarl's ToolEnvironment says so, or any environment through
    EnvStep.flags), instead of the estimator's (e.g. -5.0); None: the estimator's."""
    malformed_thinking_advantage: float | None = None
    """NeMo RL's key: the advantage of every token of a turn whose <think> tags are out of order (either
    twice, or closed before opened: rollout/episodes.py malformed_thinking), instead of the estimator's;
    None: the estimator's."""
    seq_logprob_error_threshold: float | None = Field(None, ge=1)
    """NeMo RL's key: sequences whose mean over their loss tokens of exp(|log p_generator - log p_old|)
    (the trainer's logprobs before the update against the engine's) exceeds it get no loss this step;
    the policy's forward before training runs for it. None: no such masking."""
    seed: int = 42
    async_grpo: AsyncGRPOConfig = Field(default_factory=AsyncGRPOConfig)

    @model_validator(mode="after")
    def _early_stop(self) -> "GRPOConfig":
        """NeMo RL's rules for the early stop, and two of novarl's: a threshold is not given alone,
        and a metric that no evaluation before the end reads is refused."""
        metric, threshold = self.stop_at_validation_metric, self.stop_at_validation_threshold
        if metric is None:
            if threshold is not None:
                raise ValueError(f"grpo.stop_at_validation_threshold={threshold:g} is set without "
                                 "grpo.stop_at_validation_metric (the evaluation metric it applies to, e.g. accuracy)")
            return self
        if threshold is None:
            raise ValueError(f"grpo.stop_at_validation_metric={metric!r} needs grpo.stop_at_validation_threshold "
                             "(the value it stops at)")
        if metric == "pass_k" and self.val_num_generations_per_prompt <= 1:
            raise ValueError("grpo.stop_at_validation_metric='pass_k' needs grpo.val_num_generations_per_prompt > 1 "
                             "(pass@k is over each prompt's k completions)")
        if not self.val_period and not self.val_at_start:
            raise ValueError(f"grpo.stop_at_validation_metric={metric!r}: the run evaluates at its end only "
                             "(grpo.val_period=0, val_at_start=false), so nothing could stop it early; set "
                             "grpo.val_period")
        return self


class ValueLossConfig(Section):
    """NeMo RL's value_loss_fn: the critic's clipped value loss (algorithms/losses.py value_loss)."""

    scale: float = Field(1.0, gt=0)
    """The value loss's weight."""
    cliprange: float | None = Field(0.2, gt=0)
    """Values move at most this far from the batch's values before the update; None: no clip."""


class LossConfig(Section):
    loss: str = "clipped_pg"
    """Policy loss in the registry (novarl.algorithms.losses)."""
    reference_policy_kl_penalty: float = Field(0.0, ge=0)
    """KL coefficient to the frozen reference; 0 loads no reference."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Alias: NeMo RL's reference_policy_kl_type."""
    kl_input_clamp_value: float | None = Field(None, gt=0)
    """The log-ratio log q - log p is clamped to [-v, v] before the KL estimator; None: not clamped."""
    kl_output_clamp_value: float | None = Field(None, gt=0)
    """The per-token KL estimate is clamped to [-v, v]; None: not clamped."""
    ratio_clip_min: float = Field(0.2, ge=0)
    ratio_clip_max: float = Field(0.2, ge=0)
    ratio_clip_c: float | None = Field(None, gt=1)
    """Dual-clip constant (> 1) for negative advantages; None: off."""
    use_on_policy_kl_approximation: bool = False
    disable_ppo_ratio: bool = False
    """REINFORCE's surrogate, -A log p per token: no ratio, no clipping (NeMo RL's key)."""
    use_cispo: bool = False
    """CISPO (MiniMax-M1; NeMo RL's key): each token's loss is -sg(clip(r, 1 - ratio_clip_min,
    1 + ratio_clip_max)) A log p: the clipped ratio, detached, weighs the REINFORCE gradient, so a
    token whose ratio is clipped keeps its gradient (PPO's clip drops it). Not with
    disable_ppo_ratio, force_on_policy_ratio, sequence_level_importance_ratios or ratio_clip_c
    (NeMo RL's rules)."""
    positive_example_nll_weight: float = Field(0.0, ge=0)
    """VAPO's mu (NeMo RL's key): the loss adds mu x the mean negative log-likelihood of the tokens
    of the step's correct samples (reward > 0, after grpo.reward_scaling and reward_shaping, as NeMo
    RL's PPO marks them; its GRPO loop never does, so there the key has no effect); 0: off."""
    force_on_policy_ratio: bool = False
    """NeMo RL's key: the ratio pi / pi_old is 1 (exp(log p - log p detached): the gradient of
    log p), never clipped, and pi_old in the importance weights is the training forward's own: the
    update of a batch trained once, by the policy that generated it. It needs one optimizer step
    per batch: policy.train_global_batch_size = grpo.num_prompts_per_step x
    num_generations_per_prompt, grpo.ppo_epochs 1 (checked with the whole config)."""
    use_kl_in_reward: bool = False
    """REINFORCE++ (grpo.adv_estimator.name: reinforce_plus_plus): reference_policy_kl_penalty x each
    token's KL (the policy before the update against the reference) is subtracted from its
    advantage before the step's normalisation, instead of being a term of the loss."""
    use_importance_sampling_correction: bool = False
    """Weigh each token's loss by pi_old / pi_generator (the generator's weights may lag the
    policy's: asynchronous GRPO, or a mismatch between the engines and the trainer); with
    sequence_level_importance_ratios, by the sequence's product of those ratios (NeMo RL's)."""
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = None
    """With use_importance_sampling_correction: tis clamps the weights to [ratio_min (0 by default),
    ratio]; icepop zeroes the tokens whose weight is outside [ratio_min, ratio]; seq-mask-tis
    zeroes the sequences whose geometric-mean ratio is outside it (the kept ones keep their
    token weights untruncated). None: the weights as they are."""
    truncated_importance_sampling_ratio: float | None = Field(None, gt=0)
    """The upper bound of truncated importance sampling."""
    truncated_importance_sampling_ratio_min: float | None = Field(None, ge=0)
    """Its lower bound (tis: 0 when None; icepop and seq-mask-tis need it)."""
    sequence_level_importance_ratios: bool = False
    token_level_loss: bool = True
    """True: average over all tokens of the step; False: per sequence, then over sequences."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                           "seq-mean-token-sum-norm"] | None = None
    """How token losses become the step's loss (verl's and ROLL's key): token-mean (all tokens of
    the step), seq-mean-token-mean (each sequence's mean, then over sequences), seq-mean-token-sum
    (each sequence's sum, then over sequences), seq-mean-token-sum-norm (Dr. GRPO: each sequence's
    sum divided by policy.generation.max_new_tokens, then over sequences: no length bias). None:
    token_level_loss decides (token-mean or seq-mean-token-mean)."""

    @model_validator(mode="after")
    def _sequence_ratios(self) -> "LossConfig":
        """NeMo RL's rule: GSPO's sequence-level ratios go with a per-sequence loss."""
        token_mean = self.loss_agg_mode == "token-mean" or self.loss_agg_mode is None and self.token_level_loss
        if self.sequence_level_importance_ratios and token_mean:
            raise ValueError("loss_fn.sequence_level_importance_ratios (GSPO) weighs whole sequences: it goes with a "
                             "per-sequence loss (NeMo RL's rule); set loss_fn.token_level_loss=false (or a "
                             "loss_fn.loss_agg_mode of seq-mean-...)")
        return self

    @model_validator(mode="after")
    def _cispo(self) -> "LossConfig":
        """NeMo RL's rules: CISPO weighs by the token's own clipped ratio pi / pi_old (unlike NeMo RL,
        any loss_agg_mode: its token-level requirement is a choice of aggregation, not of the maths)."""
        if not self.use_cispo:
            return self
        clashes = {"disable_ppo_ratio": "removes the ratio CISPO clips",
                   "force_on_policy_ratio": "forces the ratio CISPO clips to 1",
                   "sequence_level_importance_ratios": "CISPO's ratios are per token",
                   "ratio_clip_c": "dual clipping is PPO's, of the clipped objective CISPO replaces"}
        for key, why in clashes.items():
            if getattr(self, key) not in (False, None):
                raise ValueError(f"loss_fn.use_cispo does not go with loss_fn.{key}={getattr(self, key)!r} ({why}; "
                                 "NeMo RL refuses the pair too)")
        return self

    @model_validator(mode="after")
    def _truncation(self) -> "LossConfig":
        kind, high, low = (self.truncated_importance_sampling_type, self.truncated_importance_sampling_ratio,
                           self.truncated_importance_sampling_ratio_min)
        if kind is None:
            if high is not None or low is not None:
                raise ValueError("loss_fn.truncated_importance_sampling_ratio(_min) is set without "
                                 "loss_fn.truncated_importance_sampling_type (tis, icepop or seq-mask-tis)")
            return self
        if not self.use_importance_sampling_correction:
            raise ValueError(f"loss_fn.truncated_importance_sampling_type={kind!r} truncates the importance "
                             "weights of loss_fn.use_importance_sampling_correction, which is false")
        if high is None:
            raise ValueError(f"loss_fn.truncated_importance_sampling_type={kind!r} needs "
                             "loss_fn.truncated_importance_sampling_ratio (its upper bound)")
        if low is None and kind != "tis":
            raise ValueError(f"loss_fn.truncated_importance_sampling_type={kind!r} needs "
                             "loss_fn.truncated_importance_sampling_ratio_min (its lower bound)")
        if low is not None and low > high:
            raise ValueError(f"loss_fn.truncated_importance_sampling_ratio_min={low} is above "
                             f"truncated_importance_sampling_ratio={high}")
        if kind == "seq-mask-tis" and self.sequence_level_importance_ratios:
            raise ValueError("loss_fn.truncated_importance_sampling_type='seq-mask-tis' masks sequences over "
                             "token-level weights; it does not go with sequence_level_importance_ratios")
        return self
