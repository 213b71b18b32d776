"""Prompt datasets: the bundled tasks (arithmetic, repeat, word_problems, multiplication), or rows from data
files, `datasets` folders and hub datasets (novarl/data/sources.py says which files a split reads).

A row has a prompt field (`data.input_key`, default "prompt") and an answer field
(`data.output_key`, default "answer"); its other fields are kept with the example for the
reward. Rows are checked when loaded; a bad row is reported by file and line (JSON Lines)
or row number (JSON arrays, Parquet, Arrow, CSV).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from novarl.config.files import show_value
from novarl.config.schema import DataConfig
from novarl.data.arithmetic import Example, arithmetic_examples
from novarl.data.repeat import repeat_examples
from novarl.data.multiplication import multiplication_examples
from novarl.data.word_problems import word_problem_examples
from novarl.errors import UserError
from novarl.data.named import SplitSpec, prompt_file, split_specs
from novarl.data.sources import FORMATS, Source, locate
from novarl.data.checks import check_data_source, dataset_kind  # noqa: F401 (dataset_kind re-exported)
from novarl.types import Prompt

BUNDLED_DATASETS = {"arithmetic": arithmetic_examples, "repeat": repeat_examples,
                    "word_problems": word_problem_examples, "multiplication": multiplication_examples}


def load_examples(cfg: DataConfig, split: str, *, seed: int = 0) -> list[Example]:
    """The examples of `split` ("train" or "validation"), from a bundled task or the sources
    `split_specs` names (downloading a hub dataset's split no local cache holds). A training
    source with a held-out fraction (data.split_validation_size, or its block's) gives that
    fraction (at least one example, drawn with `seed`) to the validation split and trains on
    the rest."""
    check_data_source(cfg)
    kind = dataset_kind(cfg)
    if kind in BUNDLED_DATASETS:
        return BUNDLED_DATASETS[kind](split)
    examples = []
    for spec in split_specs(cfg, "train"):
        if split == "train" or spec.held_out:
            examples.extend(_part(spec_examples(spec), spec, seed, split))
    if split == "validation":
        examples.extend(e for spec in split_specs(cfg, "validation") for e in spec_examples(spec))
    return examples


def _part(examples: list[Example], spec: SplitSpec, seed: int, split: str) -> list[Example]:
    """A training source's examples for `split`: without a held-out fraction, all of them for
    training; with one, the fraction for validation and the rest for training."""
    if not spec.held_out:
        return examples if split == "train" else []
    held_out = held_out_indices(len(examples), spec.held_out, seed)
    if len(held_out) >= len(examples):
        raise UserError(f"{spec.where}: a held-out fraction of {spec.held_out} (split_validation_size) leaves no "
                        f"training example of the {len(examples)}.")
    return [e for i, e in enumerate(examples) if (i in held_out) == (split == "validation")]


def spec_examples(spec: SplitSpec) -> list[Example]:
    """The examples of one split's source, every subset in turn."""
    examples = []
    for subset in spec.subsets:
        source = locate(spec.text, spec.where, split=spec.split, subset=subset,
                        fallback_splits=spec.fallback_splits, download=True)
        examples.extend(source_examples(source, spec.input_key, spec.output_key, answer_after=spec.answer_after))
    if spec.domain is not None:  # its block's env_name, where a row names no domain of its own
        examples = [e if "domain" in e.columns else Example(e.prompt, e.answer, {**e.columns, "domain": spec.domain})
                    for e in examples]
    return examples


def held_out_indices(count: int, fraction: float, seed: int) -> set[int]:
    """Which of `count` examples a validation fraction holds out: round(count x fraction), at
    least one, drawn without replacement by `seed` (the same on every run and rank)."""
    import random

    size = max(1, round(count * fraction))
    return set(random.Random(seed).sample(range(count), min(size, count)))


def read_examples(path: Path, input_key: str, output_key: str, *, where: str = "data") -> list[Example]:
    """The examples of one data file."""
    return source_examples(locate(str(path), f"{where}='{path}'"), input_key, output_key)


def source_examples(source: Source, input_key: str, output_key: str, *,
                    answer_after: str | None = None) -> list[Example]:
    examples = []
    for path in source.files:
        rows = _ROW_READERS[FORMATS[path.suffix.lower()]](path, source)
        examples.extend(_example(row, input_key, output_key, place, answer_after) for place, row in rows)
    if not examples:
        raise UserError(f"{source.label} has no examples.")
    return examples


def _jsonl_rows(path: Path, source: Source) -> Iterator[tuple[str, object]]:
    """JSON Lines, or (a .json file starting with '[') one JSON array of rows."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text (byte {err.start}).") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read it ({err.strerror}).") from None
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        rows = _json_value(text, str(path))
        if not isinstance(rows, list):
            raise UserError(f"{path}: a .json data file is one array of rows, or one row per line.")
        yield from ((f"{path} row {number}", row) for number, row in enumerate(rows, start=1))
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            yield f"{path}:{number}", _json_value(line, f"{path}:{number}")


def _json_value(text: str, place: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"{place}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}).") from None
    except RecursionError:
        raise UserError(f"{place}: the row is nested too deeply to read; a row is an object "
                        "with a prompt and an answer.") from None
    except ValueError as err:  # an integer of more than 4,300 digits
        raise UserError(f"{place}: a value cannot be read ({err}).") from None


def _table_rows(path: Path, source: Source) -> Iterator[tuple[str, object]]:
    """Parquet and Arrow (IPC stream, as `datasets` writes it, or file), through pyarrow."""
    try:
        import pyarrow as pa
    except ImportError:
        raise UserError(f"Reading '{path}' needs pyarrow: pip install 'novarl[parquet]'.") from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
        else:
            with pa.memory_map(str(path)) as stream:
                opened = pa.ipc.open_stream(stream) if source.arrow_stream else pa.ipc.open_file(stream)
                table = opened.read_all()
    except Exception as err:  # pyarrow raises several unrelated types for a bad file
        raise UserError(f"{path}: not a readable {FORMATS[suffix]} file ({str(err).splitlines()[0]}).") from None
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"{path} row {number}", row


def _csv_rows(path: Path, source: Source) -> Iterator[tuple[str, object]]:
    """CSV with a header row; every value is text, as written (an answer '007' stays '007')."""
    import csv

    try:
        with path.open(encoding="utf-8", newline="") as stream:
            for number, row in enumerate(csv.DictReader(stream), start=2):
                yield f"{path}:{number}", row
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text (byte {err.start}).") from None
    except csv.Error as err:
        raise UserError(f"{path}: not readable as CSV ({err}).") from None


_ROW_READERS = {"jsonl": _jsonl_rows, "json": _jsonl_rows, "parquet": _table_rows, "arrow": _table_rows,
                "csv": _csv_rows}


def _example(row: object, input_key: str, output_key: str, place: str, answer_after: str | None = None) -> Example:
    """A row's prompt and answer. Keys may be dotted paths into nested fields
    (`reward_model.ground_truth`); the prompt is a non-empty string or a list of chat
    messages ({role, content}, as TRL's conversational datasets and verl's parquet files
    hold them); the answer a string or a number."""
    if not isinstance(row, dict):
        raise UserError(f"{place}: a row must be an object with '{input_key}' and '{output_key}', "
                        f"got {type(row).__name__}.")
    plain = [k for k in (input_key, output_key) if "." not in k and k not in row]
    if plain:
        raise UserError(f"{place}: no field {', '.join(repr(k) for k in plain)} (fields: "
                        f"{', '.join(sorted(map(str, row)))}). Set data.input_key / data.output_key.")
    prompt, answer = _field(row, input_key, place, "data.input_key"), _field(row, output_key, place, "data.output_key")
    answer = _answer(answer, output_key, place)
    if answer_after is not None:  # GSM8K: the reasoning, then '#### 42'
        answer = answer.rpartition(answer_after)[2].strip() if answer_after in answer else answer
    columns = {k: v for k, v in row.items() if k not in (input_key, input_key.partition(".")[0])}
    if isinstance(prompt, list):
        return Example(prompt=_messages(prompt, input_key, place), answer=answer, columns=columns)
    if not isinstance(prompt, str) or not prompt:
        raise UserError(f"{place}: '{input_key}' must be a non-empty string or a list of chat messages "
                        f"({{role, content}}), got {show_value(prompt)}.")
    return Example(prompt=prompt, answer=answer, columns=columns)


def _field(row: dict, key: str, place: str, setting: str) -> object:
    """row[key], or for a dotted key the nested field it names (a key with dots in the row
    itself wins)."""
    if key in row:
        return row[key]
    node: object = row
    for depth, part in enumerate(key.split(".")):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            where = ".".join(key.split(".")[:depth]) or "the row"
            fields = ", ".join(sorted(map(str, node))) if isinstance(node, dict) else type(node).__name__
            raise UserError(f"{place}: no field '{key}' ({where} has: {fields}). Set {setting} (a dotted path "
                            "reaches nested fields, e.g. reward_model.ground_truth).")
    return node


ROLES = ("system", "user", "assistant")


def _messages(value: list, key: str, place: str) -> tuple[dict[str, str], ...]:
    """Chat messages, checked: each {role, content} with a known role and text content, the
    last the user's turn (the completion is the assistant's)."""
    messages = []
    for i, message in enumerate(value):
        ok = isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)
        if not ok:
            raise UserError(f"{place}: '{key}'[{i}] must be a chat message {{role: {'|'.join(ROLES)}, content: "
                            f"text}}, got {show_value(message)}.")
        messages.append({"role": message["role"], "content": message["content"]})
    if not messages or messages[-1]["role"] != "user":
        raise UserError(f"{place}: '{key}' must end with the user's message (the completion is the "
                        f"assistant's turn), got {'no messages' if not messages else messages[-1]['role']!r} last.")
    return tuple(messages)


def _answer(answer: object, key: str, place: str) -> str:
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise UserError(f"{place}: '{key}' must be a string or a number, got {type(answer).__name__}.")
    return str(answer)


# ------------------------------------------------------------ prompts + batches
PASSTHROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""NeMo RL's pass-through chat template (policy.tokenizer.chat_template: null): the messages'
contents one after the other, no role markers."""


def chat_template_for(tokenizer, setting: str | None) -> str | None:
    """The Jinja template prompts are rendered with, by NeMo RL's policy.tokenizer.chat_template:
    'default' the tokenizer's own (None when it has none: plain text); null the pass-through
    template; a file's path (.jinja, .j2, .txt) that file's text; any other string the template."""
    if setting == "default":
        return getattr(tokenizer, "chat_template", None) or None
    if setting is None:
        return PASSTHROUGH_TEMPLATE
    path = Path(setting).expanduser()
    if "{" not in setting and path.suffix in (".jinja", ".jinja2", ".j2", ".txt"):
        return _read_text(setting, "policy.tokenizer.chat_template")
    return setting


def to_prompts(examples: list[Example], tokenizer, *, template: str | None = None,
               system_prompt: str | None = None, max_prompt_tokens: int | None = None,
               chat_template: str | None = "default", chat_template_kwargs: dict | None = None) -> list[Prompt]:
    """Tokenised prompts, rendered with the chat template `chat_template_for` picks (with
    `chat_template_kwargs`, e.g. enable_thinking) when there is one, else as plain text;
    prompts longer than `max_prompt_tokens` are dropped (counted in the log)."""
    jinja = chat_template_for(tokenizer, chat_template)
    kwargs = dict(chat_template_kwargs or {})
    texts = []
    for ex in examples:
        if not isinstance(ex.prompt, str):  # chat messages: the template goes around the user's last turn
            if jinja is None:
                raise UserError("The data's prompts are chat messages, and the tokenizer has no chat template to "
                                "render them with: use a model whose tokenizer has one, set "
                                "policy.tokenizer.chat_template, or give plain-text prompts.")
            messages = [dict(m) for m in ex.prompt]
            if template:
                messages[-1]["content"] = template.format(messages[-1]["content"])
            if system_prompt and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": system_prompt})
        else:
            text = template.format(ex.prompt) if template else ex.prompt
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
                [{"role": "user", "content": text}]
        if jinja is not None:
            texts.append(render_chat(tokenizer, messages, jinja, kwargs))
        else:
            texts.append(f"{system_prompt}\n{text}" if system_prompt else text)
    # One call for every text: per text, the tokenizer's Python overhead costs more than the
    # tokenizing (8,100 short prompts: 1.8 s one by one, 0.3 s at once, the same ids).
    # A rendered template holds its own special tokens.
    all_ids = tokenizer(texts, add_special_tokens=jinja is None).input_ids if texts else []
    return [Prompt(text=text, token_ids=list(ids), answer=ex.answer, index=index, columns=ex.columns, source=ex.prompt)
            for index, (ex, text, ids) in enumerate(zip(examples, texts, all_ids, strict=True))
            if max_prompt_tokens is None or len(ids) <= max_prompt_tokens]


def render_chat(tokenizer, messages: list[dict[str, str]], jinja: str, kwargs: dict) -> str:
    """Messages rendered by the chat template `jinja`, with the generation prompt (a UserError when it cannot)."""
    try:
        return tokenizer.apply_chat_template(messages, chat_template=jinja, tokenize=False,
                                             add_generation_prompt=True, **kwargs)
    except Exception as err:  # jinja2's TemplateError and the errors a template raises itself
        raise UserError(f"The chat template could not render a prompt ({type(err).__name__}: {err}); check "
                        "policy.tokenizer.chat_template and chat_template_kwargs.") from None


def read_prompt_template(cfg: DataConfig) -> tuple[str | None, str | None]:
    """(prompt template with '{}', system prompt) from data.prompt_file / data.system_prompt_file.
    The template is a str.format string with exactly one field, '{}': checked here, so that
    formatting a prompt with it cannot fail."""
    template = system = None
    if cfg.prompt_file:
        template = _read_text(prompt_file(cfg.prompt_file, "data.prompt_file")[0], "data.prompt_file")
        check_template(template, f"data.prompt_file='{cfg.prompt_file}'")
    if cfg.system_prompt_file:
        system = _read_text(prompt_file(cfg.system_prompt_file, "data.system_prompt_file")[0],
                            "data.system_prompt_file")
    return template, system


def check_template(template: str, where: str) -> None:
    """Raise UserError unless `template` has one '{}' and any other brace doubled."""
    import string

    try:
        fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(template)
                  if name is not None]
    except ValueError as err:  # a lone '{' or '}'
        problem = f"it is not a format string ({err})"
    else:
        odd = ["{" + name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
               for name, spec, conv in fields if (name, spec, conv) != ("", "", None)]
        if not odd and len(fields) == 1:
            return
        problem = (f"it has the field {odd[0]!r}" if odd else
                   f"it has {len(fields)} '{{}}' fields" if fields else "it has no '{}' where the prompt goes")
    raise UserError(f"{where}: {problem}. A prompt file holds exactly one '{{}}', replaced by the prompt; "
                    "write any other brace doubled ('{{' for '{', '}}' for '}').")


def _is_file(path: Path, key: str) -> bool:
    """path.is_file(), with what the file system refuses (a name too long, a folder that may
    not be entered, a NUL byte) said as a UserError naming `key`."""
    try:
        return path.is_file()
    except (OSError, ValueError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise UserError(f"{key}='{path}': cannot open it ({reason}).") from None


def _read_text(path: str, key: str) -> str:
    if not _is_file(Path(path), key):
        what = "is a folder, not a text file" if Path(path).is_dir() else "no such file"
        raise UserError(f"{key}='{path}': {what}.")
    try:
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{key}='{path}': not UTF-8 text (byte {err.start}).") from None
    except OSError as err:
        raise UserError(f"{key}='{path}': cannot read it ({err.strerror}).") from None


@dataclass
class PromptSampler:
    """Shuffled batches of prompts, epoch after epoch; its position can be saved and restored."""

    prompts: list[Prompt]
    batch_size: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        if len(self.prompts) < self.batch_size:
            raise UserError(f"The dataset has {len(self.prompts)} usable prompts, fewer than "
                            f"grpo.num_prompts_per_step={self.batch_size}.")
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        import random

        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, count: int | None = None) -> list[Prompt]:
        """The next `count` prompts (batch_size by default; at most the dataset's size): a
        new shuffled epoch starts when the current one has fewer left."""
        count = min(count or self.batch_size, len(self._order))
        if self.position + count > len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation()
        picked = self._order[self.position:self.position + count]
        self.position += count
        return [self.prompts[i] for i in picked]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation()
