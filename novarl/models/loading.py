"""Loading Hugging Face checkpoints: a bundled name, a local folder, or a hub id.

A hub id is taken from the local Hugging Face cache when it is there; otherwise
it fails in seconds when the hub cannot be reached (see `resolve_hub_id`).

Safe by default: safetensors weights only, and `trust_remote_code` only when
the config sets it. Every failure is a `UserError` naming the model; a local
folder is checked before anything loads it (`check_model_folder`: config.json,
the safetensors headers, and their shapes against the config), and a load that
fails anyway (in this process or on a Ray rank, which forwards UserError) says
which folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import json
from pathlib import Path

import torch

from novarl.errors import UserError
from novarl.models.locate import _first_line, resolve_hub_id, resolve_model_path  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    source = resolve_model_path(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (MemoryError, RecursionError):
        raise
    except Exception as err:  # transformers and tokenizers raise many types for a damaged folder
        raise UserError(f"Cannot load the tokenizer of '{name_or_path}': {_first_line(err)}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(name_or_path: str, *, dtype: torch.dtype = torch.float32,
                   trust_remote_code: bool = False) -> PreTrainedModel:
    """A causal LM in `dtype` on the CPU, in train mode off (eval)."""
    from transformers import AutoModelForCausalLM

    source = resolve_model_path(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code)
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as err:  # safetensors' SafetensorError, a RuntimeError for mismatched shapes, ...
        raise UserError(f"Cannot load model '{name_or_path}' ({source}): {type(err).__name__}: {_one_line(err)} "
                        "(novarl loads safetensors weights only, and remote code only with "
                        "policy.trust_remote_code=true; `novarl validate` checks the folder without "
                        "loading it).") from None
    model.eval()
    return model


def parameter_places(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, list[tuple[torch.nn.Module, str]]]]:
    """Each floating parameter of `model` with every (module, name) place it is registered in (a tied head's
    weight: two), in the order model.modules() meets them."""
    places: dict[int, tuple[torch.nn.Parameter, list[tuple[torch.nn.Module, str]]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_floating_point():
                places.setdefault(id(param), (param, []))[1].append((module, name))
    return list(places.values())


def parameters_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Each floating parameter of `model` replaced by one in `dtype` in every place it is registered (a tied
    head keeps one parameter; a tensor-parallel DTensor keeps its placements), its buffers left as loaded: how
    a frozen model (the KL reference) holds the values its trained counterpart computes with under mixed
    precision, which casts parameters and leaves buffers (rotary tables) as they are."""
    for param, where in parameter_places(model):
        if param.dtype != dtype:
            cast = torch.nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
            for module, name in where:
                module._parameters[name] = cast


def check_model_folder(folder: str, *, trust_remote_code: bool = False, key: str = "policy.model_name") -> None:
    """What loading the weights of the local model `folder` would fail on, found without
    loading them (config.json and the safetensors headers only: milliseconds, whatever the
    model's size): config.json is a UTF-8 JSON object transformers accepts; every safetensors
    file (those the index names, else every *.safetensors) exists and has a readable header
    and the length it declares; and the tensors a model built from config.json has are the
    shapes the weights hold. A hub id still to be downloaded is not checked. Raises UserError
    naming `key`, the folder and the file."""
    path = Path(folder)
    if not path.is_dir():
        return
    where = f"{key}='{folder}'"
    config_file = path / "config.json"
    try:
        raw = json.loads(config_file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise UserError(f"{where}: {config_file} is not UTF-8 text (byte {err.start}).") from None
    except (OSError, ValueError, RecursionError) as err:
        raise UserError(f"{where}: {config_file} is not readable JSON ({_one_line(err)}).") from None
    if not isinstance(raw, dict):
        raise UserError(f"{where}: {config_file} holds a JSON {type(raw).__name__}, not an object of settings.")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (MemoryError, RecursionError):
        raise
    except Exception as err:  # transformers raises many types for a bad value (TypeError, ZeroDivisionError, ...)
        raise UserError(f"{where}: transformers refuses {config_file}: {type(err).__name__}: "
                        f"{_one_line(err)}") from None
    shapes = _safetensors_shapes(path, where)
    if getattr(config, "quantization_config", None) is None:  # quantized weights are packed: other shapes
        _check_shapes(config, shapes, where, trust_remote_code)


def _safetensors_shapes(path: Path, where: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the headers of the folder's safetensors files."""
    from safetensors import SafetensorError, safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_bytes().decode("utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
            raise UserError(f"{where}: {index} is not a readable safetensors index ({type(err).__name__}: "
                            f"{_one_line(err)}).") from None
        files = [path / shard for shard in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{where}: {index.name} names {len(missing)} weight file(s) the folder lacks "
                            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); the download or "
                            "copy is incomplete.")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{where}: no *.safetensors weights in {path} (novarl loads safetensors weights only).")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as weights:
                for name in weights.keys():  # noqa: SIM118 -- safe_open is not a mapping
                    shapes[name] = tuple(weights.get_slice(name).get_shape())
        except (SafetensorError, OSError, ValueError) as err:
            raise UserError(f"{where}: {file} is not a readable safetensors file ({_one_line(err)}); the file is "
                            "damaged or incomplete: copy or download it again.") from None
    return shapes


def _check_shapes(config, shapes: dict[str, tuple[int, ...]], where: str, trust_remote_code: bool) -> None:
    """The shapes of a model built from `config` on the meta device (no memory) against the
    weights' shapes. Tensors under names only one side has are left to transformers."""
    from transformers import AutoModelForCausalLM

    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > len(shapes):  # also keeps the meta build below bounded
        raise UserError(f"{where}: config.json says num_hidden_layers={layers}, but the weights hold "
                        f"{len(shapes)} tensors in all: config.json does not describe these weights.")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (MemoryError, RecursionError):
        raise
    except Exception as err:
        raise UserError(f"{where}: transformers cannot build a causal language model from its config.json: "
                        f"{type(err).__name__}: {_one_line(err)}") from None
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
    pairs: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # name -> (by config.json, in the weights)
    for name, held in shapes.items():
        key = name if name in expected else prefix + name
        if key in expected:
            pairs[name] = (expected[key], held)
    wrong = [(name, made, held) for name, (made, held) in pairs.items() if made != held]
    if wrong:
        name, made, held = wrong[0]
        raise UserError(f"{where}: config.json does not match the weights: {len(wrong)} of {len(pairs)} tensors "
                        f"differ, e.g. {name} is {list(held)} in the weights but {list(made)} by config.json. "
                        "Use the config.json that came with these weights.")
    if not pairs:
        raise UserError(f"{where}: the weights hold none of the tensors of the {type(model).__name__} that "
                        f"config.json describes (it has {next(iter(expected), 'none')}, the weights "
                        f"{next(iter(shapes))}): config.json and the weights belong to different models.")
    missing = _missing_parameters(model, {key for name in pairs for key in (name, prefix + name)})
    if missing and len(pairs) == len(shapes):  # tensors under other names may be converted: left to transformers
        raise UserError(f"{where}: the weights lack {len(missing)} tensor(s) of the model config.json describes, "
                        f"e.g. {missing[0]} (transformers would start them from random values). Use the "
                        "config.json that came with these weights.")


def _missing_parameters(model, found: set[str]) -> list[str]:
    """Parameters of `model` not in `found`, except tied copies and those the model says may be absent."""
    import re

    tied = set(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or ())
    optional = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or ())]
    return sorted(name for name, _ in model.named_parameters()
                  if name not in found and name not in tied and not any(p.search(name) for p in optional))


def _one_line(err: Exception, limit: int = 400) -> str:
    """The whole message on one line, at most `limit` characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, L] log p(input_ids[:, t] | input_ids[:, :t]) from logits [B, L, V]; position 0 is 0.

    Logits are divided by the sampling temperature so that the ratio the loss
    uses is between the same distributions the generator sampled from.
    """
    from novarl.models.scores import token_scores

    return torch.nn.functional.pad(token_scores(logits[:, :-1], input_ids[:, 1:], temperature), (1, 0))


@dataclass(frozen=True)
class ExportFormat:
    """How a Hugging Face folder is written."""

    dtype: str = "float32"
    """The weights' dtype: the run's precision (a bf16 policy is a bf16 folder, half the size)."""
    safetensors: bool = True
    """False: PyTorch's pickle format, one pytorch_model.bin (checkpointing.model_save_format: torch_save)."""
    max_shard_size: str = "5GB"
    """Larger models are written in shards of at most this size, with an index."""


def export_format(policy_precision: str | None, model_save_format: str | None, *, on_gpu: bool) -> ExportFormat:
    """The format of exported folders: policy.precision (unset: bf16 on a CUDA host, fp32 on CPU,
    as training runs), checkpointing.model_save_format (safetensors unless torch_save)."""
    from novarl.models.scores import training_precision

    return ExportFormat(dtype=training_precision(policy_precision, on_gpu=on_gpu),
                        safetensors=model_save_format != "torch_save")


def save_hf_folder(path, model_config, state: dict, tokenizer, fmt: ExportFormat | None = None,
                   auto_class: str = "AutoModelForCausalLM") -> None:
    """Write full weights `state` (Hugging Face names) as a Hugging Face folder in `fmt` (fp32
    safetensors by default; shards with an index past fmt.max_shard_size), with the tokenizer:
    what transformers and vLLM load as is. auto_class: the transformers class the folder is
    for (a critic's: AutoModelForTokenClassification)."""
    import torch
    import transformers

    fmt = fmt or ExportFormat()
    dtype = getattr(torch, fmt.dtype)
    with torch.device("meta"):
        plain = getattr(transformers, auto_class).from_config(model_config, dtype=dtype)
    missing, unexpected = plain.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    plain.tie_weights()  # a tied copy (lm_head.weight) may be absent: it is the embedding
    tied = plain._tied_weights_keys or ()
    if unexpected or any(key not in tied for key in missing):
        raise RuntimeError(f"weights do not match {type(plain).__name__}: missing {missing}, unexpected {unexpected}")
    plain.config.dtype = dtype
    if fmt.safetensors:
        plain.save_pretrained(path, max_shard_size=fmt.max_shard_size)
    else:  # transformers 5 writes safetensors only: PyTorch's format, one file, as transformers reads it
        Path(path).mkdir(parents=True, exist_ok=True)
        plain.config.save_pretrained(path)
        if plain.generation_config is not None:
            plain.generation_config.save_pretrained(path)
        torch.save({k: v.contiguous() for k, v in plain.state_dict().items()}, Path(path) / "pytorch_model.bin")
    tokenizer.save_pretrained(path)
