"""The Megatron backend's checkpoints (<role>/megatron/: every rank's model shard and optimizer
state, and the layout that wrote them): their files checked, and a role exported as a Hugging
Face folder, joined offline with the conversion's name mapping (no process group, no
megatron-core)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from novarl.backends.megatron.convert import experts_file
from novarl.backends.spec import HfExport
from novarl.errors import loading_checkpoint

CHECKPOINT_DIR = "megatron"
"""A role's Megatron files go to <checkpoint>/<role>/megatron/."""
LAYOUT_FILE = "layout.json"


def files_problem(folder: Path, role: str, *, verify: bool) -> str | None:
    """Every shard, expert part and optimizer state the saved layout says there are; all load with
    weights_only=True, so nothing is to be read before."""
    folder = folder / CHECKPOINT_DIR
    try:
        layout = json.loads((folder / LAYOUT_FILE).read_text())
        tp, pp, dp = (int(layout["parallel"][k]) for k in ("tp", "pp", "dp"))
        cp = int(layout["parallel"].get("cp", 1))
        ep = int(layout["parallel"].get("ep", 1)) if layout.get("experts") else 0
        etp = int(layout["parallel"].get("etp", 1))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
        return f"Megatron layout unreadable: {err}"
    for p in range(pp):
        for t in range(tp):
            if not (folder / f"model_tp{t}_pp{p}.pt").is_file():
                return f"Megatron model shard tp{t}_pp{p} missing"
        for e, r in itertools.product(range(ep), range(etp)):
            if not (folder / experts_file(e, p, r, etp)).is_file():
                return f"Megatron experts of expert-parallel rank {e}" + (f", expert-tensor-parallel rank {r}"
                                                                         if etp > 1 else "") + f", stage {p} missing"
    for rank in range(tp * pp * cp * dp):
        if not (folder / f"optim_rank{rank}.pt").is_file():
            return f"Megatron optimizer state of rank {rank} missing"
    if not (folder / "scheduler.pt").is_file():
        return "scheduler state missing"
    return None


def export_hf(export: HfExport) -> None:
    """The Megatron model shards (every tensor-parallel rank of every pipeline stage, and every
    expert-parallel rank's experts), joined offline with the conversion's name mapping; no
    process group, no megatron-core. critic: PPO's critic, whose last stage holds a scalar head
    (the same on every tensor-parallel rank) where the output layer was."""
    import dataclasses

    import torch
    from transformers import AutoConfig

    from novarl.backends.megatron.convert import LayerShape, join_expert_tensor_parts, shards_to_hf
    from novarl.models.loading import save_hf_folder

    folder, critic, tokenizer, fmt = export.folder / CHECKPOINT_DIR, export.critic, export.tokenizer, export.fmt
    with loading_checkpoint(export.folder.parent):
        layout = json.loads((folder / LAYOUT_FILE).read_text())
        tp, pp, ep, etp = (layout["parallel"].get(k, 1) for k in ("tp", "pp", "ep", "etp"))
        parts = [(t, p, torch.load(folder / f"model_tp{t}_pp{p}.pt", weights_only=True))
                 for t in range(tp) for p in range(pp)]
        experts = {}
        for e in range(ep if layout.get("experts") else 0):
            for p in range(pp):
                experts.update(join_expert_tensor_parts([
                    torch.load(folder / experts_file(e, p, r, etp), weights_only=True) for r in range(etp)]))
    model_config = AutoConfig.from_pretrained(export.model_path)
    shape = LayerShape.from_hf_config(model_config)
    head = {}
    if critic:
        head = {name.replace("output_layer.", "lm_head."): tensor for name, tensor in parts[pp - 1][2].items()
                if name.startswith("output_layer.")}  # (tp 0, the last stage)
        parts = [(t, p, {n: x for n, x in state.items() if not n.startswith("output_layer.")}) for t, p, state in parts]
        shape = dataclasses.replace(shape, tied=True)  # no vocabulary head to join: the scalar one replaces it
    state = {**shards_to_hf(parts, shape, tensor_parallel_size=tp, fused_norms=layout["fused_norms"],
                            experts=experts), **head}
    if critic:
        from novarl.models.critic import save_critic_hf

        export.save(export.output, lambda tmp: save_critic_hf(tmp, model_config, state, tokenizer, fmt))
    else:
        export.save(export.output, lambda tmp: save_hf_folder(tmp, model_config, state, tokenizer, fmt))
