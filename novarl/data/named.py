"""Which source, split and fields each data split reads, NeMo RL's named math datasets included.

A named dataset (`data.dataset_name: OpenMathInstruct-2`, NeMo RL's `data.train.dataset_name`;
the table is config/named_datasets.py) is a hub dataset with fixed fields: the prompt is the
user's turn, the answer what the reward compares against. Imports no torch: `novarl validate`
resolves the same specs `novarl train` reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from novarl.config.named_datasets import NAMED_DATASETS, NamedDataset  # noqa: F401 (re-exported)
from novarl.config.schema import BUNDLED_TASKS, DataConfig

NEMO_RL_PROMPTS = Path(__file__).parent / "prompts" / "nemo_rl"
"""NeMo RL's math prompt files (cot.txt, math.txt), shipped for its recipes (README there)."""


@dataclass(frozen=True)
class SplitSpec:
    """What one data source of a split reads: a file, folder or hub id (`text`), which of its
    splits, and which fields."""

    where: str
    """How messages name it: "data.train_data_path='x.jsonl'"."""
    text: str
    subsets: tuple[str | None, ...]
    split: str | None
    fallback_splits: tuple[str, ...]
    input_key: str
    output_key: str
    answer_after: str | None = None
    held_out: float = 0.0
    """A training source: this fraction of its examples is held out for evaluation."""
    repeat: int = 1
    """A validation source: each example this many times."""
    from_training: bool = False
    """A validation source that is the training source (its validation, test or training split)."""
    domain: str | None = None
    """Its examples' reward domain (its block's env_name), where a row has no `domain` of its own."""


def split_specs(data: DataConfig, split: str) -> list[SplitSpec]:
    """The sources of `split` ("train" or "validation"); [] for a bundled task. For validation:
    the sources given (data.validation, val_dataset_name, val_data_path); else [] when training
    sources hold a fraction out; else the training sources' validation or test split when they
    have one, or their training split (from_training: held_out_gap says so)."""
    name = data.dataset_name
    if data.train is None and (name in BUNDLED_TASKS or (name is None and not data.train_data_path)):
        return []
    if data.train is not None:
        train = [_spec(data, b.dataset_name, b.data_path, b.split, "train", f"data.train[{i}]", b.input_key,
                       b.output_key, b.subset, held_out=_fraction(b.split_validation_size, data), domain=b.env_name)
                 for i, b in enumerate(data.train)]
    else:
        train = [_spec(data, name, data.train_data_path, data.train_split, "train",
                       held_out=data.split_validation_size)]
    if split == "train":
        return train
    if data.validation is not None:
        return [_spec(data, b.dataset_name, b.data_path, b.split, "validation", f"data.validation[{i}]",
                      b.input_key, b.output_key, b.subset, repeat=b.repeat, domain=b.env_name)
                for i, b in enumerate(data.validation)]
    if data.val_dataset_name is not None:
        return [_spec(data, data.val_dataset_name, None, data.val_split, "validation")]
    if data.val_data_path:
        return [_spec(data, "ResponseDataset", data.val_data_path, data.val_split, "validation")]
    if any(t.held_out for t in train):
        return []
    return [SplitSpec(t.where, t.text, t.subsets, data.val_split,
                      (data.val_split,) if data.val_split else ("validation", "test", t.split or "train"),
                      t.input_key, t.output_key, t.answer_after, from_training=True, domain=t.domain) for t in train]


def _fraction(block: float | None, data: DataConfig) -> float:
    return data.split_validation_size if block is None else block


def _spec(data: DataConfig, name: str | None, path: str | None, split: str | None, role: str,
          block: str | None = None, input_key: str | None = None, output_key: str | None = None,
          subset: str | None = None, *, held_out: float = 0.0, repeat: int = 1, domain: str | None = None
          ) -> SplitSpec:
    named = NAMED_DATASETS.get(name or "")
    given = data.model_fields_set  # keys given in the config win over a named dataset's own fields
    if named is None:
        setting = f"{block}.data_path" if block else "data.train_data_path" if role == "train" else \
            "data.val_data_path"
        fallback = ("train",) if role == "train" else ("validation", "test", "train")
        return SplitSpec(f"{setting}='{path}'", str(path), (subset or data.subset,), split, fallback,
                         input_key or data.input_key, output_key or data.output_key, held_out=held_out,
                         repeat=repeat, domain=domain)
    setting = f"{block}.dataset_name" if block else "data.dataset_name" if role == "train" else \
        "data.val_dataset_name"
    return SplitSpec(f"{setting}='{name}' (hub dataset '{named.repo_id}')", named.repo_id, named.subsets,
                     split or named.split, (named.split,),
                     input_key or (data.input_key if "input_key" in given else named.input_key),
                     output_key or (data.output_key if "output_key" in given else named.output_key),
                     named.answer_after, held_out=held_out, repeat=repeat, domain=domain)


def prompt_file(path: str, setting: str) -> tuple[str, str | None]:
    """(the file to read, a note or None): a NeMo RL recipe's 'examples/prompts/<name>.txt' that
    does not exist here is the copy novarl ships."""
    parts = PurePosixPath(path).parts
    try:
        here = Path(path).expanduser().is_file()
    except (OSError, ValueError):
        here = False
    if here or parts[-3:-1] != ("examples", "prompts") or not (NEMO_RL_PROMPTS / parts[-1]).is_file():
        return path, None
    return str(NEMO_RL_PROMPTS / parts[-1]), (f"{setting}='{path}' is not here: reading NeMo RL's {parts[-1]}, "
                                              "which novarl ships (NeMo RL 7ea279a)")
