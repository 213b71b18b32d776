"""Where a split's rows are: which files to read for a data setting. Imports no torch, and
reads no rows (novarl/data/datasets.py does).

A data setting (`data.train_data_path`, `data.val_data_path`, or the hub id behind a named
dataset) is one of
- a data file: .jsonl, .json (lines or one array), .parquet, .arrow, .csv;
- a folder `datasets` wrote with `save_to_disk` (a DatasetDict's `dataset_dict.json` with a
  folder per split, or a Dataset's `state.json` beside its .arrow shards);
- a folder of data files laid out as a Hugging Face dataset repository is (a downloaded
  repository, or a snapshot in the hub cache): splits as its README's `configs:` declare
  them, else by the names the hub recognises (train, validation/valid/val/dev,
  test/eval) in the file and folder names, else every file is "train";
- a hub dataset id (`org/name`), read from the local caches: the hub cache's snapshot
  (what `huggingface-cli download --repo-type dataset`, and `novarl train`, put there),
  else the arrow files `datasets.load_dataset` prepared under $HF_DATASETS_CACHE. When
  neither holds the split, `novarl train` downloads just that split's files;
  `novarl validate` only says so.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from novarl.errors import UserError

FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
"""Data file suffixes and how each is read."""

SPLIT_NAMES = {"train": ("train", "training"), "validation": ("validation", "valid", "val", "dev"),
               "test": ("test", "testing", "eval", "evaluation")}
"""The split names the hub recognises in file and folder names, by split."""

_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.")


class NotInCache(UserError):
    """A hub dataset whose split is in no local cache: `novarl train` downloads it."""


class SplitMissing(UserError):
    """The data has no such split, or none of its files are here (in a hub snapshot: not yet
    downloaded)."""


@dataclass(frozen=True)
class Source:
    """The files that hold one split, and how to name them to a person."""

    files: tuple[Path, ...]
    label: str
    """For messages: "data.dataset_name='OpenMathInstruct-2' (hub dataset 'nvidia/OpenMathInstruct-2') (split
    'train_1M') from the hub cache"."""
    arrow_stream: bool = False
    """The .arrow files are IPC streams, as `datasets` writes them (else Arrow files)."""


def locate(text: str, where: str, *, split: str | None = None, subset: str | None = None,
           fallback_splits: tuple[str, ...] = ("train",), download: bool = False) -> Source:
    """The files of `split` (None: the first of `fallback_splits` the data has) of the file,
    folder or hub id `text`; messages start with `where` (the setting: "data.train_data_path=
    'x.jsonl'"). A hub id in no cache raises NotInCache unless `download`."""
    path = Path(text).expanduser()
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except (OSError, ValueError) as err:  # a name too long, a folder that may not be entered, a NUL byte
        raise UserError(f"{where}: cannot open it ({getattr(err, 'strerror', None) or err}).") from None
    if is_file:
        return _file_source(path, where, split, subset)
    if is_dir:
        return folder_source(path, where, split, subset, fallback_splits)
    if is_hub_id(text):
        return hub_source(text, where, split=split, subset=subset, fallback_splits=fallback_splits,
                          download=download)
    raise UserError(f"{where}: no such file or folder (nor a hub dataset id 'org/name'). Give a "
                    f"data file ({', '.join(FORMATS)}), a folder saved by `datasets`, or a hub dataset id.")


def is_hub_id(text: str) -> bool:
    """'org/name' that cannot be a data file's path."""
    return (re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) is not None
            and Path(text).suffix.lower() not in FORMATS and not text.startswith("."))


def _file_source(path: Path, where: str, split: str | None, subset: str | None) -> Source:
    if path.suffix.lower() not in FORMATS:
        raise UserError(f"{where}: unknown format '{path.suffix}'; use {', '.join(FORMATS)}.")
    if subset is not None or split not in (None, "train"):
        asked = f"subset '{subset}'" if subset is not None else f"split '{split}'"
        raise UserError(f"{where} is one file, which has no {asked}: give the split's own file, "
                        "or a folder or hub dataset with splits.")
    return Source(files=(path,), label=where)


# ------------------------------------------------------------ folders
def folder_source(folder: Path, where: str, split: str | None, subset: str | None,
                  fallback_splits: tuple[str, ...]) -> Source:
    """A `save_to_disk` folder, or a folder of data files as a hub repository lays them out."""
    if (folder / "dataset_dict.json").is_file():
        splits = [str(s) for s in _json(folder / "dataset_dict.json", where).get("splits", [])]
        name = _pick_split(splits, split, fallback_splits, where)
        return _saved_dataset(folder / name, f"{where} (split '{name}')")
    if (folder / "state.json").is_file():
        if split not in (None, "train"):
            raise UserError(f"{where} is one saved Dataset, which has no split '{split}'.")
        return _saved_dataset(folder, where)
    names = sorted(p.relative_to(folder).as_posix() for p in _data_files(folder))
    if not names:
        raise SplitMissing(f"{where}: the folder has no data files ({', '.join(FORMATS)}) and is not one `datasets` "
                        "saved (dataset_dict.json or state.json).")
    readme = folder / "README.md"
    card = readme.read_text(encoding="utf-8", errors="replace") if readme.is_file() else None
    name, files = split_files(names, card, split, subset, fallback_splits, where)
    _check_shards(files, where)
    return Source(files=tuple(folder / f for f in files), label=f"{where} (split '{name}')")


def _saved_dataset(folder: Path, where: str) -> Source:
    state = _json(folder / "state.json", where)
    files = [folder / str(f.get("filename")) for f in state.get("_data_files", []) if isinstance(f, dict)]
    missing = [f.name for f in files if not f.is_file()]
    if not files or missing:
        raise UserError(f"{where}: the saved dataset's state.json names "
                        + (f"missing files ({', '.join(missing[:3])})" if missing else "no data files") + ".")
    return Source(files=tuple(files), label=where, arrow_stream=True)


def _data_files(folder: Path) -> list[Path]:
    found = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(Path(root) / f for f in files if Path(f).suffix.lower() in FORMATS and not f.startswith("."))
    return found


def _json(path: Path, where: str) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"{where}: cannot read '{path}' ({err}).") from None
    if not isinstance(value, dict):
        raise UserError(f"{where}: '{path}' is not a JSON object.")
    return value


# ------------------------------------------------------------ splits
def split_files(names: list[str], card: str | None, split: str | None, subset: str | None,
                fallback_splits: tuple[str, ...], where: str) -> tuple[str, list[str]]:
    """(split, the data files of it) among `names` (paths relative to the repository): by the
    dataset card's `configs:` when it has them, else by split names in the paths."""
    configs = card_configs(card) if card else []
    if configs:
        chosen = _pick_subset(configs, subset, where)
        splits = chosen["data_files"]
    elif subset is not None:
        raise UserError(f"{where} has no subsets (its README declares no configs), so no subset '{subset}'.")
    else:
        splits = _splits_by_name(names)
    name = _pick_split(list(splits), split, fallback_splits, where)
    files = [n for n in names if any(_glob(pattern).fullmatch(n) for pattern in splits[name])]
    if not files:
        raise SplitMissing(f"{where}: split '{name}' has no data file here ({', '.join(splits[name])}).")
    return name, files


def card_configs(card: str) -> list[dict]:
    """The `configs:` of a dataset card's YAML header, each {config_name, default, data_files:
    {split: [patterns]}}."""
    from novarl.config.files import parse_yaml

    match = re.match(r"\A---\s*\n(.*?)\n---\s*(\n|\Z)", card, re.S)
    if not match:
        return []
    try:
        header = parse_yaml(match.group(1))
    except Exception:  # yaml's errors: a card the hub cannot read either, its data files are found by name
        return []
    configs = header.get("configs") if isinstance(header, dict) else None
    out = []
    for config in configs if isinstance(configs, list) else []:
        if isinstance(config, dict):
            out.append({"config_name": str(config.get("config_name", "default")),
                        "default": bool(config.get("default", False)),
                        "data_files": _data_file_patterns(config.get("data_files"))})
    return [c for c in out if c["data_files"]]


def _data_file_patterns(value: object) -> dict[str, list[str]]:
    if isinstance(value, str):
        return {"train": [value]}
    if not isinstance(value, list):
        return {}
    if all(isinstance(v, str) for v in value):
        return {"train": list(value)}
    splits: dict[str, list[str]] = {}
    for item in value:
        if isinstance(item, dict) and "split" in item and "path" in item:
            paths = item["path"] if isinstance(item["path"], list) else [item["path"]]
            splits.setdefault(str(item["split"]), []).extend(str(p) for p in paths)
    return splits


def _pick_subset(configs: list[dict], subset: str | None, where: str) -> dict:
    names = [c["config_name"] for c in configs]
    if subset is not None:
        if subset not in names:
            raise UserError(f"{where} has no subset '{subset}' (it has: {', '.join(names)}).")
        return configs[names.index(subset)]
    default = [c for c in configs if c["default"]] or [c for c in configs if c["config_name"] == "default"]
    if default:
        return default[0]
    if len(configs) == 1:
        return configs[0]
    raise UserError(f"{where} has several subsets ({', '.join(names)}): name one (data.subset, or the "
                    "dataset block's subset).")


def _splits_by_name(names: list[str]) -> dict[str, list[str]]:
    """The hub's rule without a card: a file is in a split when a split name stands in its
    path between separators (-._ digits /); when none does, every file is "train"."""
    splits: dict[str, list[str]] = {}
    for split, words in SPLIT_NAMES.items():
        pattern = re.compile(r"(^|[-._ 0-9/])(" + "|".join(words) + r")([-._ 0-9/])")
        matched = [n for n in names if pattern.search(n)]
        if matched:
            splits[split] = matched
    return splits or {"train": list(names)}


def _pick_split(splits: list[str], split: str | None, fallback_splits: tuple[str, ...], where: str) -> str:
    if split is not None:
        if split not in splits:
            raise SplitMissing(f"{where} has no split '{split}' (it has: {', '.join(splits) or 'none'}).")
        return split
    for name in fallback_splits:
        if name in splits:
            return name
    raise SplitMissing(f"{where} has no split {' or '.join(repr(s) for s in fallback_splits)} (it has: "
                    f"{', '.join(splits) or 'none'}): name one (data.train_split / data.val_split).")


def _glob(pattern: str) -> re.Pattern:
    """A hub data_files pattern ('data/train-*', '**/*.parquet', or a file's own name) as a
    regular expression."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            char = pattern[i]
            out += "[^/]*" if char == "*" else "[^/]" if char == "?" else re.escape(char)
            i += 1
    return re.compile(out)


def _check_shards(files: list[str], where: str) -> None:
    """'name-00000-of-00004.parquet' shards: all of them, or the split is incomplete (a partial
    download, or a cache that holds some shards only)."""
    groups: dict[tuple[str, str], set[int]] = {}
    for name in files:
        match = _SHARD.search(PurePosixPath(name).name)
        if match:
            key = (str(PurePosixPath(name).parent) + "/" + PurePosixPath(name).name[:match.start()], match.group(2))
            groups.setdefault(key, set()).add(int(match.group(1)))
    for (stem, total), have in groups.items():
        if len(have) < int(total):
            raise NotInCache(f"{where}: {len(have)} of the {int(total)} shards of '{stem}' are here.")


# ------------------------------------------------------------ the hub
def hub_source(repo_id: str, where: str, *, split: str | None, subset: str | None,
               fallback_splits: tuple[str, ...], download: bool) -> Source:
    """A hub dataset's split from the hub cache's snapshot, else from `datasets`' prepared
    cache, else (download=True) downloaded into the hub cache."""
    snapshot = _hub_snapshot(repo_id)
    problem: UserError | None = None
    if snapshot is not None:
        try:
            source = folder_source(snapshot, where, split, subset, fallback_splits)
            return Source(source.files, source.label + " from the hub cache", source.arrow_stream)
        except (NotInCache, SplitMissing) as err:  # a snapshot holds what was downloaded, maybe not this split
            problem = err
    prepared = prepared_source(repo_id, where, split=split, subset=subset, fallback_splits=fallback_splits)
    if prepared is not None:
        return prepared
    if not download:
        raise NotInCache(str(problem) if problem else
                         f"{where}: it is in no local cache (hub cache, $HF_DATASETS_CACHE).")
    return _download(repo_id, where, split, subset, fallback_splits)


def _hub_snapshot(repo_id: str) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or an id the hub would refuse
        return None


def datasets_cache() -> Path:
    """$HF_DATASETS_CACHE, else $HF_HOME/datasets, as `datasets` reads them."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HOME).expanduser() / "datasets"


def prepared_source(repo_id: str, where: str, *, split: str | None, subset: str | None,
                    fallback_splits: tuple[str, ...]) -> Source | None:
    """The arrow files `datasets.load_dataset(repo_id, subset)` prepared, newest first:
    <cache>/<org>___<name>/<subset or default>/<version>/<hash>/<builder>-<split>[-NNNNN-of-NNNNN].arrow,
    the split names in the dataset_info.json beside them. None when there are none."""
    folder = datasets_cache() / repo_id.replace("/", "___") / (subset or "default")
    candidates = sorted(folder.glob("*/*/dataset_info.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for info_file in candidates:
        info = _json(info_file, where)
        splits = list(info.get("splits") or {})
        try:
            name = _pick_split(splits, split, fallback_splits, where)
        except UserError:
            continue
        pattern = re.compile(r".*-" + re.escape(name) + r"(-\d{5}-of-\d{5})?\.arrow")
        files = sorted(p for p in info_file.parent.iterdir() if pattern.fullmatch(p.name))
        if files:
            return Source(files=tuple(files), label=f"{where} (split '{name}', prepared by `datasets`)",
                          arrow_stream=True)
    return None


def _download(repo_id: str, where: str, split: str | None, subset: str | None,
              fallback_splits: tuple[str, ...]) -> Source:
    """The split's files (and the card that names them), downloaded into the hub cache."""
    from huggingface_hub import HfApi, constants, hf_hub_download

    from novarl.models.locate import hub_offline, probe_hub

    fix = (f"Download it where there is access (hf download --repo-type dataset {repo_id}) and copy the cache, "
           "point HF_HOME or HF_HUB_CACHE at a cache that holds it, or give a local file or folder.")
    if hub_offline():
        raise UserError(f"{where}: the hub dataset is in no local cache, and HF_HUB_OFFLINE=1 forbids downloading "
                        f"it. {fix}")
    endpoint = os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")
    problem = probe_hub(endpoint, repo_id, "dataset")
    if problem is not None:
        raise UserError(f"{where}: the hub dataset is in no local cache, and the hub at {endpoint} cannot be "
                        f"reached ({problem}). {fix}")
    try:
        names = HfApi().list_repo_files(repo_id, repo_type="dataset")
        card = None
        if "README.md" in names:
            card = Path(hf_hub_download(repo_id, "README.md", repo_type="dataset")).read_text(
                encoding="utf-8", errors="replace")
        data = [n for n in names if PurePosixPath(n).suffix.lower() in FORMATS
                and not any(part.startswith(".") for part in PurePosixPath(n).parts)]
        name, files = split_files(sorted(data), card, split, subset, fallback_splits, where)
        paths = tuple(Path(hf_hub_download(repo_id, f, repo_type="dataset")) for f in files)
    except UserError:
        raise
    except Exception as err:  # no network, a private or missing repository, a full disk
        raise UserError(f"{where}: cannot download it from the hub ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}).") from None
    return Source(files=paths, label=f"{where} (split '{name}', downloaded)")
