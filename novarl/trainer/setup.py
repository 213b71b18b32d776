"""Building the roles a GRPO run needs from a validated config.

Everything that can fail on bad input (backends, data, reward function, model
path) is checked by `preflight`, before any worker starts or output folder is
written; `novarl validate` runs the same function.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from novarl.backends.protocols import (Engine, GenerationBackend, Offloadable, Parkable, QueuedWeights,
                                       ReferenceBackend, Stoppable, TrainingBackend)
from novarl.config.files import show_value
from novarl.config.schema import NovaRLConfig, ValueConfig
from novarl.data.arithmetic import Example
from novarl.data.datasets import PromptSampler, load_examples, read_prompt_template, to_prompts
from novarl.distributed.parking import GROUPS, parks_on_cpu
from novarl.errors import NotAvailableYet, UserError
from novarl.logging.console import info
from novarl.models.loading import check_model_folder, load_tokenizer, resolve_model_path
from novarl.models.config_overrides import read_config, with_overrides
from novarl.models.locate import download_snapshot
from novarl.models.scores import training_precision
from novarl.backends.generation.layout import generation_layout
from novarl.backends.contract.checks import ConfigReport, check_config, one_error
from novarl.backends.contract.resolve import BackendChoice, BatchPlan, world_size
from novarl.backends.registry import generation_spec, training_spec
from novarl.rewards.domains import DomainSampler, DomainScorer, run_sampler, run_scorer
from novarl.rewards.scorer import RewardScorer
from novarl.rollout.environment import MakesExamples, environment_examples, episode_environment
from novarl.rollout.episodes import PlaysEpisodes
from novarl.rollout.playing import (MADE_EXAMPLES, describe_episodes, lockstep_warning, made_examples, run_environment,
                                    run_episodes, with_tools)
from novarl.types import Completion, Prompt


@dataclass
class RunInputs:
    """What is read and checked before anything heavy starts."""

    choice: BackendChoice
    batches: BatchPlan
    model_path: str
    tokenizer: object
    scorer: RewardScorer | DomainScorer
    sampler: PromptSampler | DomainSampler
    val_prompts: list[Prompt]
    val_source: str = "held-out"
    """Where val_prompts come from: "held-out" (a split that is not trained on) or "training-set"
    (the first grpo.max_val_samples training prompts, when no held-out split was given)."""
    summary: str = ""
    """One line: the model, how many train and evaluation prompts, the reward."""
    notes: tuple[str, ...] = ()
    """What the user should know (a backend ignored by precedence, prompts dropped as too long)."""
    warnings: tuple[str, ...] = ()
    """What is not as asked (a setting not available yet, evaluation on training prompts)."""
    max_steps: int = 0
    """Steps the run takes: grpo.max_num_steps, or fewer when grpo.max_num_epochs passes over the
    training prompts end sooner (0: grpo.max_num_steps)."""
    critic_model_path: str | None = None
    """PPO's critic: the folder its model starts from (value.model_name)."""
    episodes: PlaysEpisodes | None = None
    """How the episodes are played (env.<name>.actor_class_fqn's environment, its rewards the
    training rewards); None: one completion per prompt, scored by reward.function."""

    def report(self) -> list[str]:
        """The lines a run logs at start: backends, notes, warnings, batch arithmetic, data."""
        return [self.choice.describe(), *(f"note: {n}" for n in self.notes),
                *(f"warning: {w}" for w in self.warnings), self.batches.describe(), self.summary]


def preflight(cfg: NovaRLConfig, reward_fn: str | Callable[..., float] | None = None,
              train_examples: list[Example] | None = None) -> RunInputs:
    """Every check `novarl train` makes before it starts a worker or writes a folder:
    the config's own (backends/contract/checks.py: backends and their availability, batch arithmetic,
    output folders), then those that read the model's files (`inspect_inputs`). Loads no
    weights. Keeps going after a problem and raises one UserError naming every one.

    train_examples: in-memory examples used for training and (the first
    grpo.max_val_samples) for evaluation, instead of the configured data.
    """
    report = check_config(cfg)
    model_path = report.model_path
    if model_path is None and not report.problems and not report.gpu_only:
        model_path = report.attempt(resolve_model_path, cfg.policy.model_name)  # a hub id: downloads
        if model_path and report.choice is not None and training_spec(report.choice.training).reads_model_files \
                and not Path(model_path).is_dir():  # the ranks read (convert) the files: fetch them here, first
            model_path = report.attempt(download_snapshot, model_path)
    if model_path and cfg.policy.hf_config_overrides:  # every role and engine reads this folder's config
        model_path = report.attempt(with_overrides, model_path, cfg.policy.hf_config_overrides)
    inputs = inspect_inputs(cfg, report, model_path, reward_fn, train_examples) if model_path else None
    error = one_error([*report.problems, *(NotAvailableYet(f"this host lacks {g}") for g in report.gpu_only)])
    if error is not None:
        raise error
    if inputs is None:  # every check passed, so this is novarl's fault, not the config's
        raise RuntimeError("preflight found no problem and yet no run inputs")
    return inputs


def inspect_inputs(cfg: NovaRLConfig, report: ConfigReport, model_path: str,
                   reward_fn: str | Callable[..., float] | None = None,
                   train_examples: list[Example] | None = None) -> RunInputs | None:
    """The checks that read the model's files: the folder (config.json, weights' shapes), the
    sequence length against its positions, Megatron's model constraints, the tokenizer and
    stop ids, the data (every row), and the reward (imported, then called once on a training
    example). Problems go to report.problems; the RunInputs when there was none."""
    notes, warnings = list(report.notes), list(report.warnings)
    attempt = report.attempt
    before = len(report.problems)
    attempt(check_model_folder, model_path, trust_remote_code=cfg.policy.trust_remote_code,
            key=f"policy.hf_config_overrides={cfg.policy.hf_config_overrides} applied to policy.model_name"
            if cfg.policy.hf_config_overrides else "policy.model_name")
    folder_ok = len(report.problems) == before
    if report.choice is not None:
        attempt(check_sequence_length, cfg, model_path, report.choice, warnings)
        if folder_ok:  # where this host cannot run the backend, what config.json alone decides
            attempt(training_spec(report.choice.training).check_model, cfg, model_path,
                    shape_only=bool(report.gpu_only))
    tokenizer = None  # from a folder the check refused, it would fail again for the same reason
    if folder_ok or cfg.policy.tokenizer.name:
        tokenizer = attempt(load_tokenizer, cfg.policy.tokenizer.name or model_path,
                            trust_remote_code=cfg.policy.trust_remote_code)
    if tokenizer is not None:
        attempt(check_stop_token_ids, cfg, tokenizer)
    critic_path = model_path
    if cfg.value is not None and tokenizer is not None:
        critic_path = attempt(critic_model_path, cfg, model_path, tokenizer)
    scorer = attempt(run_scorer, cfg, reward_fn)
    played = episode_environment(cfg)
    environment = attempt(run_environment, cfg, scorer) if played else None
    made_train, made_val = made_examples(cfg, played, environment, attempt, notes) \
        if played and train_examples is None else (None, None)
    tools = getattr(environment, "tool_schemas", None)  # rollout/tools.py: the chat template lists them
    train = attempt(split_prompts, cfg, tokenizer, "train", made_train or train_examples, notes=notes,
                    tools=tools) if tokenizer is not None else None
    if scorer is not None and train and not played:
        where = f"reward.function={show_value(cfg.reward.function)}" if reward_fn is None else \
            f"the reward function given to the trainer ({scorer.name})"
        attempt(check_reward, scorer, train[0], where=where)
    gap = None if made_val else held_out_gap(cfg, train_examples)
    val = None
    if gap is None and tokenizer is not None:
        val = attempt(split_prompts, cfg, tokenizer, "validation", made_val, notes=notes, tools=tools)
    sampler = attempt(run_sampler, cfg, train, notes) if train else None
    if report.problems or report.gpu_only or report.choice is None or report.batches is None or not train \
            or sampler is None or scorer is None or (gap is None and val is None) or (played and environment is None):
        return None
    episodes = run_episodes(cfg, played, environment, tokenizer)
    warnings.extend(lockstep_warning(cfg, episodes, report.choice))
    if gap is None and val is not None:
        val = val[:cfg.grpo.max_val_samples]
        prompts = f"{len(train)} train / {len(val)} held-out prompts"
    else:
        val = train[:cfg.grpo.max_val_samples]
        prompts = f"{len(train)} train prompts, {len(val)} evaluation prompts taken from the training set ({gap})"
        warnings.append(f"the evaluation accuracy is measured on training prompts, not held-out ones ({gap}); "
                        + ("set data.val_data_path to a held-out file" if train_examples is None else
                           "evaluate held-out examples separately (`novarl eval` with data.val_data_path)"))
    reward = describe_episodes(cfg, scorer) if played else f"reward: {scorer.name}"
    overridden = f", its config.json with policy.hf_config_overrides {', '.join(cfg.policy.hf_config_overrides)}" \
        if cfg.policy.hf_config_overrides else ""
    summary = f"model: {cfg.policy.model_name} ({model_path}{overridden}); {prompts}; {reward}"
    max_steps = steps_in_epochs(cfg, len(train), notes)
    return RunInputs(report.choice, report.batches, model_path, tokenizer, scorer, sampler, val,
                     val_source="held-out" if gap is None else "training-set", summary=summary,
                     notes=tuple(notes), warnings=tuple(warnings), max_steps=max_steps, critic_model_path=critic_path,
                     episodes=episodes)


def critic_model_path(cfg: NovaRLConfig, policy_path: str, tokenizer) -> str:
    """The folder of PPO's critic (value.model_name, with value.hf_config_overrides; the policy's own
    when the same). A critic of another model must read the policy's token ids: its tokenizer must
    have the same vocabulary."""
    value = value_section(cfg)
    if value.model_name == cfg.policy.model_name and value.tokenizer.name == cfg.policy.tokenizer.name \
            and value.hf_config_overrides == cfg.policy.hf_config_overrides:
        return policy_path
    path = resolve_model_path(value.model_name)
    if value.hf_config_overrides:
        path = with_overrides(path, value.hf_config_overrides, key="value.hf_config_overrides")
    check_model_folder(path, trust_remote_code=value.trust_remote_code, key="value.model_name")
    theirs = load_tokenizer(value.tokenizer.name or path, trust_remote_code=value.trust_remote_code)
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"value.model_name={show_value(value.model_name)}: its tokenizer "
                        f"({value.tokenizer.name or path}, {len(theirs.get_vocab())} tokens) differs from the "
                        f"policy's ({len(tokenizer.get_vocab())} tokens); the critic reads the policy's token ids, "
                        "so it needs the same tokenizer (a model of the policy's family, or value.tokenizer.name "
                        "set to the policy's).")
    return path


def steps_in_epochs(cfg: NovaRLConfig, num_prompts: int, notes: list[str]) -> int:
    """The steps a run takes: grpo.max_num_steps, or the steps of grpo.max_num_epochs passes over
    the `num_prompts` training prompts when that is fewer (NeMo RL's rule: whichever ends first).
    A pass is the whole batches of num_prompts_per_step it holds (the sampler reshuffles for the
    next pass and leaves the remainder out)."""
    grpo = cfg.grpo
    if grpo.max_num_epochs is None:
        return grpo.max_num_steps
    per_epoch = max(num_prompts // grpo.num_prompts_per_step, 1)
    steps = min(grpo.max_num_steps, grpo.max_num_epochs * per_epoch)
    if steps < grpo.max_num_steps:
        notes.append(f"the run takes {steps} steps, not grpo.max_num_steps={grpo.max_num_steps}: grpo.max_num_epochs="
                     f"{grpo.max_num_epochs} pass(es) over {num_prompts} training prompts of {per_epoch} step(s) "
                     f"each ({grpo.num_prompts_per_step} prompts a step); raise grpo.max_num_epochs to train longer")
    return steps


def prepare_inputs(cfg: NovaRLConfig, reward_fn: str | Callable[..., float] | None = None,
                   train_examples: list[Example] | None = None) -> RunInputs:
    """`preflight`, then what it found in the log: the trainer's first step."""
    inputs = preflight(cfg, reward_fn, train_examples)
    for line in inputs.report():
        info(line)
    return inputs


def held_out_gap(cfg: NovaRLConfig, train_examples: list[Example] | None = None) -> str | None:
    """None when the configured data has a held-out split to evaluate on; otherwise why
    not (the evaluation prompts are then training prompts)."""
    from novarl.data.named import split_specs
    from novarl.data.sources import locate

    if train_examples is not None:
        return "train_examples were given in memory, with no held-out split"
    val = split_specs(cfg.data, "validation")
    if not val or not val[0].from_training:
        return None  # a bundled task, sources of its own, or held-out fractions
    try:
        same = all(locate(v.text, v.where, split=v.split, subset=subset, fallback_splits=v.fallback_splits)
                   == locate(t.text, t.where, split=t.split, subset=subset, fallback_splits=t.fallback_splits)
                   for v, t in zip(val, split_specs(cfg.data, "train")) for subset in t.subsets)
    except UserError:
        return None  # reading the split reports it
    if not same:
        return None
    return "data.val_data_path is not set" + ("" if all(Path(t.text).is_file() for t in val) else
                                              ", and the training data has no validation or test split")


def check_reward(scorer: RewardScorer | DomainScorer, prompt: Prompt, *, where: str) -> None:
    """Call the reward once, on a training prompt completed with its own answer, so a function
    that raises or returns a non-number stops the run before anything starts. Not a reward that
    loads a model (a reward model, an LLM judge): the checks load no weights; its first step calls it."""
    if scorer.loads_models:
        return
    sample = Completion(prompt=prompt, token_ids=[], logprobs=[], text=prompt.answer or "",
                        finish_reason="stop", policy_version=0)
    try:
        scorer.score([sample])
    except UserError as err:
        raise UserError(f"{where}: a trial call on a training example (completed with its own answer) "
                        f"failed before the run started. {err} A reward function must return a finite "
                        "number for any completion.") from None
    scorer.take_metrics()  # the trial's: not the first step's


def check_stop_token_ids(cfg: NovaRLConfig, tokenizer) -> None:
    """policy.generation.stop_token_ids are ids of the tokenizer (0 <= id < its size): a larger
    id is a typo or another model's id, and the stop it asks for would never happen."""
    ids = cfg.policy.generation.stop_token_ids or []
    size = len(tokenizer)
    outside = [i for i in ids if not 0 <= i < size]
    if outside:
        raise UserError(f"policy.generation.stop_token_ids={ids[:10]}{'...' if len(ids) > 10 else ''}: {outside[0]} "
                        f"is not a token id of the tokenizer, which has {size} tokens (ids 0 to {size - 1}).")


def check_sequence_length(cfg: NovaRLConfig, model_path: str, choice: BackendChoice, warnings: list[str]) -> None:
    """policy.max_seq_length against the model's max_position_embeddings (read from a local
    config.json, with policy.hf_config_overrides): vLLM refuses a longer engine, so that is refused
    here; other backends run past it with degraded positions, so that is a warning."""
    import os

    try:
        limit = read_config(model_path, cfg.policy.hf_config_overrides).get("max_position_embeddings")
    except (OSError, ValueError):
        return  # a hub id, or a config.json that the loader reports on
    if not isinstance(limit, int):
        return
    source = "policy.hf_config_overrides" if "max_position_embeddings" in cfg.policy.hf_config_overrides \
        else f"{model_path}/config.json"
    where = f"longer than the model's max_position_embeddings={limit} ({source})"
    engine_length = cfg.policy.generation.vllm_cfg.max_model_len  # vLLM's own length, when set
    key, length = (("policy.generation.vllm_cfg.max_model_len", engine_length) if engine_length is not None
                   else ("policy.max_seq_length", cfg.policy.max_seq_length))
    if generation_spec(choice.generation).refuses_long_sequences and length > limit \
            and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1":
        raise UserError(f"{key}={length} is {where}: vLLM refuses such an engine. Set {key} to at most {limit} "
                        "(or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, for a model whose positions extrapolate).")
    if cfg.policy.max_seq_length > limit:
        warnings.append(f"policy.max_seq_length={cfg.policy.max_seq_length} is {where}: positions past {limit} "
                        "were never trained")


def split_prompts(cfg: NovaRLConfig, tokenizer, split: str, examples: list[Example] | None = None, *,
                  notes: list[str] | None = None, tools: list[dict] | None = None) -> list[Prompt]:
    """Tokenised prompts of a split that fit the sequence budget (at least one). How many
    were dropped as too long goes to `notes` (to the log when notes is None). tools: the
    function schemas the chat template renders into chat-message prompts (its `tools`)."""
    template, system = read_prompt_template(cfg.data)
    examples = examples if examples is not None else load_examples(cfg.data, split, seed=cfg.grpo.seed)
    max_prompt = min(cfg.data.max_input_seq_length or cfg.policy.max_seq_length,
                     cfg.policy.max_seq_length - 1)
    prompts = to_prompts(examples, tokenizer, template=template, system_prompt=system,
                         max_prompt_tokens=max_prompt, chat_template=cfg.policy.tokenizer.chat_template,
                         chat_template_kwargs=with_tools(cfg.policy.tokenizer.chat_template_kwargs, tools))
    if not prompts:
        raise UserError(f"No {split} prompt fits in {max_prompt} tokens (policy.max_seq_length="
                        f"{cfg.policy.max_seq_length}); raise it or shorten the prompts.")
    if len(prompts) < len(examples):
        dropped = f"{len(examples) - len(prompts)} {split} prompts longer than {max_prompt} tokens were dropped"
        if notes is None:
            info(dropped)
        else:
            notes.append(dropped)
    return prompts


def generation_precision(cfg: NovaRLConfig, device: torch.device) -> str:
    """The engines' dtype, which the weight sync sends: vllm_cfg.precision, else the policy's.
    FP8 (vllm_cfg.precision 'fp8') is vLLM's quantization of weights sent in the policy's dtype
    (backends/generation/vllm.py: fp8_engine_args)."""
    own = cfg.policy.generation.vllm_cfg.precision
    return (own if own != "fp8" else None) or training_precision(cfg.policy.precision, on_gpu=device.type == "cuda")


@dataclass
class EvalInputs:
    generator: GenerationBackend
    """One Hugging Face engine in this process, holding the model under evaluation."""
    prompts: list[Prompt]
    scorer: RewardScorer | DomainScorer
    val_source: str
    """"held-out", or "training-set" when the data has no held-out split (see RunInputs.val_source)."""
    episodes: PlaysEpisodes | None = None
    """With an environment (env.<name>.actor_class_fqn): its episodes (played as the evaluation samples),
    rewarded by it."""


def prepare_eval(cfg: NovaRLConfig, model: str, device: torch.device) -> EvalInputs:
    """The generator, evaluation prompts and scorer to evaluate the model `model`; the
    reward and data are checked before the weights load."""
    from novarl.backends.generation.hf import HFGeneration
    from novarl.backends.generation.engines import LocalGeneration

    model_path = resolve_model_path(model)
    if cfg.policy.hf_config_overrides:  # the config's model as its runs read it (a run's policy/ has them already)
        model_path = with_overrides(model_path, cfg.policy.hf_config_overrides)
    tokenizer = load_tokenizer(model_path, trust_remote_code=cfg.policy.trust_remote_code)
    scorer = run_scorer(cfg)
    played = episode_environment(cfg)
    environment = run_environment(cfg, scorer) if played else None
    made = environment_examples(played[0], environment, "validation", cfg.grpo.max_val_samples or MADE_EXAMPLES,
                                cfg.grpo.seed) if played and isinstance(environment, MakesExamples) else None
    gap = None if made else held_out_gap(cfg)
    prompts = split_prompts(cfg, tokenizer, "train" if gap else "validation", made,
                            tools=getattr(environment, "tool_schemas", None))[:cfg.grpo.max_val_samples]
    if not played:
        check_reward(scorer, prompts[0], where=f"reward.function={show_value(cfg.reward.function)}")
    if gap:
        info(f"warning: evaluating on {len(prompts)} training prompts, not held-out ones ({gap})")
    engine = HFGeneration(model_path, tokenizer, device, precision=generation_precision(cfg, device),
                          max_seq_length=cfg.policy.max_seq_length, trust_remote_code=cfg.policy.trust_remote_code)
    return EvalInputs(LocalGeneration(engine), prompts, scorer, "held-out" if gap is None else "training-set",
                      run_episodes(cfg, played, environment, tokenizer))


@dataclass
class Roles:
    policy: TrainingBackend
    reference: ReferenceBackend | None
    """None when the KL penalty is 0."""
    generator: GenerationBackend
    critic: TrainingBackend | None = None
    """PPO's value model (grpo.adv_estimator.name: gae): its head is Values() (models/scores.py)."""
    parks: bool = False
    """Engines of their own generate on the training GPUs: the training roles wait in host memory meanwhile
    (park_training)."""

    def park_training(self) -> None:
        """Where the roles park: their optimizer states and weights to host memory until they next need them
        (distributed/parking.py), e.g. after a checkpoint woke them."""
        if self.parks:
            for group in GROUPS:
                park_roles(group, self.policy, self.reference, self.critic)

    def release_generator(self) -> None:
        """Free colocated engines' accelerator memory for training (vLLM sleep on GPU); they
        wake when they next take weights or generate."""
        if isinstance(self.generator, Offloadable):
            self.generator.offload()

    def sync_weights(self, version: int) -> dict[str, float]:
        """The policy's current weights into every engine (see backends/generation/engines.py);
        metrics: weight_sync_mb, the MB each engine took (none when the generator samples
        with the policy's own model). Where the roles park, the optimizer states go to host memory before (the
        engines' weights wake into their room) and the weights after (metric offloaded_gb)."""
        return self._parked_around(lambda: self.generator.sync_weights(version))

    def queue_weights(self, version: int) -> dict[str, float]:
        """Asynchronous GRPO's weight update: the policy's weights go to the engines behind the
        rounds submitted to them, the trainer not waiting for those (backends/generation/engines.py)."""
        if not isinstance(self.generator, QueuedWeights):
            raise NotAvailableYet(f"asynchronous GRPO on {type(self.generator).__name__}: its engines do not "
                                  "queue weights")
        generator = self.generator
        return self._parked_around(lambda: generator.queue_weights(version))

    def _parked_around(self, send: Callable[[], dict[str, float]]) -> dict[str, float]:
        """`send`'s metrics (a weight update's), where the roles park with the optimizer states parked before
        it and the weights after (offloaded_gb: both, on the policy's first rank)."""
        if not self.parks:
            return send()
        freed = park_roles("optimizer", self.policy, self.reference, self.critic)
        metrics = send()
        freed += park_roles("weights", self.policy, self.reference, self.critic)
        return {**metrics, "offloaded_gb": freed / 1e9}

    def shutdown(self) -> None:
        """Stop remote workers (in-process roles need nothing); safe to call twice."""
        stop(self.generator, self.critic, self.reference, self.policy)


def park_roles(group: str, *roles: object) -> int:
    """Park `group` of each role that parks (Parkable); the bytes freed on the first rank."""
    return sum(role.park(group, parks_on_cpu()) for role in roles if isinstance(role, Parkable))


def parks_beside_engines(cfg: NovaRLConfig, inputs: RunInputs, device: torch.device) -> bool:
    """Whether the training roles wait in host memory while the engines generate: engines of their own (vLLM's,
    or Hugging Face's copy) on the policy's GPUs. (Megatron generation runs on the training weights themselves;
    dedicated engines have GPUs of their own; a CPU host has no device memory to free, and parks only for tests:
    parking.PARK_ON_CPU_VARIABLE.)"""
    return ((device.type == "cuda" or parks_on_cpu()) and generation_spec(inputs.choice.generation).engine_class
            is not None and generation_layout(cfg, inputs.choice.generation).colocated)


def stop(*roles: object) -> None:
    """Stop the roles with workers of their own, in the order given."""
    for role in roles:
        if isinstance(role, Stoppable):
            role.shutdown()


def build_generator(cfg: NovaRLConfig, inputs: RunInputs, device: torch.device, policy) -> GenerationBackend:
    """The generation engines the config resolved to (see backends/generation/layout.py): one in this
    process beside a one-rank policy, one in each policy rank's process when colocated, actors
    of their own when dedicated; Megatron generation runs on the policy's own ranks."""
    from novarl.backends.remote import RemotePolicy
    from novarl.models.loading import DTYPES

    gen = cfg.policy.generation
    layout = generation_layout(cfg, inputs.choice.generation)
    spec = generation_spec(inputs.choice.generation)
    if spec.engine_class is None:  # it samples with the policy's own model on its ranks
        return spec.implementation()(policy, inputs.tokenizer, max_seq_length=cfg.policy.max_seq_length,
                                     **spec.on_policy_ranks_arguments(cfg))
    precision = generation_precision(cfg, device)
    factory: type[Engine] = spec.implementation()
    kwargs = factory.engine_kwargs(cfg, model_path=inputs.model_path, tokenizer=inputs.tokenizer, precision=precision)
    sync: dict[str, Any] = dict(bucket_bytes=int(gen.weight_sync_bucket_mb * 2**20), dtype=DTYPES[precision])
    if isinstance(policy, RemotePolicy):
        layout = dataclasses.replace(layout, local_policy=False)
    if layout.in_process:
        from novarl.backends.generation.engines import LocalGeneration

        engine = factory(**{**kwargs, **({"device": device} if "device" in kwargs else {})})
        return LocalGeneration(engine, policy, layout, **sync)
    from novarl.distributed.ray_group import RayWorkerGroup

    if layout.colocated:
        from novarl.backends.generation.engines import ColocatedEngines

        return ColocatedEngines(policy.group, factory, kwargs, layout, **sync)
    from novarl.backends.generation.engines import DedicatedEngines

    gpus = layout.devices_per_engine if device.type == "cuda" else 0
    group = RayWorkerGroup(factory, kwargs, world_size=layout.engines, gpus_per_rank=gpus,
                           name="generation engine", process_group=False)
    try:
        return DedicatedEngines(group, policy.group, layout, **sync)
    except BaseException:
        group.shutdown()
        raise


def build_roles(cfg: NovaRLConfig, inputs: RunInputs, device: torch.device) -> Roles:
    """The policy (and reference) on one in-process rank or on Ray ranks, and the generation
    engines. If one role fails to start, the ones already started are shut down."""
    check_capacity(cfg, inputs, device)
    policy, reference, critic = build_trainers(cfg, inputs, device)  # stops its Ray ranks if one fails
    parks = parks_beside_engines(cfg, inputs, device)
    try:
        if parks:  # before the engines start: vLLM claims its share of the GPU's memory then
            freed = park_roles("weights", policy, reference, critic)
            info(f"colocated generation: the training roles' optimizer states and weights wait in host memory "
                 f"while the engines generate ({freed / 1e9:.1f} GB of the policy's first GPU now)")
        generator = build_generator(cfg, inputs, device, policy)
    except BaseException:
        stop(critic, reference, policy)
        raise
    info(generator.describe())
    return Roles(policy, reference, generator, critic, parks)


def check_capacity(cfg: NovaRLConfig, inputs: RunInputs, device: torch.device) -> None:
    """A run on Ray ranks whose policy ranks and dedicated engines together need more devices
    than the Ray cluster has is refused before anything starts."""
    layout = generation_layout(cfg, inputs.choice.generation)
    if layout.in_process and not training_spec(inputs.choice.training).emulated():
        return
    from novarl.distributed.ray_group import require_capacity

    resource, per_engine = ("GPU", layout.devices_per_engine) if device.type == "cuda" else ("CPU", 1)
    engines = 0 if layout.colocated else layout.engines
    require_capacity({resource: layout.training_ranks + engines * per_engine},
                     f"{layout.training_ranks} policy rank(s) x 1 {resource}"
                     + (f" + {engines} generation engine(s) x {per_engine} {resource}" if engines else ""))


def build_trainers(cfg: NovaRLConfig, inputs: RunInputs, device: torch.device
                   ) -> tuple[TrainingBackend, ReferenceBackend | None, TrainingBackend | None]:
    """(policy, reference or None, critic or None): on this process for one rank, else on Ray
    ranks, the reference and the critic beside the policy on its ranks."""
    from novarl.models.lora import BaseReference

    steps = (inputs.max_steps or cfg.grpo.max_num_steps) * cfg.grpo.ppo_epochs
    total_steps = steps * inputs.batches.optimizer_steps_per_step
    spec = training_spec(inputs.choice.training)
    Policy, Reference = spec.classes()
    common = dict(policy=cfg.policy, model_path=inputs.model_path, **spec.role_arguments())
    policy_args = dict(common, total_steps=total_steps, seed=cfg.grpo.seed,  # seeds what starts at random (LoRA's A)
                       **spec.trainer_arguments(accumulation_steps=inputs.batches.gradient_accumulation_steps))
    reference_args = common
    Critic, critic_args = None, {}
    if cfg.value is not None:
        Critic = spec.critic()
        critic_args = dict(policy=cfg.value, model_path=inputs.critic_model_path or inputs.model_path,
                           total_steps=steps * critic_optimizer_steps(cfg, inputs), seed=cfg.grpo.seed,
                           **spec.role_arguments(),
                           **spec.trainer_arguments(accumulation_steps=critic_accumulation_steps(cfg, inputs)))
    with_reference = cfg.loss_fn.reference_policy_kl_penalty > 0
    # LoRA's base is frozen: the reference is the policy with its adapters off, no model of its own
    lora_base = with_reference and cfg.policy.dtensor_cfg.lora_cfg.enabled
    if lora_base:
        info("reference policy: the policy's own base model with its LoRA adapters off (no second copy)")
        with_reference = False
    ranks = world_size(cfg)
    if ranks == 1 and cfg.policy.generation.colocated.enabled and not spec.emulated():
        from novarl.distributed.local import ensure_single_process_group

        ensure_single_process_group()
        policy = Policy(device=device, **policy_args)
        reference = Reference(device=device, **reference_args) if with_reference else None
        critic = Critic(device=device, **critic_args) if Critic else None
        return policy, BaseReference(policy) if lora_base else reference, critic
    from novarl.distributed.ray_group import RayWorkerGroup
    from novarl.backends.remote import RemoteCritic, RemotePolicy, RemoteReference

    gpus = 1 if device.type == "cuda" else 0
    info(f"starting {ranks} policy ranks on Ray ({'1 GPU' if gpus else '1 CPU'} each)")
    group = RayWorkerGroup(Policy, policy_args, world_size=ranks, gpus_per_rank=gpus, name="policy")
    policy = RemotePolicy(group)
    reference, critic = BaseReference(policy) if lora_base else None, None
    try:
        if with_reference:
            group.add_role(RemoteReference.ROLE, Reference, reference_args)  # on the policy's ranks
            reference = RemoteReference(group)
        if Critic:
            group.add_role(RemoteCritic.ROLE, Critic, critic_args)  # on the policy's ranks too
            critic = RemoteCritic(group)
        return policy, reference, critic
    except BaseException:
        policy.shutdown()
        raise


def value_section(cfg: NovaRLConfig) -> ValueConfig:
    """The critic's section, which every run with a critic has (GAE needs it: schema.py)."""
    assert cfg.value is not None, "a run without a critic (no value section)"
    return cfg.value


def critic_global_batch_size(cfg: NovaRLConfig, inputs: RunInputs) -> int:
    """Samples per critic optimizer step: value.train_global_batch_size, else the policy's."""
    return value_section(cfg).train_global_batch_size or inputs.batches.global_batch_size


def critic_optimizer_steps(cfg: NovaRLConfig, inputs: RunInputs) -> int:
    """The critic's optimizer steps per pass over a step's samples."""
    samples = inputs.batches.global_batch_size * inputs.batches.optimizer_steps_per_step
    return max(-(-samples // critic_global_batch_size(cfg, inputs)), 1)


def critic_accumulation_steps(cfg: NovaRLConfig, inputs: RunInputs) -> int:
    """DeepSpeed's micro-batches per critic optimizer step, on each data-parallel rank."""
    per_rank = critic_global_batch_size(cfg, inputs) // max(inputs.batches.data_parallel_size, 1)
    return max(per_rank // value_section(cfg).train_micro_batch_size, 1)
