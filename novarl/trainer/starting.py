"""What a run starts from when the user names a model and gives no config, and the cluster
that the Python API's `tensor_parallel_size=` sizes from this host's GPUs.

The recipe: a bundled model (tiny-arith, tiny-math) starts from BUNDLED_RECIPE, sized for a
2-core CPU; any other model (a hub id, a local folder) from REAL_MODEL_RECIPE, NeMo RL's
grpo_math_1B sizes (512 tokens, 32 prompts x 16 samples, lr 5e-6, colocated vLLM). What the
real-model recipe asks that this host or the model cannot give is changed before the run
starts, each change a line of the start-up log (`fit_to_host`):
  - policy.max_seq_length above the model's max_position_embeddings: cut to it;
  - vLLM not installed, or unable to run the model here: Hugging Face generation;
  - precision: left unset, as novarl already treats it: bfloat16 on a GPU, float32 without one.
The user's overrides go on top of the recipe; a key they set is never changed. A config the
user gives (a file, a dict) is never replaced by a recipe.

The cluster (`cluster_overrides`): when `tensor_parallel_size=` (or `context_parallel_size=`)
is given and the user set no cluster size, cluster.gpus_per_node becomes the visible CUDA
device count (`cuda_device_count`, the one hardware query, which tests replace), and the
vLLM engines, where generation is still on vLLM after fitting, take the same tensor-parallel
size; what cannot be honoured is refused with its arithmetic.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from novarl.backends.registry import FALLBACK_GENERATION, PREFERRED_GENERATION, generation_spec
from novarl.config.files import _clip, canonical, canonical_path, check_tree
from novarl.config.loading import BUNDLED_RECIPE, keyword_path, load_config, parse_override, with_warnings
from novarl.config.schema import NovaRLConfig
from novarl.models.config_overrides import overridden
from novarl.errors import ConfigError, UserError


@dataclass(frozen=True)
class Recipe:
    path: Path
    name: str
    source: str
    """Where its sizes come from, for the log."""


TINY_RECIPE = Recipe(BUNDLED_RECIPE, "tiny_arith", "the bundled tiny model's CPU demo")
REAL_MODEL_RECIPE = Recipe(BUNDLED_RECIPE.parent / "grpo_real_model.yaml", "grpo_real_model",
                           "NeMo RL grpo_math_1B's sizes")


PARALLEL_KEYWORDS = ("tensor_parallel_size", "context_parallel_size")
"""The API's keywords (config/loading.py's KEYWORD_SHORTCUTS) that size the cluster from this host."""


def recipe_for(model_name: str | None) -> Recipe:
    """The recipe a run of `model_name` starts from without a config (None: the bundled model)."""
    from novarl.models.bundled import resolve_bundled

    if model_name is None or resolve_bundled(str(model_name)) is not None:
        return TINY_RECIPE
    return REAL_MODEL_RECIPE


def load_starting_config(keyword_overrides: Mapping[str, Any] | None = None,
                         overrides: Iterable[str] = ()) -> NovaRLConfig:
    """The config of a run with no config file: the recipe for the model the overrides name
    (`recipe_for`), fitted to this host, with the overrides on top (as `load_config` takes
    them). The recipe and every change made to it are the config's load notes, which the
    start-up log (and `novarl validate`) print."""
    keyword_overrides, overrides = dict(keyword_overrides or {}), list(overrides)
    given = given_values(keyword_overrides, overrides)
    recipe = recipe_for(given.get("policy.model_name"))
    overrides += own_data(given) if recipe is REAL_MODEL_RECIPE else []
    cfg = load_config(recipe.path, overrides=overrides, **keyword_overrides)
    lines = [f"recipe: {recipe.name} ({recipe.source}) for policy.model_name={cfg.policy.model_name}"]
    fitted, why = fit_to_host(cfg, given) if recipe is REAL_MODEL_RECIPE else ([], [])
    if fitted:  # only keys the user did not set: their overrides still win
        cfg = load_config(recipe.path, overrides=[*overrides, *fitted], **keyword_overrides)
    # sized from the fitted config: engines get a size only where generation is still on vLLM
    sized, more = cluster_overrides(cfg, keyword_overrides, lambda path: _given(given, path))
    if sized:
        cfg = load_config(recipe.path, overrides=[*overrides, *fitted, *sized], **keyword_overrides)
    return with_warnings(cfg, (), [*lines, *why, *more])


def load_api_config(config: Mapping[str, Any] | str | Path | None,
                    keyword_overrides: Mapping[str, Any]) -> NovaRLConfig:
    """GRPOTrainer's config: the starting recipe when `config` is None (`load_starting_config`),
    else `config` with the keyword overrides, its cluster sized by `tensor_parallel_size=` when
    neither sets a cluster size."""
    if config is None:
        return load_starting_config(keyword_overrides)
    cfg = load_config(config, **keyword_overrides)
    extra, lines = cluster_overrides(cfg, keyword_overrides, lambda path: _set_in(cfg, path))
    if not extra:
        return cfg
    return with_warnings(load_config(config, overrides=extra, **keyword_overrides), (), lines)


# ------------------------------------------------------------------ the recipe, fitted to this host
def own_data(given: Mapping[str, Any]) -> list[str]:
    """The real-model recipe's bundled task (data.dataset_name) dropped when the user names a
    data file or datasets of their own (data.train_data_path, data.train) and no dataset_name:
    validation refuses a bundled task together with a file."""
    if _given(given, "data.dataset_name") or not any(_given(given, k) for k in ("data.train_data_path", "data.train")):
        return []
    return ["data.dataset_name=null"]


def fit_to_host(cfg: NovaRLConfig, given: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(dotted overrides, one line each saying why) for what the real-model recipe asks that
    this host or the model cannot give; keys in `given` (the user's) are left as they are."""
    extra, why = [], []
    model = overridden(local_model_config(cfg.policy.model_name), cfg.policy.hf_config_overrides)
    on_gpu = cuda_device_count() > 0
    asked = generation_spec(cfg.policy.generation.backend) if cfg.policy.generation.backend else None
    cannot = asked.cannot_run(model, on_gpu=on_gpu) \
        if asked and not _given(given, "policy.generation.backend") else None
    limit = model.get("max_position_embeddings")
    length = cfg.policy.max_seq_length
    if not _given(given, "policy.max_seq_length") and isinstance(limit, int) and 2 <= limit < length:
        extra.append(f"policy.max_seq_length={limit}")
        followed = (f"there, and {asked.title} refuses a longer engine); new tokens and the engine follow it"
                    if asked and asked.refuses_long_sequences and not cannot else "there); new tokens follow it")
        why.append(f"recipe: policy.max_seq_length {length} -> {limit}, the model's max_position_embeddings (its "
                   f"positions end {followed}")
    if asked is not None and cannot:
        fallback = generation_spec(FALLBACK_GENERATION)
        extra.append(f"policy.generation.backend={fallback.name}")
        why.append(f"recipe: generation on {fallback.title}, not {asked.title}: {cannot}")
    if not on_gpu and cfg.policy.precision is None:
        why.append("recipe: precision float32 on this host without a GPU (bfloat16, NeMo RL's, on GPUs)")
    return extra, why


def local_model_config(name: str) -> dict[str, Any]:
    """The model's config.json when it is here (a folder, a bundled model, the local Hugging Face
    cache), without the network; {} otherwise (the run's own checks report a bad name)."""
    from novarl.models.locate import resolve_model_path

    try:
        folder = Path(resolve_model_path(str(name), download=False))
        loaded = json.loads((folder / "config.json").read_text())
    except (UserError, OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


# ------------------------------------------------------------------ the cluster, from this host's GPUs
def cuda_device_count() -> int:
    """The CUDA devices this process sees (CUDA_VISIBLE_DEVICES honoured); 0 without a GPU.
    Imports torch only where the driver's device files are there."""
    from novarl import host

    return host.cuda_device_count()


def cluster_overrides(cfg: NovaRLConfig, keyword_overrides: Mapping[str, Any],
                      user_set: Callable[[str], bool]) -> tuple[list[str], list[str]]:
    """(dotted overrides, lines) sizing the cluster from this host's GPUs for the API's
    `tensor_parallel_size=` / `context_parallel_size=`: cluster.gpus_per_node = the visible
    CUDA devices, and the vLLM engines' tensor-parallel size = the training one. Nothing when
    no such keyword was given, the user set a cluster size (`user_set(dotted path)`: whether
    the user gave that key), or the training backend is not DTensor. Raises ConfigError when
    this host cannot hold the sizes asked for."""
    policy = cfg.policy
    if not any(k in keyword_overrides for k in PARALLEL_KEYWORDS) or user_set("cluster.gpus_per_node") \
            or user_set("cluster.num_nodes") or policy.megatron_cfg.enabled or policy.deepspeed_cfg.enabled:
        return [], []
    tp, cp = policy.dtensor_cfg.tensor_parallel_size, policy.dtensor_cfg.context_parallel_size
    needed, asked = tp * cp, _asked(tp, cp)
    devices = cuda_device_count()
    if devices == 0:
        if needed == 1:
            return [], []  # one CPU rank: the default cluster
        raise ConfigError(f"{asked} needs {needed} devices; this host has no CUDA GPU. On CPU, novarl runs "
                          f"cluster.gpus_per_node x cluster.num_nodes ranks (gloo): pass cluster={{'gpus_per_node': "
                          f"{needed}}} to run {needed} CPU ranks (slow), or tensor_parallel_size=1 for one.")
    if devices % needed:
        fits = [d for d in range(1, devices + 1) if devices % d == 0]
        plural = "GPU" if devices == 1 else "GPUs"
        if devices < needed:
            problem = f"{asked} needs {needed} devices; this host has {devices} {plural}"
        else:
            problem = (f"{asked} needs a multiple of {needed} devices; this host has {devices} {plural} = "
                       f"{devices // needed} x {needed} + {devices % needed}")
        sizes = "tensor_parallel_size x context_parallel_size" if cp > 1 else "tensor_parallel_size"
        raise ConfigError(f"{problem} (visible CUDA devices). Use a {sizes} that divides {devices} "
                          f"({', '.join(map(str, fits))}), or set cluster.gpus_per_node and cluster.num_nodes for "
                          "the cluster to run on.")
    extra = [f"cluster.gpus_per_node={devices}"]
    engines = ""
    generation = generation_spec(policy.generation.backend or PREFERRED_GENERATION)  # on GPUs, the default
    if generation.tensor_parallel_key and not user_set(generation.tensor_parallel_key):
        extra.append(f"{generation.tensor_parallel_key}={tp}")
        engines = f"; {generation.title} engines of tensor_parallel_size={tp}"
    return extra, [f"cluster: gpus_per_node={devices}, this host's visible GPUs, for {asked}: "
                   f"{devices // needed} data-parallel rank(s) x {needed}{engines}"]


def _asked(tp: int, cp: int) -> str:
    return f"tensor_parallel_size={tp}" + (f" x context_parallel_size={cp}" if cp > 1 else "")


# ------------------------------------------------------------------ what the user set
def given_values(keyword_overrides: Mapping[str, Any], overrides: Iterable[str] = ()) -> dict[str, Any]:
    """{canonical dotted path: value} of every leaf the overrides set (a section given as a
    dict is read down to its leaves), in load_config's order: a later one wins. Each value is
    first checked as load_config checks it (`check_tree`: depth, size, a value inside itself),
    so what it refuses is the same ConfigError here, before the recursive walk."""
    values: dict[str, Any] = {}
    for key, value in keyword_overrides.items():
        path = keyword_path(key)
        check_tree(value, f"Keyword override {_clip(key, 80)}=", prefix=path)
        _leaves(path, value, values)
    for item in overrides:
        path, value = parse_override(item)
        path = canonical_path(path)
        check_tree(value, f"Override '{_clip(item)}'", prefix=path)
        _leaves(path, value, values)
    return values


def _leaves(path: str, value: Any, into: dict[str, Any]) -> None:
    if isinstance(value, Mapping) and value:
        for key, inner in canonical(dict(value), path).items():
            _leaves(f"{path}.{key}", inner, into)
    else:
        into.pop(path, None)
        into[path] = value


def _given(given: Mapping[str, Any], path: str) -> bool:
    """Whether the user set `path`, or a section above it to a value."""
    return any(path == p or path.startswith(p + ".") for p in given)


def _set_in(cfg: NovaRLConfig, path: str) -> bool:
    """Whether a loaded config's source (its file or dict, and the overrides) gave `path`."""
    node: Any = cfg
    for part in path.split("."):
        if node is None or part not in node.model_fields_set:
            return False
        node = getattr(node, part)
    return True
