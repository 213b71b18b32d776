"""The data and reward sections. Re-exported by novarl.config.schema."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from novarl.config.sections.base import PathText, Precision, Section

BUNDLED_TASKS = ("arithmetic", "repeat", "word_problems", "multiplication")
"""Tasks shipped with novarl (novarl.data.datasets.BUNDLED_DATASETS implements them)."""


class DatasetBlock(Section):
    """One of several datasets (NeMo RL's list form of data.train / data.validation). A key left
    unset takes data's own (data.input_key, ...), as NeMo RL's data.default does."""

    dataset_name: str | None = None
    """A named dataset, or 'ResponseDataset' / None for data_path."""
    data_path: PathText | None = None
    input_key: str | None = None
    output_key: str | None = None
    subset: str | None = None
    split: str | None = None
    split_validation_size: float | None = Field(None, ge=0, lt=1)
    """Training blocks: this fraction is held out for evaluation (drawn with grpo.seed); None:
    data.split_validation_size."""
    repeat: int = Field(1, ge=1)
    """Validation blocks: each example this many times (NeMo RL: AIME x16, averaged over samples)."""
    env_name: str | None = None
    """The reward domain of this dataset's examples (NeMo RL's key): a name under reward.domains, or
    reward.default_domain; None: the default domain (an example's own `domain` column wins)."""

    @model_validator(mode="after")
    def _one_source(self) -> "DatasetBlock":
        named = self.dataset_name not in (None, "ResponseDataset")
        if named == bool(self.data_path):
            raise ValueError("a dataset block names its data with dataset_name (a named dataset) or data_path, "
                             f"one of them (got dataset_name={self.dataset_name!r}, data_path={self.data_path!r})")
        return self


class DataConfig(Section):
    dataset_name: str | None = None
    """'arithmetic', 'repeat', 'word_problems' or 'multiplication' (bundled); 'ResponseDataset'
    (data.train_data_path: a file, a `datasets` folder or a hub dataset id); a NeMo RL named dataset
    ('OpenMathInstruct-2', 'DAPOMath17K', 'DeepScaler', 'AIME2024', ...: novarl/data/named.py); None: from
    the paths."""
    train_data_path: PathText | None = None
    """A data file (.jsonl, .json, .parquet, .arrow, .csv), a folder `datasets` saved or laid out as
    a hub dataset repository, or a hub dataset id 'org/name' (read from the local caches;
    `novarl train` downloads the split when no cache holds it)."""
    val_data_path: PathText | None = None
    """As train_data_path, for evaluation; None: the training source's validation or test split
    when it has one (else the training split, and the log says so)."""
    val_dataset_name: str | None = None
    """A named dataset to evaluate on (NeMo RL's data.validation.dataset_name: 'AIME2024', ...)."""
    input_key: str = "prompt"
    output_key: str = "answer"
    subset: str | None = None
    """The subset (configuration) of a hub dataset or folder with several (NeMo RL's `subset`)."""
    train_split: str | None = None
    """The split to train on; None: 'train' (a named dataset's own split)."""
    val_split: str | None = None
    """The split to evaluate on; None: 'validation', else 'test', else the training split."""
    prompt_file: PathText | None = None
    """A text file with one '{}' where the prompt goes (other braces doubled: '{{', '}}')."""
    system_prompt_file: PathText | None = None
    shuffle: bool = True
    max_input_seq_length: int | None = Field(None, ge=1)
    split_validation_size: float = Field(0.0, ge=0, lt=1)
    """With no held-out split given: this fraction of the training examples (drawn with grpo.seed)
    is held out for evaluation and not trained on (NeMo RL's data.train.split_validation_size)."""
    train: list[DatasetBlock] | None = None
    """Several training datasets (NeMo RL's list form), read one after the other into one shuffled
    pool; instead of dataset_name / train_data_path."""
    validation: list[DatasetBlock] | None = None
    """Several evaluation datasets, instead of val_dataset_name / val_data_path."""
    domain_interleave_probs: dict[str, float] | None = None
    """Each step's prompts drawn by reward domain (ROLL's key): domain d gets int(p_d x prompts) of
    them, the last domain listed the rest, each from its own shuffled pool of examples; None: one pool."""

    @model_validator(mode="after")
    def _one_source(self) -> "DataConfig":
        for blocks, flat in (("train", ("dataset_name", "train_data_path", "train_split")),
                             ("validation", ("val_dataset_name", "val_data_path", "val_split"))):
            given = [k for k in flat if getattr(self, k) not in (None, "ResponseDataset")]
            if getattr(self, blocks) is not None and given:
                raise ValueError(f"data.{blocks} lists the datasets, and data.{given[0]} names one too: give one form")
            if getattr(self, blocks) == []:
                raise ValueError(f"data.{blocks} is an empty list: name at least one dataset")
        given = [k for k in ("train_data_path", "val_data_path") if getattr(self, k)]
        if self.dataset_name in BUNDLED_TASKS and given:
            raise ValueError(f"data.dataset_name='{self.dataset_name}' is a bundled task, but data.{given[0]} "
                             "is also set: drop dataset_name (or set it to 'ResponseDataset') to train on the file")
        if self.dataset_name not in (None, "ResponseDataset", *BUNDLED_TASKS) and self.train_data_path:
            raise ValueError(f"data.dataset_name='{self.dataset_name}' names a dataset, but data.train_data_path is "
                             "also set: drop dataset_name (or set it to 'ResponseDataset') to train on the path")
        if self.val_dataset_name is not None and self.val_data_path:
            raise ValueError("data.val_dataset_name and data.val_data_path both name the evaluation data: set one")
        return self


class SandboxConfig(Section):
    """reward.sandbox: where the code rewards (code_tests, code_pass_rate) run programs, and their
    limits (novarl/rewards/sandbox.py says how each is enforced)."""

    timeout_s: float = Field(10.0, gt=0)
    """Wall-clock seconds of one run of a program (one standard input; or the program and its assert tests)."""
    memory_mb: int = Field(1024, ge=16)
    """A program's address space, MiB."""
    max_processes: int = Field(64, ge=1)
    """Processes a program may have at once (a fork bomb is stopped there)."""
    max_output_bytes: int = Field(1 << 20, ge=1)
    """Standard output a run may write; past it the run stops, failed."""
    max_file_mb: int = Field(64, ge=1)
    """The program's own folder (a tmpfs) and any one file it writes, MiB."""
    workers: int = Field(2, ge=1)
    """Programs run at once."""
    isolate: bool = True
    """Namespaces (no network, the host's files read-only, leftover processes killed) where the
    host allows them; false: the limits, a process group and a folder only."""
    site_packages: bool = False
    """Programs may import the interpreter's installed packages (false: the standard library only)."""
    max_failed_fraction: float = Field(0.1, ge=0, le=1)
    """Past this fraction of a batch's programs on which the sandbox itself failed (it did not
    start or report), the run stops with its error."""
    url: str | None = None
    """A SandboxFusion service (http://host:port) that runs the programs instead (its /run_code;
    verl's and ROLL's remote sandbox): timeout_s and memory_mb are sent with each request,
    workers requests go at once; the local-only settings (isolate, site_packages, max_processes,
    max_output_bytes, max_file_mb) are the service's own. None: the local sandbox."""


class RewardResources(Section):
    """The devices a model-based reward runs on, apart from the policy's (NeMo RL's
    env.reward_model.resources): on one node `gpus_per_node` of its devices, on several nodes
    `num_nodes` whole nodes; the policy and generation get the rest. Unset: in the driver's process."""

    gpus_per_node: int | None = Field(None, ge=1)
    num_nodes: int | None = Field(None, ge=1)


class RewardModelConfig(Section):
    """reward.reward_model: the model the registered reward `reward_model` scores with (NeMo RL's
    env.reward_model): a sequence-classification model with one output (Bradley-Terry), whose
    score of the conversation (the prompt, then the completion as the assistant's turn, in its
    own tokenizer's chat template) is the reward, as it comes (no sigmoid)."""

    model_name: PathText | None = None
    """A Hugging Face folder or hub id (read from the local caches; `novarl train` downloads it)."""
    tokenizer_name: PathText | None = None
    """Its tokenizer, when not the model's own folder (NeMo RL's env.reward_model.tokenizer.name)."""
    precision: Precision = "float32"
    """Its weights' dtype (float32 on a CPU whatever is given)."""
    batch_size: int = Field(8, ge=1)
    """Conversations scored per forward."""
    max_model_len: int | None = Field(None, ge=2)
    """A longer conversation keeps its last this many tokens (the completion's end); None: whole."""
    trust_remote_code: bool = False
    resources: RewardResources = RewardResources()
    """Its own devices (a Ray actor on them), counted apart from the policy's; unset: the driver's process."""


class JudgeConfig(Section):
    """reward.judge: the LLM judge the registered reward `llm_judge` asks (ROLL's LLMJudgeRewardWorker;
    novarl/rollout/judge.py): an engine of its own, a prompt template and a parser of its answers."""

    model_name: PathText | None = None
    """The judge's model: a Hugging Face folder or hub id."""
    backend: Literal["hf", "vllm"] = "hf"
    """Its engine (never the policy's)."""
    prompt: str = "yes_no"
    """A template: 'yes_no' (does the final answer match the reference), 'score' (a 0-10 grade), or a
    text of your own with {question}, {response} and {reference}."""
    parser: Literal["yes_no", "score"] = "yes_no"
    """How an answer becomes the reward: yes 1 / no 0, or 'Score: N' / 10."""
    max_new_tokens: int = Field(100, ge=1)
    temperature: float = Field(0.0, ge=0)
    """0: greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    seed: int = 0
    batch_size: int = Field(32, ge=1)
    max_model_len: int = Field(4096, ge=16)
    """The judge's prompt and answer, tokens at most."""
    precision: Precision = "bfloat16"
    """Its weights' dtype on a GPU (float32 on a CPU)."""
    trust_remote_code: bool = False
    resources: RewardResources = RewardResources()
    """Its own devices (a Ray actor on them), counted apart from the policy's; unset: the driver's process."""

    @model_validator(mode="after")
    def _template(self) -> "JudgeConfig":
        if self.prompt not in ("yes_no", "score") and "{response}" not in self.prompt:
            raise ValueError(f"reward.judge.prompt={self.prompt[:60]!r} is neither 'yes_no' nor 'score', and a "
                             "template of your own must place the {response}")
        return self


CODE_REWARDS = ("code_tests", "code_pass_rate")
"""The registered rewards that run programs in reward.sandbox."""


class RewardDomain(Section):
    """One reward domain (reward.domains.<name>): the verifier of the examples routed to it (ROLL's
    rewards.<domain> blocks, NeMo RL's environments named by data.*.env_name)."""

    function: PathText | list[PathText]
    """As reward.function."""
    weights: list[float] | None = None
    """As reward.weights."""
    tags: list[str] = []
    """Examples whose `tag` column is one of these come here (ROLL's tag_included)."""


class RewardConfig(Section):
    function: PathText | list[PathText] = "exact_match"
    """A registered name (exact_match, math_verify, dapo_math_verify, boxed_match, last_number, boxed_format,
    crossthinkqa, ifeval; code_tests, code_pass_rate: programs run against the example's tests, novarl/rewards/code.py;
    reward_model: reward.reward_model's score; llm_judge: reward.judge's verdict), an import
    path 'module:function' (also a module in the working directory), or a file
    'path/to/rewards.py:function' (relative to the working directory); or a list of them, whose
    rewards are added with `weights`. How each is called: novarl/rewards/scorer.py."""
    weights: list[float] | None = None
    """One weight per function when `function` is a list (TRL's reward_weights); None: 1.0 each."""

    @model_validator(mode="after")
    def _weights(self) -> "RewardConfig":
        count = len(self.function) if isinstance(self.function, list) else 1
        if not count:
            raise ValueError("reward.function is an empty list: give at least one reward function")
        if self.weights is not None and len(self.weights) != count:
            raise ValueError(f"reward.weights has {len(self.weights)} weight(s) for {count} reward function(s): "
                             "give one weight per function")
        if self.weights is not None and not all(math.isfinite(w) for w in self.weights):
            raise ValueError(f"reward.weights={self.weights}: weights are finite numbers")
        return self
    timeout_s: float | None = Field(300.0, gt=0)
    """Seconds one call of the function (one completion) may take; past it the run stops with an
    error naming the function and the completion. None: no limit, and the function is called
    as it is (see novarl.rewards.registry for how the limit is enforced)."""
    sandbox: SandboxConfig = SandboxConfig()
    """The code rewards' sandbox."""
    reward_model: RewardModelConfig = RewardModelConfig()
    """The reward model's (the registered reward `reward_model`)."""
    judge: JudgeConfig = JudgeConfig()
    """The LLM judge's (the registered reward `llm_judge`)."""
    domains: dict[str, RewardDomain] = {}
    """Several verifiers in one run, each scoring the examples routed to it: by the example's
    `domain` column, else its `tag` column (a domain's tags), else its dataset's env_name, else
    default_domain (novarl/rewards/domains.py)."""
    default_domain: str = "default"
    """The domain of examples routed nowhere else: scored by reward.function (or by the domain of
    this name when reward.domains has one: ROLL's fallback to math_rule)."""

    @property
    def names(self) -> list[str]:
        return list(self.function) if isinstance(self.function, list) else [self.function]

    @property
    def used(self) -> set[str]:
        """Every reward function the run calls: reward.function's and each domain's."""
        return {*self.names, *(f for d in self.domains.values()
                               for f in (d.function if isinstance(d.function, list) else [d.function]))}

    def held_devices(self) -> tuple[int, int]:
        """(devices on a one-node cluster, whole nodes on a larger one) that the run's model-based
        rewards hold apart from the policy (reward_model's and llm_judge's resources)."""
        blocks = [b for name, b in (("reward_model", self.reward_model), ("llm_judge", self.judge)) if name in self.used]
        held = [b.resources for b in blocks if b.resources.gpus_per_node or b.resources.num_nodes]
        return sum(r.gpus_per_node or 0 for r in held), sum(r.num_nodes or 1 for r in held)


BUILT_IN_ENVIRONMENTS = {"sliding_puzzle_game": "novarl.rollout.games.sliding_puzzle:SlidingPuzzle"}
"""NeMo RL's environments that novarl ships: env.<name> without actor_class_fqn names this class."""


class EnvConfig(Section):
    """An `env.<name>` block (NeMo RL's): the math environment's settings (env.math: novarl scores
    it with reward.function math_verify, or dapo_math_verify), or an environment that plays the episodes
    (novarl/rollout/environment.py), a class of the user's named by actor_class_fqn."""

    num_workers: int | None = Field(None, ge=1)
    """How many of an environment class's steps run at once (threads beside the engines; a class
    whose steps share state unguarded wants 1), or of an agent's episodes; None: 8 steps, every agent
    of a round. The math environment's is not used."""
    math_verify_impl: Literal["hf_math_verify", "dapo_math_verify"] = "hf_math_verify"
    """The math environment's answer checker, by NeMo RL's name; it chooses reward.function when the
    config names none: hf_math_verify is math_verify, dapo_math_verify is dapo_math_verify (the last
    'Answer:' line, Minerva-normalised: novarl/rewards/dapo_math.py)."""
    actor_class_fqn: PathText | None = None
    """An environment class, 'package.module:Class' or 'path/to/file.py:Class' (a file relative to
    the working directory), built as Class(cfg); its `step(conversation, metadata)` answers each of
    the model's turns (NeMo RL's ENV_REGISTRY names its environments' classes with this key)."""
    cfg: dict[str, Any] = {}
    """The environment class's one constructor argument (NeMo RL's env.<name>.cfg)."""
    agent: PathText | None = None
    """An agent of the user's instead of an environment class: 'module:function' or
    'path/to/file.py:function', called as function(client, example) -> reward for each episode,
    with an openai.OpenAI client bound to the run's chat endpoint (novarl/rollout/agents.py)."""
    max_failed_fraction: float = Field(0.1, ge=0, le=1)
    """An episode whose environment raises gets no loss and is counted (episodes_failed_fraction);
    past this fraction of a step's episodes the run stops with the first one's cause."""

    @model_validator(mode="after")
    def _one_kind(self) -> "EnvConfig":
        """Each kind's settings away from their defaults are refused in the other kind's block (at
        their defaults they pass: a run's saved config.yaml holds every field)."""
        defaults = {name: field.default for name, field in type(self).model_fields.items()}
        if self.agent is not None and (self.actor_class_fqn is not None or self.cfg):
            raise ValueError(f"agent={self.agent!r} plays the episodes itself: a block names an agent or an "
                             "environment class (actor_class_fqn, with its cfg), not both")
        if self.plays_episodes:
            if self.math_verify_impl != defaults["math_verify_impl"]:
                raise ValueError(f"math_verify_impl: the math environment's setting, in a block that names an "
                                 f"environment class (actor_class_fqn={self.actor_class_fqn!r})")
        elif self.cfg or self.max_failed_fraction != defaults["max_failed_fraction"]:
            raise ValueError("cfg and max_failed_fraction are an environment class's: name the class in "
                             "actor_class_fqn")
        return self

    @property
    def plays_episodes(self) -> bool:
        """It names an environment class or an agent (not NeMo RL's math environment)."""
        return self.actor_class_fqn is not None or self.agent is not None


def check_domains(data: DataConfig, reward: RewardConfig, environments: list[str]) -> None:
    """The domains that data names (env_name, domain_interleave_probs) are reward's or the environments'
    that play episodes (`environments`); no tag routes to two; no environment shares a reward domain's name."""
    names = [reward.default_domain, *(d for d in reward.domains if d != reward.default_domain)]
    shared = [e for e in environments if e in names]
    if shared:
        raise ValueError(f"env.{shared[0]} plays episodes and is also a reward domain (reward.domains or "
                         "reward.default_domain): data.*.env_name would name both; rename one")
    names += environments
    for role in ("train", "validation"):
        for i, block in enumerate(getattr(data, role) or []):
            if block.env_name is not None and block.env_name not in names:
                raise ValueError(f"data.{role}[{i}].env_name={block.env_name!r} is not a reward domain or an "
                                 f"environment (reward.domains, reward.default_domain and the env.<name> blocks "
                                 f"that play episodes: {', '.join(names)})")
    check_probabilities(data.domain_interleave_probs, names)
    owner: dict[str, str] = {}
    for name, domain in reward.domains.items():
        for tag in domain.tags:
            if owner.setdefault(tag, name) != name:
                raise ValueError(f"reward.domains: tag {tag!r} is in both {owner[tag]} and {name}: a tag routes to one")


def check_probabilities(probs: dict[str, float] | None, names: list[str]) -> None:
    """data.domain_interleave_probs: known domains' probabilities, finite and >= 0."""
    if probs is None:
        return
    unknown = [d for d in probs if d not in names]
    if unknown or not probs:
        raise ValueError(f"data.domain_interleave_probs names {', '.join(map(repr, unknown)) or 'no domain'}: "
                         f"give the domains' probabilities ({', '.join(names)})")
    if any(not math.isfinite(p) or p < 0 for p in probs.values()):
        raise ValueError(f"data.domain_interleave_probs={probs}: probabilities are finite and >= 0")
