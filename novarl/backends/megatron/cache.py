"""Converted Megatron checkpoints, made once per (model, tensor-parallel size) and reused.

Where (seed 002's order and names): `NRL_MEGATRON_CHECKPOINT_DIR` (novarl's own
`NOVARL_MEGATRON_CHECKPOINT_DIR` is an alias), else `$HF_HOME/nemo_rl`, else
`~/.cache/huggingface/nemo_rl`. Each conversion is a folder

    <root>/<model name>-<fingerprint>/tp<T>/rank_<r>.pt + manifest.json

written under a temporary name and renamed when complete, so a crash never leaves
a folder that passes for a conversion. The fingerprint hashes the source's
config.json and the names, sizes and modification times of its weight files:
when the source changes, a new folder is made (a stale one is never read), and
a folder whose manifest does not match what it holds is redone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from novarl.backends.megatron.convert import LayerShape, hf_to_megatron, shard
from novarl.logging.console import info

MANIFEST = "manifest.json"
FORMAT = 1


CHECKPOINT_DIR_VARIABLES = ("NRL_MEGATRON_CHECKPOINT_DIR", "NOVARL_MEGATRON_CHECKPOINT_DIR")
"""Where converted checkpoints go: seed 002's variable, then novarl's alias for it."""


def checkpoint_root() -> tuple[Path, str]:
    """(folder, which setting chose it)."""
    for variable in CHECKPOINT_DIR_VARIABLES:
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser(), variable
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "nemo_rl", "HF_HOME"
    return Path("~/.cache/huggingface/nemo_rl").expanduser(), "the default"


def fingerprint(model_dir: Path) -> str:
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def converted_checkpoint(model_dir: str | Path, *, tensor_parallel_size: int, fused_norms: bool = False) -> Path:
    """The folder holding `model_dir`'s weights as Megatron tensor-parallel shards:
    reused when complete and current, converted (and logged) otherwise."""
    model_dir = Path(model_dir)
    _, chosen_by = checkpoint_root()
    folder, expected = conversion_folder(model_dir, tensor_parallel_size=tensor_parallel_size, fused_norms=fused_norms)
    problem = check_conversion(folder, expected)
    if problem is None:
        info(f"Megatron weights for {model_dir.name} (TP={tensor_parallel_size}): {folder} (cached; the folder "
             f"comes from {chosen_by})")
        return folder
    if folder.exists():
        info(f"redoing the Megatron conversion in {folder}: {problem}")
    info(f"converting {model_dir.name} to Megatron (TP={tensor_parallel_size}) into {folder} (the folder comes from "
         f"{chosen_by})")
    _convert(model_dir, folder, expected)
    return folder


def conversion_folder(model_dir: str | Path, *, tensor_parallel_size: int,
                      fused_norms: bool = False) -> tuple[Path, dict]:
    """(where `model_dir`'s conversion lives, what its manifest must say)."""
    model_dir = Path(model_dir)
    root, _ = checkpoint_root()
    folder = root / f"{model_dir.name}-{fingerprint(model_dir)}" / f"tp{tensor_parallel_size}{'-te' * fused_norms}"
    expected = {"format": FORMAT, "source": str(model_dir.resolve()), "tensor_parallel_size": tensor_parallel_size,
                "fused_norms": fused_norms}
    return folder, expected


def conversion_ready(model_dir: str | Path, *, tensor_parallel_size: int, fused_norms: bool = False) -> Path | None:
    """The folder of a complete, current conversion, or None; nothing is converted or logged."""
    folder, expected = conversion_folder(model_dir, tensor_parallel_size=tensor_parallel_size, fused_norms=fused_norms)
    return folder if check_conversion(folder, expected) is None else None


def check_conversion(folder: Path, expected: dict) -> str | None:
    """None when `folder` is a complete conversion made as `expected` says, else what is wrong."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return "no manifest (never finished)" if folder.exists() else "not converted yet"
    try:
        saved = json.loads(manifest.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return f"unreadable manifest ({err})"
    if {k: saved.get(k) for k in expected} != expected:
        return "made with other settings"
    shards = [folder / f"rank_{r}.pt" for r in range(expected["tensor_parallel_size"])]
    sizes = saved.get("sizes", {})
    for path in shards:
        if not path.is_file() or path.stat().st_size != sizes.get(path.name):
            return f"{path.name} missing or not the size written"
    return None


def load_shard(folder: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(folder / f"rank_{rank}.pt", weights_only=True, map_location="cpu")


def _convert(model_dir: Path, folder: Path, manifest: dict) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = LayerShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    tp = manifest["tensor_parallel_size"]
    full = hf_to_megatron(hf, shape, tensor_parallel_size=tp, fused_norms=manifest["fused_norms"])
    tmp = folder.with_name(f".tmp_{folder.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sizes = {}
    for rank in range(tp):
        path = tmp / f"rank_{rank}.pt"
        torch.save(shard(full, rank=rank, tensor_parallel_size=tp), path)
        sizes[path.name] = path.stat().st_size
    (tmp / MANIFEST).write_text(json.dumps({**manifest, "sizes": sizes, "vocab_size": shape.vocab_size}, indent=2))
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
