"""NeMo RL's data and environment sections in novarl's terms: its `data.train` / `data.validation` /
`data.default` blocks (one dataset, or its list form) as novarl's flat data keys, and its `env`
section (the math environments, the reward-model environment) as novarl's reward and environment
settings. Called by config/nemo_rl.py's `translate`."""

from __future__ import annotations

from typing import Any

from novarl.config.files import show_value
from novarl.config.sections.data import BUILT_IN_ENVIRONMENTS

ISSUE_DATA = "not built yet"


DATA_FIELDS = {"dataset_name": "dataset_name", "input_key": "input_key", "output_key": "output_key",
               "prompt_file": "prompt_file", "system_prompt_file": "system_prompt_file",
               "split_validation_size": "split_validation_size"}
"""NeMo RL's per-dataset keys (data.train / data.default) and novarl's flat data keys."""


PROCESSORS = (None, "math_hf_data_processor", "math_data_processor")
"""NeMo RL prompt processors that do what novarl does: the prompt file around the problem,
then the tokenizer's chat template."""


def flatten_data(data: dict[str, Any], warnings: list[str], grpo_seed: Any) -> list[str]:
    """NeMo RL's data.train / data.validation / data.default blocks as novarl's flat data keys."""
    train, validation, default = data.pop("train", None), data.pop("validation", None), data.pop("default", None)
    if isinstance(train, list) or isinstance(validation, list):
        return _dataset_lists(data, train, validation, default, warnings, grpo_seed)
    blocks = {"data.train": train, "data.validation": validation, "data.default": default}
    bad = [f"'{k}' = {show_value(v)}: a dataset block is a mapping of dataset_name, data_path, input_key, ..."
           for k, v in blocks.items() if v is not None and not isinstance(v, dict)]
    if bad:
        return bad
    train, validation, default = train or {}, validation or {}, default or {}
    refused: list[str] = []

    def pick(key: str) -> Any:
        return train.get(key, default.get(key))

    # A flat key given beside the blocks (a command-line override: data.dataset_name=...) wins.
    for key, name in DATA_FIELDS.items():
        if pick(key) is not None:
            data.setdefault(name, pick(key))
        own = validation.get(key)
        if key not in ("dataset_name", "split_validation_size") and own is not None and own != pick(key):
            refused.append(f"'data.validation.{key}' = {show_value(own)} differs from the training data's "
                           f"{show_value(pick(key))}: novarl reads both splits with one {key}.")
    if train.get("data_path") is not None:
        data.setdefault("train_data_path", train["data_path"])
    if validation.get("data_path") is not None:
        data.setdefault("val_data_path", validation["data_path"])
    if train.get("split") is not None:
        data.setdefault("train_split", train["split"])
    if validation.get("split") is not None:
        data.setdefault("val_split", validation["split"])
    val_name = validation.get("dataset_name")
    if val_name is not None and val_name != data.get("dataset_name") and val_name != "ResponseDataset":
        data.setdefault("val_dataset_name", val_name)
    subsets = {v.get("subset", default.get("subset")) for v in (train, validation) if v}
    subsets.discard(None)
    if len(subsets) > 1:
        refused.append(f"'data.validation.subset' = {show_value(validation.get('subset'))} differs from the training "
                       f"data's {show_value(pick('subset'))}: novarl reads both splits with one subset.")
    elif subsets:
        data.setdefault("subset", subsets.pop())
    for block, values in (("data.train", train), ("data.validation", validation), ("data.default", default)):
        refused.extend(_data_block(block, values, data, warnings, grpo_seed))
    return refused


def _data_block(block: str, values: dict[str, Any], data: dict[str, Any], warnings: list[str],
                grpo_seed: Any) -> list[str]:
    """One data block's processor, environment, seed, repeat and unknown keys: what is refused, a line
    each (its environment goes to data._env_names)."""
    refused = []
    processor = values.get("processor")
    if processor not in PROCESSORS:
        refused.append(f"'{block}.processor' = {show_value(processor)}: novarl formats prompts as "
                       f"{PROCESSORS[1]} does (prompt file, then chat template); other processors are "
                       f"{ISSUE_DATA}.")
    env = values.get("env_name")
    if env is not None:
        data.setdefault("_env_names", set()).add(env)
    if values.get("seed") not in (None, grpo_seed):
        warnings.append(f"'{block}.seed' = {show_value(values['seed'])}: novarl draws the held-out split with "
                        f"grpo.seed ({show_value(grpo_seed)})")
    if values.get("repeat", 1) != 1 and block == "data.validation":
        warnings.append(f"'{block}.repeat' = {show_value(values['repeat'])}: each example is evaluated once; "
                        "grpo.val_num_generations_per_prompt samples several completions of each (pass@k)")
    elif values.get("repeat", 1) != 1:
        refused.append(f"'{block}.repeat' = {show_value(values['repeat'])}: repeating a training dataset is "
                       f"{ISSUE_DATA}.")
    unknown = set(values) - {*DATA_FIELDS, "data_path", "split", "subset", "processor", "env_name", "seed", "repeat"}
    refused.extend(f"unknown key '{block}.{k}'." for k in sorted(unknown))
    return refused


BLOCK_KEYS = {"train": ("dataset_name", "data_path", "input_key", "output_key", "subset", "split",
                        "split_validation_size"),
              "validation": ("dataset_name", "data_path", "input_key", "output_key", "subset", "split", "repeat")}
"""What novarl's data.train / data.validation list blocks hold (config/sections/data.py DatasetBlock)."""


def _dataset_lists(data: dict[str, Any], train: Any, validation: Any, default: Any, warnings: list[str],
                   grpo_seed: Any) -> list[str]:
    """NeMo RL's list form (several datasets): data.default's keys under each block, as NeMo RL
    merges them; the prompt files, processor and environment are one for all datasets in novarl."""
    from novarl.config.named_datasets import NAMED_DATASETS

    default = default if isinstance(default, dict) else {}
    refused: list[str] = []
    for key in ("input_key", "output_key", "prompt_file", "system_prompt_file"):
        if default.get(key) is not None:
            data.setdefault(key, default[key])
    for role, value in (("train", train), ("validation", validation)):
        if value is None:
            continue
        blocks = value if isinstance(value, list) else [value]
        out = []
        for i, block in enumerate(blocks):
            where = f"data.{role}[{i}]"
            if not isinstance(block, dict):
                refused.append(f"'{where}' = {show_value(block)}: a dataset block is a mapping of dataset_name, "
                               "data_path, input_key, ...")
                continue
            merged = {**default, **block}
            if merged.get("dataset_name") in NAMED_DATASETS:  # NeMo RL's named datasets read their own fields
                merged = {k: v for k, v in merged.items() if k not in ("input_key", "output_key") or k in block}
            for key in ("prompt_file", "system_prompt_file"):
                if merged.get(key) != data.get(key):
                    refused.append(f"'{where}.{key}' = {show_value(merged.get(key))} differs from data.default's "
                                   f"{show_value(data.get(key))}: novarl reads every dataset with one {key}.")
            if merged.get("processor") not in PROCESSORS:
                refused.append(f"'{where}.processor' = {show_value(merged['processor'])}: novarl formats prompts as "
                               f"{PROCESSORS[1]} does; other processors are {ISSUE_DATA}.")
            if merged.get("env_name") is not None:
                data.setdefault("_env_names", set()).add(merged["env_name"])
            if merged.get("seed") not in (None, grpo_seed):
                warnings.append(f"'{where}.seed' = {show_value(merged['seed'])}: novarl draws the held-out split "
                                f"with grpo.seed ({show_value(grpo_seed)})")
            unknown = set(merged) - {*BLOCK_KEYS[role], "processor", "env_name", "seed", "prompt_file",
                                     "system_prompt_file", *(("repeat",) if role == "train" else ())}
            refused.extend(f"unknown key '{where}.{k}'." for k in sorted(unknown))
            if role == "train" and merged.get("repeat", 1) != 1:
                refused.append(f"'{where}.repeat' = {show_value(merged['repeat'])}: repeating a training dataset is "
                               f"{ISSUE_DATA}.")
            out.append({k: v for k, v in merged.items() if v is not None and (
                k in BLOCK_KEYS[role] or (k == "env_name" and v not in MATH_ENVIRONMENTS))})  # math: the default
        data.setdefault(role, out)
    return refused


NEMO_RL_ENVIRONMENTS = ("math", "math_default", "math_multi_reward", "dapo", "code", "code_jaccard", "reward_model",
                        "vlm", "nemo_gym", "sliding_puzzle_game", "clevr-cogent", "geometry3k", "refcoco", "mmpr-tiny",
                        "should_use_nemo_gym", "should_log_nemo_gym_responses")
"""The names under `env` that NeMo RL's code registers or its example configs use (NVIDIA-NeMo/RL
at 7ea279a: environments/utils.py ENV_REGISTRY, examples/configs): any other is refused as a
misspelling."""


MATH_ENVIRONMENTS = ("math", "math_default")
"""NeMo RL's math environment under both names its ENV_REGISTRY gives it (environments/utils.py:
each runs MathEnvironment on its own block)."""


def environments(tree: dict[str, Any], warnings: list[str]) -> list[str]:
    """NeMo RL's environments: novarl scores with reward.function. The math environment (env.math
    or env.math_default) is reward.function 'math_verify' or 'dapo_math_verify' (said once in a warning); NeMo RL's
    others are not built; a name NeMo RL does not have is refused, with the closest one it does."""
    import difflib

    data = tree.get("data") if isinstance(tree.get("data"), dict) else {}
    used = data.pop("_env_names", set()) if data else set()
    reward = tree.get("reward") if isinstance(tree.get("reward"), dict) else {}
    domains = reward.get("domains")
    used -= set(domains) if isinstance(domains, dict) else set()  # novarl's reward domains, named by env_name
    env = tree.get("env")
    if not isinstance(env, dict):
        return []
    refused = []
    for name in list(env):
        if name in BUILT_IN_ENVIRONMENTS and isinstance(env[name], dict):
            env[name].setdefault("actor_class_fqn", BUILT_IN_ENVIRONMENTS[name])  # novarl's own game
        if name in MATH_ENVIRONMENTS or (isinstance(env[name], dict) and {"actor_class_fqn", "agent"} & set(env[name])):
            continue  # math is reward.function math_verify; a class (novarl's or the user's) plays episodes
        block = env.pop(name)
        if name == "reward_model" and isinstance(block, dict) and name in used:
            refused.extend(_reward_model_environment(tree, block, warnings))
        elif name not in NEMO_RL_ENVIRONMENTS:
            close = difflib.get_close_matches(name, NEMO_RL_ENVIRONMENTS, n=1, cutoff=0.6)
            refused.append(f"unknown key 'env.{name}'" + (f" (did you mean '{close[0]}'?)" if close else "")
                           + ": env holds NeMo RL's environments (math is built: reward.function math_verify or "
                           "dapo_math_verify) "
                           "and yours, each naming its class in env.<name>.actor_class_fqn; novarl scores "
                           "completions with reward.function otherwise.")
        elif name in used:
            refused.append(f"'env.{name}': NeMo RL's '{name}' environment is not built; novarl scores completions "
                           "with reward.function.")
        elif isinstance(block, dict) and block.get("enabled", False):
            refused.append(f"'env.{name}.enabled' = true: NeMo RL's '{name}' environment is not built.")
        else:
            warnings.append(f"env.{name}: NeMo RL's '{name}' environment is not built; the block is not used "
                            "(novarl scores completions with reward.function)")
    math = {name: env[name] for name in MATH_ENVIRONMENTS if name in env}
    if math:
        refused.extend(_math_environment(tree, math, warnings))
    return refused


REWARD_MODEL_KEYS = {"model_name": "model_name", "precision": "precision", "batch_size": "batch_size",
                     "max_model_len": "max_model_len"}


REWARD_MODEL_UNUSED = ("processor", "offload_optimizer_for_logprob", "dtensor_cfg", "dynamic_batching",
                       "sequence_packing", "max_grad_norm", "enabled")


def _reward_model_environment(tree: dict[str, Any], block: dict[str, Any], warnings: list[str]) -> list[str]:
    """NeMo RL's reward-model environment, named by the data's env_name: reward.reward_model's
    settings, scored by the registered reward 'reward_model' (the run's reward.function, or the
    domain of the datasets that name it)."""
    refused = []
    kind = (block.get("reward_model_cfg") or {}).get("reward_model_type", "bradley_terry")
    if kind != "bradley_terry" or (block.get("reward_model_cfg") or {}).get("enabled") is False:
        refused.append(f"'env.reward_model.reward_model_cfg' = {show_value(block.get('reward_model_cfg'))}: a "
                       "Bradley-Terry reward model (enabled, reward_model_type: bradley_terry) is what is built.")
    if block.get("checkpoint_path") is not None:
        refused.append(f"'env.reward_model.checkpoint_path' = {show_value(block['checkpoint_path'])}: give the reward "
                       "model's Hugging Face folder in env.reward_model.model_name.")
    settings = {ours: block[theirs] for theirs, ours in REWARD_MODEL_KEYS.items() if block.get(theirs) is not None}
    resources = block.get("resources")
    if isinstance(resources, dict):
        settings["resources"] = {k: resources[k] for k in ("gpus_per_node", "num_nodes") if resources.get(k)}
    tokenizer = (block.get("tokenizer") or {}).get("name")
    if tokenizer not in (None, block.get("model_name")):
        settings["tokenizer_name"] = tokenizer
    reward = tree.setdefault("reward", {})
    reward.setdefault("reward_model", {}).update(settings)
    data = tree.get("data") if isinstance(tree.get("data"), dict) else {}
    if any(isinstance(b, dict) and b.get("env_name") == "reward_model" for b in data.get("train") or []):
        reward.setdefault("domains", {}).setdefault("reward_model", {"function": "reward_model"})
    else:
        reward.setdefault("function", "reward_model")
    unused = [k for k in REWARD_MODEL_UNUSED if k in block]
    if unused:
        warnings.append(f"env.reward_model: {', '.join(unused)} not used (novarl scores with the reward model on "
                        "env.reward_model.resources, a Ray actor of its own, or in the driver's process without them)")
    return refused


MATH_VERIFY_IMPLS = {"hf_math_verify": ("math_verify", "math-verify"),
                     "dapo_math_verify": ("dapo_math_verify", "the 'Answer:' line, Minerva-normalised")}
"""NeMo RL's math environment's checkers (env.<name>.math_verify_impl) -> (novarl's reward.function
that scores as it does, what the warning says it checks)."""


def _math_environment(tree: dict[str, Any], blocks: dict[str, Any], warnings: list[str]) -> list[str]:
    """NeMo RL's math environment (`blocks`: its block under each name given) scores with its
    math_verify_impl: hf_math_verify (the default) is novarl's reward function 'math_verify',
    dapo_math_verify is 'dapo_math_verify' (MATH_VERIFY_IMPLS), unless the config names a reward
    function of its own."""
    blocks = {name: block if isinstance(block, dict) else {} for name, block in blocks.items()}
    reward = tree.setdefault("reward", {}) if isinstance(tree.get("reward", {}), dict) else {}
    impl, refused = _math_checker(blocks, chooses_reward="function" not in reward)
    if refused:
        return refused
    given = " and ".join(f"env.{name}" for name in blocks)
    counts = [(f"env.{name}." if len(blocks) > 1 else "") + f"num_workers={block['num_workers']}"
              for name, block in blocks.items() if block.get("num_workers", 1) != 1]
    workers = (f"; {' and '.join(counts)} {'is' if len(counts) == 1 else 'are'} not used (the reward runs in the "
               "driver)" if counts else "")
    if "function" in reward:
        warnings.append(f"{given} {'is' if len(blocks) == 1 else 'are'} not used: reward.function="
                        f"{show_value(reward['function'])} scores the completions")
    else:
        reward["function"], checks = MATH_VERIFY_IMPLS[impl]
        warnings.append(f"{given}: completions are scored by reward.function={show_value(reward['function'])} "
                        f"({checks}, as NeMo RL's {impl}){workers}")
    return []


def _math_checker(blocks: dict[str, dict[str, Any]], chooses_reward: bool) -> tuple[str, list[str]]:
    """(the checker the math blocks name, a MATH_VERIFY_IMPLS key; the refusals, a line each): a
    checker not built is refused (and its key removed: the schema would say it again), and so are
    blocks that name different checkers when they choose the reward (one reward.function scores
    every math example)."""
    impls, refused = {}, []
    for name, block in blocks.items():
        impl = block.get("math_verify_impl", "hf_math_verify")
        if impl is None or (isinstance(impl, str) and impl in MATH_VERIFY_IMPLS):
            impls[name] = impl or "hf_math_verify"
            continue
        del block["math_verify_impl"]
        built = " and ".join(f"{show_value(key)} (reward.function: {function})"
                             for key, (function, _) in MATH_VERIFY_IMPLS.items())
        refused.append(f"'env.{name}.math_verify_impl' = {show_value(impl)}: that checker is not built; {built} are.")
    if chooses_reward and len(set(impls.values())) > 1:
        named = " and ".join(f"'env.{name}.math_verify_impl' = {show_value(impl)}" for name, impl in impls.items())
        refused.append(f"{named}: novarl scores every math example with one reward.function; give the blocks the "
                       "same checker, or name reward.function.")
    return next(iter(impls.values()), "hf_math_verify"), refused
