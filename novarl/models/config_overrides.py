"""policy.hf_config_overrides (NeMo RL's key): keys of the model's config.json replaced for the
whole run, as transformers' `from_pretrained(path, **overrides)` replaces them (a top-level key's
value whole, a dict such as rope_scaling included).

Training, generation (vLLM reads the folder's config.json too), Megatron's conversion and the
exported Hugging Face folder must all see the same config, so `novarl train` hands them one
folder: `with_overrides` makes it in novarl's cache, the model's config.json with the overrides
and a link to each of the model's other files (weights, tokenizer), once per model and overrides.
`validate` and `plan` read the overridden config without writing anything (`overridden`).
Imports no torch."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from novarl.errors import UserError

FOLDER = "models"
"""Under novarl's cache folder: the overridden models' folders."""


def overridden(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json's settings with `overrides`' keys replacing (or adding) theirs."""
    return {**config, **overrides}


def read_config(folder: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`folder`'s config.json with `overrides`; OSError or ValueError where it cannot be read as a
    JSON object."""
    loaded = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    if not isinstance(loaded, dict):
        raise ValueError(f"config.json holds a JSON {type(loaded).__name__}, not an object")
    return overridden(loaded, overrides or {})


def with_overrides(folder: str, overrides: Mapping[str, Any], *, key: str = "policy.hf_config_overrides") -> str:
    """The folder of `folder`'s model with its config.json overridden (`folder` itself without
    overrides): in novarl's cache, named by the model's folder, its files' names, its config.json and
    the overrides, made once (written aside and renamed into place, so concurrent runs agree on it).
    Its other files are links to `folder`'s, which must stay where they are (a hub id's are
    downloaded first). UserError naming `key` where `folder`'s config.json cannot be read."""
    if not overrides:
        return folder
    from novarl.logging.quiet import cache_dir
    from novarl.models.locate import download_snapshot

    if not Path(folder).is_dir():
        folder = download_snapshot(folder)

    source = Path(folder).resolve()
    try:
        raw = (source / "config.json").read_bytes()
        config = read_config(source, overrides)
    except (OSError, ValueError) as err:
        raise UserError(f"{key}: cannot read {source / 'config.json'} to override it ({err}).") from None
    names = "\n".join(sorted(entry.name for entry in source.iterdir())).encode()  # a folder saved again differs
    given = json.dumps(overrides, sort_keys=True).encode()
    digest = hashlib.sha256(b"\0".join([str(source).encode(), raw, names, given]))
    target = cache_dir() / FOLDER / f"{source.name}-{digest.hexdigest()[:16]}"
    if (target / "config.json").is_file():
        return str(target)
    staging = target.with_name(f"{target.name}.{os.getpid()}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.name != "config.json":
            (staging / entry.name).symlink_to(entry.resolve())
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    try:
        staging.rename(target)
    except OSError as err:  # another process made it first (theirs is the same), or the cache refuses it
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise UserError(f"{key}: cannot make the overridden model's folder {target} ({err}).") from None
    return str(target)
