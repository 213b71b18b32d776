"""The data's checks that need neither torch nor the network: the data names something novarl
reads (a bundled task, a named dataset, or files, folders and cached hub datasets whose splits
exist) and its prompt files are there. `novarl validate` lists their problems with the rest
(backends/contract/checks.py); `load_datasets` raises the first."""

from __future__ import annotations

from pathlib import Path

from novarl.config.schema import BUNDLED_TASKS, DataConfig
from novarl.errors import NotAvailableYet, UserError


def dataset_kind(data: DataConfig) -> str:
    """data.dataset_name, else 'ResponseDataset' when a file is given, else 'arithmetic'.

    A bundled name together with a data file is refused when the config is
    validated (see DataConfig), so a file is never silently ignored.
    """
    if data.train is not None:
        return "ResponseDataset"
    if data.dataset_name is not None:
        return data.dataset_name
    return "ResponseDataset" if data.train_data_path else "arithmetic"


def check_data_source(data: DataConfig) -> None:
    """Raise the first of `data_problems`."""
    problems, _ = data_problems(data)
    if problems:
        raise problems[0]


def data_problems(data: DataConfig) -> tuple[list[UserError], list[str]]:
    """(problems, notes): the data names something novarl reads, a bundled task or for each
    split a file, folder or hub dataset whose split exists, and prompt files that are there;
    notes say which hub dataset `novarl train` downloads. Rows are read, and checked, with
    the tokenizer: trainer/setup.py."""
    try:
        return _data_problems(data)
    except UserError as err:
        return [err], []


def _data_problems(data: DataConfig) -> tuple[list[UserError], list[str]]:
    from novarl.data.named import NAMED_DATASETS, prompt_file

    kind = dataset_kind(data)
    # beside a held-out dataset (val_dataset_name, val_data_path) the fraction joins it, as NeMo RL merges them
    if data.split_validation_size and kind in BUNDLED_TASKS:
        raise UserError(f"data.split_validation_size={data.split_validation_size} holds out part of the training "
                        f"data for evaluation, but the bundled task '{kind}' has a held-out split of its own: "
                        "remove it.")
    for key in ("dataset_name", "val_dataset_name"):
        name = getattr(data, key)
        if name is not None and name not in (*BUNDLED_TASKS, "ResponseDataset", *NAMED_DATASETS):
            raise NotAvailableYet(f"data.{key}='{name}' is not a dataset novarl has. Use a bundled task ("
                                  + ", ".join(f"'{t}'" for t in BUNDLED_TASKS) + "), a named dataset ("
                                  + ", ".join(sorted(set(NAMED_DATASETS))) + "), or 'ResponseDataset' with "
                                  "data.train_data_path: a data file, a `datasets` folder or a hub dataset id.")
    problems, notes = [], []
    for i, block in enumerate(data.validation or []):
        if block.repeat > 1:
            notes.append(f"data.validation[{i}].repeat={block.repeat}: each example is evaluated once; "
                         "grpo.val_num_generations_per_prompt samples several completions of each (pass@k)")
    for key in ("prompt_file", "system_prompt_file"):
        given = getattr(data, key)
        path, note = prompt_file(given, f"data.{key}") if given else (None, None)
        notes.extend([note] if note else [])
        if path and not Path(path).expanduser().is_file():
            problems.append(UserError(f"data.{key}='{path}': no such file."))
    if kind in BUNDLED_TASKS:
        return problems, notes
    if kind == "ResponseDataset" and data.train_data_path is None and data.train is None:
        raise UserError("data.train_data_path is not set: ResponseDataset reads a data file, a `datasets` folder or "
                        "a hub dataset id.")
    notes.extend(_check_sources(data, problems))
    return problems, notes


def _check_sources(data: DataConfig, problems: list[UserError]) -> list[str]:
    """Each split's source located without the network (problems appended; notes returned)."""
    from novarl.data.named import split_specs
    from novarl.data.sources import NotInCache, locate as locate_source
    from novarl.models.locate import hub_offline

    found: dict[str, UserError | None] = {}
    notes = []
    for spec in split_specs(data, "train") + split_specs(data, "validation"):
        for subset in spec.subsets:
            try:
                locate_source(spec.text, spec.where, split=spec.split, subset=subset,
                              fallback_splits=spec.fallback_splits)
            except NotInCache as err:
                if hub_offline():
                    found[str(err)] = UserError(f"{err} HF_HUB_OFFLINE is set, so `novarl train` cannot download it.")
                else:
                    notes.append(f"{err} `novarl train` downloads it.")
            except UserError as err:
                found[str(err)] = err
    problems.extend(found.values())
    return list(dict.fromkeys(notes))
