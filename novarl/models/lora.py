"""LoRA adapters (NeMo RL's `policy.dtensor_cfg.lora_cfg`), built from PEFT's LoRA layers.

The adapters are injected into the Hugging Face model in place (module paths stay as they
are, so tensor and data parallelism still find the decoder layers); the base weights are
frozen, so the optimizer and the checkpoints hold the adapters alone. What leaves training
is the merged model, W + (alpha / r) x B A per adapted layer: the weight sync to the
generation engines (streamed, one layer at a time) and the Hugging Face export; the export
also writes the adapter as a PEFT folder (`adapter/`) that `PeftModel.from_pretrained` loads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from novarl.config.schema import VLLM_LORA_RANKS, LoraConfig

ADAPTER = "default"
"""PEFT's adapter name (the one adapter novarl trains)."""


def peft_config(cfg: LoraConfig, base_model: str | None = None):
    from peft import LoraConfig as PeftLoraConfig

    targets = "all-linear" if cfg.match_all_linear or not cfg.target_modules else list(cfg.target_modules)
    # PEFT drops the adapter's input ("pre"); "post" with dropout is refused by the schema
    dropout = cfg.dropout if cfg.dropout_position == "pre" else 0.0
    return PeftLoraConfig(r=cfg.dim, lora_alpha=cfg.alpha, lora_dropout=dropout, target_modules=targets,
                          exclude_modules=list(cfg.exclude_modules) or None, bias="none",
                          base_model_name_or_path=base_model)


def inject(model: torch.nn.Module, cfg: LoraConfig, seed: int = 0) -> list[str]:
    """Add LoRA layers to `model` in place and freeze everything else; the adapted modules' names.
    lora_A starts as NeMo RL's `lora_A_init` says (xavier: Xavier-normal; uniform: Kaiming-uniform,
    PEFT's own), drawn from `seed` alone, so every rank and every layout starts from the same
    adapters; lora_B at zero, so the model starts as the base model."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(peft_config(cfg), model, adapter_name=ADAPTER)
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    adapted = []
    for name, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if isinstance(lora_a, torch.nn.ModuleDict) and ADAPTER in lora_a:
            adapted.append(name)
            weight = lora_a[ADAPTER].weight
            values = torch.empty(weight.shape, dtype=torch.float32)  # drawn on the CPU: one stream anywhere
            if cfg.lora_A_init == "xavier":
                torch.nn.init.xavier_normal_(values, generator=generator)
            else:
                torch.nn.init.kaiming_uniform_(values, a=math.sqrt(5), generator=generator)
            with torch.no_grad():
                weight.copy_(values)
            weight.requires_grad_(True)
            module.lora_B[ADAPTER].weight.requires_grad_(True)
    if not adapted:
        raise ValueError("no module of the model matched policy.dtensor_cfg.lora_cfg's target_modules")
    return adapted


def scaling(cfg: LoraConfig) -> float:
    return cfg.alpha / cfg.dim


def merged(items: Iterable[tuple[str, torch.Tensor]], scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's own (Hugging Face) weights from a LoRA model's full tensors, in order: each
    adapted layer's `x.base_layer.weight` comes back as `x.weight` + scale x B @ A (in float32,
    then the base weight's dtype) once its lora_A and lora_B have passed; other tensors as they
    are. Only one layer's tensors are held at a time (a layer's base, A and B come together)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in items:
        if ".base_layer." in name:
            prefix, _, leaf = name.partition(".base_layer.")
            if leaf != "weight":
                yield f"{prefix}.{leaf}", tensor
                continue
            pending.setdefault(prefix, {})["base"] = tensor
        elif is_adapter(name):
            prefix = name.split(".lora_")[0]
            pending.setdefault(prefix, {})["A" if f".lora_A.{ADAPTER}." in name else "B"] = tensor
        else:
            yield name, tensor
            continue
        if len(pending[prefix]) == 3:
            parts = pending.pop(prefix)
            delta = scale * (parts["B"].float() @ parts["A"].float())
            yield f"{prefix}.weight", (parts["base"].float() + delta).to(parts["base"].dtype)
    if pending:
        raise RuntimeError(f"LoRA layers without both adapters: {sorted(pending)[:3]}")


def is_adapter(name: str) -> bool:
    """Whether a training model's tensor name is one of the adapters' (lora_A or lora_B)."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def adapter_state(items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's saved names (base_model.model.<path>.lora_A.weight)."""
    return {f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}": tensor.contiguous()
            for name, tensor in items if is_adapter(name)}


def save_adapter(folder: Path, state: dict[str, torch.Tensor], cfg: LoraConfig, base_model: str) -> int:
    """A PEFT adapter folder: adapter_config.json and adapter_model.safetensors. The number of
    adapter tensors written."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    peft_config(cfg, base_model).save_pretrained(str(folder))
    tensors = adapter_state(state.items())
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return len(tensors)


def trainable_summary(model: torch.nn.Module, adapted: list[str], cfg: LoraConfig) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return (f"LoRA r={cfg.dim}, alpha={cfg.alpha:g} on {len(adapted)} linear layers: {trainable:,} trainable "
            f"parameters of {total:,} ({trainable / total:.2%}); the optimizer state and checkpoints hold these only")


def hf_weights(items: Iterable[tuple[str, torch.Tensor]], cfg: LoraConfig | None
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's own (Hugging Face) tensors from a training model's full ones: as they are
    without LoRA (cfg None), merged with it (see `merged`)."""
    return iter(items) if cfg is None else merged(items, scaling(cfg))


def vllm_max_lora_rank(cfg: LoraConfig) -> int:
    fitting = [rank for rank in VLLM_LORA_RANKS if rank >= cfg.dim]
    if not fitting:
        raise ValueError(f"policy.dtensor_cfg.lora_cfg.dim={cfg.dim} is above vLLM's largest LoRA rank "
                         f"({VLLM_LORA_RANKS[-1]}); set policy.generation.lora_sync: merged")
    return fitting[0]


def save_hf(path: Path, model_config, state: dict[str, torch.Tensor], tokenizer, fmt, cfg: LoraConfig | None
            ) -> None:
    """The Hugging Face folder of a training model's full state: with LoRA the merged model, and
    the adapter alone, as PEFT saves it, in `adapter/`."""
    from novarl.models.loading import save_hf_folder

    save_hf_folder(path, model_config, dict(hf_weights(state.items(), cfg)), tokenizer, fmt)
    if cfg is not None:
        save_adapter(Path(path) / "adapter", state, cfg, model_config.name_or_path)


@contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` as its frozen base: every LoRA layer computes its base layer alone. PEFT's
    own switch (enable_adapters) would also flip the adapters' requires_grad, which the sharded
    parameters' owners (FSDP2, ZeRO) set up once; its flag alone is what the forward reads."""
    layers = [module for module in model.modules() if hasattr(module, "_disable_adapters")
              and isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict)]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


class BaseModelLogprobs:
    """Mixin for a LoRA policy on DTensor or DeepSpeed (needs `.model` and `.forward`): the
    base model's logprobs, the adapters off -- the reference policy of a LoRA run, with no
    second copy of the model (see BaseReference)."""

    def base_forward(self, batch, head) -> torch.Tensor:
        """Collective, like forward: [N] per-token scores (models/scores.py) of the frozen base model."""
        with adapters_off(self.model):
            return self.forward(batch, head)


class BaseReference:
    """Implements ReferenceBackend for a LoRA run: the policy's own base model (its adapters off),
    in the policy's processes, on its devices and shards; the base never trains, so it is the
    model the run started from."""

    def __init__(self, policy) -> None:
        self.policy = policy

    def forward(self, batch, head) -> torch.Tensor:
        return self.policy.base_forward(batch, head)
