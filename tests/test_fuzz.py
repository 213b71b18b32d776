"""Bad input of every kind through the command line, as a user gives it.

Each case builds its input under its own folder (a config file, a data file, a model
folder, a reward file), runs `novarl.cli.main([command, ...])` in this process and
checks the contract: exit code 2 with a `novarl: error:` message and no traceback --
or 0 where the input is in fact valid, as the case says (`expect`) -- within the case's
time limit, writing nothing (`validate`) or nothing but a run it trained (`train`).

Most cases run `validate` (the same checks as `train`, milliseconds each); a handful
run `train` with a tiny workload, one runs in a subprocess (a reward function that no
exception stops must still end the process). `benchmarks/fuzz_inputs.py` runs the same
generators at a larger scale, with ~100 `train` runs in subprocesses.
"""

from __future__ import annotations

import faulthandler
import json
import random
import shutil
import struct
import subprocess
import sys
import threading
import time
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import UnionType

import pytest
from pydantic import BaseModel

from novarl.cli import BUNDLED_RECIPE, main
from novarl.config.schema import NovaRLConfig
from novarl.errors import UserError
from novarl.models.bundled import resolve_bundled
from novarl.rewards.scorer import RewardScorer
from novarl.types import Completion, Prompt

TINY_MODEL = resolve_bundled("tiny-arith")
VOCAB = 19  # tiny-arith's tokenizer
CONFIG_LIMIT_S = 10.0
"""Limit for a case refused while the config loads (milliseconds when the machine is idle)."""


# ============================================================ cases
@dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[Path], list[str]]
    """Writes what the case needs under the folder; returns its arguments (overrides, -c FILE)."""
    expect: int | None = 2
    """The exit code: 2 for bad input, 0 for input that is valid after all; None: either
    (a random edit may leave a config valid)."""
    command: str = "validate"
    limit_s: float = 20.0
    """Wall-clock limit (a loaded 2-core machine); config errors take milliseconds."""
    says: str = ""
    """Text the error must contain (what and where), when given."""


def base_args(folder: Path) -> list[str]:
    """A small valid workload: 16 training prompts in a file, Hugging Face generation, outputs
    under the case folder. The case's own arguments come after these and win."""
    rows = "".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                   for a, b in zip(range(10, 26), range(30, 46)))
    for name in ("train.jsonl", "val.jsonl"):
        if not (folder / name).exists():
            (folder / name).write_text(rows)
    return ["policy.generation.backend=hf", f"data.train_data_path={folder / 'train.jsonl'}",
            f"data.val_data_path={folder / 'val.jsonl'}", "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=2", "policy.train_micro_batch_size=8",
            "policy.logprob_batch_size=8", "grpo.max_val_samples=8", "grpo.val_batch_size=8",
            f"logger.log_dir={folder / 'logs'}", "logger.progress_bar=false", "checkpointing.enabled=false"]


def overrides(*items: str) -> Callable[[Path], list[str]]:
    return lambda folder: list(items)


def write(name: str, content: str | bytes, *extra: str, option: str = "-c") -> Callable[[Path], list[str]]:
    """A case whose input is one file: `option FILE` (or `extra` with {file} filled in)."""
    def make(folder: Path) -> list[str]:
        path = folder / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return [a.format(file=path) for a in extra] if extra else [option, str(path)]
    return make


# ------------------------------------------------------------ config values, from the schema
BAD_VALUES: dict[str, tuple[str, ...]] = {
    "bool": ("maybe", "[true]", "2"),
    "int": ("1.5", "abc", str(2**70), ".inf", "[]"),
    "float": (".inf", "-.inf", ".nan", "abc", "{a: 1}"),
    "str": ("[1, 2]", "{a: 1}"),
    "path": ("x" * 300, "[a]", f"a/{'b' * 256}/c"),
    "literal": ("not-a-choice", "[1]"),
    "list": ("abc", "{a: 1}", "[[1]]"),
    "dict": ("[1]", "abc", "3"),
    "other": ("{a: 1}",),
}


def _kind(annotation) -> tuple[str, type[BaseModel] | None]:
    """The kind of a schema field (a key of BAD_VALUES), or its section model."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) > 1:
            return "other", None
        return _kind(members[0])
    if typing.get_origin(annotation) is typing.Annotated:
        if any(getattr(m, "func", None).__name__ == "_path_text" for m in annotation.__metadata__
               if hasattr(m, "func")):
            return "path", None
        return _kind(args[0])
    if typing.get_origin(annotation) is typing.Literal:
        return "literal", None
    if typing.get_origin(annotation) in (list, dict):
        return typing.get_origin(annotation).__name__, None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section", annotation
    name = getattr(annotation, "__name__", "other")
    return (name, None) if name in BAD_VALUES else ("other", None)


def _lower_bound(field) -> float | None:
    bounds = [getattr(m, attr) for m in field.metadata for attr in ("ge", "gt") if getattr(m, attr, None) is not None]
    return min(bounds) if bounds else None


def schema_fields(model: type[BaseModel] = NovaRLConfig, prefix: str = "") -> Iterator[tuple[str, str, float | None]]:
    """(dotted key, kind, lower bound) of every setting of the schema."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        kind, section = _kind(field.annotation)
        if section is not None:
            yield from schema_fields(section, key + ".")
        else:
            yield key, kind, _lower_bound(field)


def schema_cases(per_field: int, rng: random.Random) -> list[Case]:
    """For every setting, `per_field` values of the wrong type, non-finite, out of range or
    too long for it: each one is refused by validation."""
    cases = []
    for key, kind, low in schema_fields():
        values = list(BAD_VALUES[kind])
        if low is not None and low >= 0 and kind in ("int", "float"):
            values.append("-2" if key == "grpo.val_period" else "-1")  # NeMo RL's val_period -1 is "off"
        for value in rng.sample(values, min(per_field, len(values))):
            cases.append(Case(f"value:{key}={value[:20]}", overrides(f"{key}={value}"), 2, limit_s=CONFIG_LIMIT_S,
                              says=key))
    return cases


# ------------------------------------------------------------ keys, YAML, overrides
def nested(depth: int, kind: str) -> str:
    return "a: " + ("[" * depth + "]" * depth if kind == "list" else "{a: " * depth + "1" + "}" * depth) + "\n"


BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))
"""9 levels of 9 aliases each: 1 KB of YAML that expands to 9**9 (387 million) values."""

INTERPOLATION_BOMB = "grpo:\n  seed: 1\n" + "".join(
    f"v{i}: [{', '.join([repr('${v%d}' % (i - 1) if i else '${grpo.seed}')] * 9)}]\n" for i in range(9))
"""The same with ${...} references: each copies what it names, 9**9 values again."""

STRING_BOMB = f"a0: {'x' * 10_000}\n" + "".join(f"a{i}: '{('${a%d}' % (i - 1)) * 4}'\n" for i in range(1, 9))
"""Each string four copies of the one before: 10 KB becomes 655 MB."""


def yaml_cases() -> list[Case]:
    files = [
        ("null-key-top", "null: 1\n", "the key null at the top level"),
        ("null-key-nested", "grpo: {null: 3}\n", "the key null under 'grpo'"),
        ("tilde-key", "grpo:\n  ~: 3\n", "the key null under 'grpo'"),
        ("true-key", "true: x\n", "the key true"),
        ("yes-key", "policy:\n  yes: 1\n", "the key true under 'policy'"),
        ("int-key", "grpo: {1: 2}\n", "the key 1 under 'grpo'"),
        ("float-key", "1.5: x\n", "the key 1.5"),
        ("list-key", "? [1]\n: x\n", "not valid YAML"),
        ("deep-list-100", nested(100, "list"), "nested more than 64"),
        ("deep-list-5000", nested(5000, "list"), "nested more than 64"),
        ("deep-dict-5000", nested(5000, "dict"), "nested more than 64"),
        ("deep-list-100000", nested(100_000, "list"), "nested more than 64"),
        ("recursive-alias", "a: &a [*a]\n", ""),
        ("python-tag", "grpo: !!python/object/apply:os.system ['true']\n", "not valid YAML"),
        ("binary-in-str", "policy: {model_name: !!binary aGVsbG8=}\n", "policy.model_name"),
        ("tab-indent", "grpo:\n\tseed: 1\n", "not valid YAML"),
        ("unclosed", "grpo: {seed: 1\n", "not valid YAML"),
        ("int-5000-digits", f"grpo: {{seed: {'7' * 5000}}}\n", "YAML cannot read"),
        ("bad-date", "grpo: {seed: 2024-13-45}\n", "YAML cannot read"),
        ("top-list", "- 1\n- 2\n", "must hold a mapping"),
        ("top-scalar", "42\n", "must hold a mapping"),
        ("unknown-key", "grpo: {nope: 1}\n", "unknown key 'grpo.nope'"),
        ("interpolation-bomb", INTERPOLATION_BOMB, "more than 100,000 values"),
        ("string-bomb", STRING_BOMB, "longer than"),
        ("interpolation-cycle", "grpo: {seed: '${grpo.max_num_steps}', max_num_steps: '${grpo.seed}'}\n", "cycle"),
        ("unknown-resolver", "grpo: {seed: '${pow:2, 3}'}\n", "unknown resolver 'pow'"),
        ("resolver-overflow", "grpo: {seed: '${mul:10000000000, 10000000000}'}\n", "64-bit"),
        ("nul-in-path", 'policy: {model_name: "tiny\\0arith"}\n', "NUL"),
        ("defaults-list", "defaults: [base]\n", "does not exist"),
    ]
    cases = [Case(f"yaml:{name}", write("cfg.yaml", text), 2, limit_s=CONFIG_LIMIT_S, says=says)
             for name, text, says in files]
    cases.append(Case("yaml:billion-laughs", write("cfg.yaml", BILLION_LAUGHS), 2, limit_s=2,
                      says="more than 100,000 values"))
    valid = [
        ("empty", ""),
        ("comments-only", "# nothing\n"),
        ("utf8-bom", "\ufeffgrpo: {seed: 3}\n"),
        ("anchor-reused", "grpo: &g {seed: 3}\nloss_fn: {ratio_clip_min: 0.2}\n"),
        ("merge-key", "grpo:\n  <<: {seed: 3, max_num_steps: 5}\n  max_num_steps: 7\n"),
        ("duplicate-key", "grpo: {seed: 1}\ngrpo: {seed: 2}\n"),
    ]
    cases += [Case(f"yaml-valid:{name}", write("cfg.yaml", text), 0) for name, text in valid]
    cases += [
        Case("config:missing", lambda f: ["-c", str(f / "nope.yaml")], says="does not exist"),
        Case("config:folder", lambda f: ["-c", str(f)], says="is a folder"),
        Case("config:non-utf8", write("cfg.yaml", b"grpo:\n  seed: \xff\xfe\n"), says="UTF-8"),
        Case("config:binary", write("cfg.yaml", bytes(random.Random(1).randrange(256) for _ in range(2000)))),
        Case("config:long-path", lambda f: ["-c", str(f / ("c" * 300 + ".yaml"))], says="File name too long"),
    ]
    return cases


def override_cases() -> list[Case]:
    bad = ["a..b=1", "=1", "a=", "a.b", ".a=1", "a.=1", "grpo.seed==1", "grpo=1", "policy.model_name.x=1",
           "grpo.seed=", "grpo.seed=[", "grpo.seed=" + "[" * 100, "grpo.nope=1", "nope.nope=1",
           "policy.scheduler=[1,2]", "policy.scheduler=5", "policy.scheduler=[{milestones: [1]}, 3]",
           "policy.scheduler=[{name: torch.optim.lr_scheduler.Nope}]", "policy.optimizer.kwargs.lr=.inf",
           "policy.optimizer.kwargs.betas=[.nan, 0.9]", "policy.optimizer.name=os.system",
           "grpo={null: 3}", "grpo={seed: {a: 1}}", "policy.generation.stop_token_ids=[-1]",
           f"policy.generation.stop_token_ids=[{VOCAB}]", f"policy.generation.stop_token_ids=[{2**70}]",
           "policy.generation.stop_token_ids=[1.5]", "env.math.num_workers=-1", "env.math=[1]",
           "grpo.max_train_seconds=.inf", "policy.max_grad_norm=.nan", "loss_fn.reference_policy_kl_penalty=.inf",
           "policy.generation.temperature=.inf", "policy.generation.top_p=.nan", "loss_fn.ratio_clip_max=.inf",
           "policy.generation.temperature=0", "loss_fn.ratio_clip_min=1.5", "grpo.num_prompts_per_step=0",
           "reward.timeout_s=0", "reward.timeout_s=.inf", "reward.function=", "reward.function=:",
           "policy.model_name=" + "m" * 300, "data.train_data_path=" + "d" * 300, "logger.log_dir=" + "l" * 300,
           "policy.model_name=" + "x" * 100_000]
    cases = [Case(f"override:{item[:40]}", overrides(item), 2, limit_s=CONFIG_LIMIT_S) for item in bad]
    cases += [Case(f"override-valid:{item}", overrides(item), 0) for item in (
        f"policy.generation.stop_token_ids=[{VOCAB - 1}]", "policy.generation.stop_token_ids=[]",
        "reward.timeout_s=null", "grpo.max_train_seconds=null", "grpo.seed=-1", f"grpo.seed={2**63 - 1}")]
    cases += [Case(f"output:{key}-under-a-file", overrides(f"{key}={BUNDLED_RECIPE}/out", *extra), 2,
                   says=f"{key}='{BUNDLED_RECIPE}/out'")
              for key, extra in (("logger.log_dir", ()),
                                 ("checkpointing.checkpoint_dir", ("checkpointing.enabled=true",)))]
    return cases


def plan_cases() -> list[Case]:
    cases = [Case(f"plan:--gpu-memory-gb={value}", overrides("--gpu-memory-gb", value), 2, "plan", 10,
                  says="--gpu-memory-gb") for value in ("nan", "inf", "-inf", "0", "-1", "abc", "", "1e400")]
    return cases + [Case("plan-valid:--gpu-memory-gb=80", overrides("--gpu-memory-gb", "80"), 0, "plan")]


# ------------------------------------------------------------ data and prompt files
def rows(*items) -> str:
    return "".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items)


GOOD_ROW = {"prompt": "12+30=", "answer": "42"}


def data_cases() -> list[Case]:
    train = "data.train_data_path={file}"
    bad_rows = {
        "row-list": rows([1, 2]), "row-string": rows('"text"'), "row-number": rows("7"), "row-empty-object": rows({}),
        "no-answer": rows({"prompt": "1+1="}), "prompt-int": rows({"prompt": 5, "answer": "5"}),
        "prompt-empty": rows({"prompt": "", "answer": "1"}), "prompt-null": rows({"prompt": None, "answer": "1"}),
        "prompt-list": rows({"prompt": ["a"], "answer": "1"}), "answer-list": rows({"prompt": "1+1=", "answer": [2]}),
        "answer-null": rows({"prompt": "1+1=", "answer": None}), "answer-dict": rows({"prompt": "1+1=", "answer": {}}),
        "invalid-json": rows(GOOD_ROW, '{"prompt": "1+1=", "answer": '),
        "int-5000-digits": rows('{"prompt": "1+1=", "answer": ' + "9" * 5000 + "}"),
        "nested-100000": rows('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "answer": "1"}'),
        "only-huge-prompts": rows({"prompt": "1" * 1_000_000, "answer": "1"}),
        "empty": "", "blank-lines": "\n\n\n", "non-utf8": b'{"prompt": "\xff", "answer": "1"}\n',
        "binary": bytes(random.Random(2).randrange(256) for _ in range(4000)),
    }
    cases = [Case(f"data:{name}", write("train.jsonl", text, train), 2) for name, text in bad_rows.items()]
    cases += [
        Case("data:missing", lambda f: [f"data.train_data_path={f / 'none.jsonl'}"], says="no such file"),
        Case("data:folder", lambda f: [(f / "empty").mkdir(exist_ok=True) or f"data.train_data_path={f / 'empty'}"],
             says="the folder has no data files"),
        Case("data:parquet-garbage", write("train.parquet", b"PAR1 not really", train), says="Parquet"),
        Case("data:txt", write("train.txt", "prompt,answer\n1+1=,2\n", train), says="unknown format"),
        Case("data:val-bad-row", write("val.jsonl", rows([1]), "data.val_data_path={file}"), says="val.jsonl:1"),
        Case("data:too-few-prompts", write("train.jsonl", rows(GOOD_ROW), train), says="fewer than"),
    ]
    valid = {"answer-int": rows(*[{"prompt": f"{i}+1=", "answer": i + 1} for i in range(8)]),
             "answer-nan": rows(*['{"prompt": "%d+1=", "answer": NaN}' % i for i in range(8)]),
             "some-huge-prompts": rows(*[GOOD_ROW] * 8, {"prompt": "1" * 1_000_000, "answer": "1"}),
             "extra-fields": rows(*[{**GOOD_ROW, "id": i, "meta": {"x": [1]}} for i in range(8)])}
    cases += [Case(f"data-valid:{name}", write("train.jsonl", text, train), 0) for name, text in valid.items()]

    prompt = "data.prompt_file={file}"
    bad_templates = {"positional": "{0} {}", "named": "Q: {name} {}", "lone-open": "{ {}", "lone-close": "} {}",
                     "no-field": "Question:", "two-fields": "{} and {}", "doubled-only": "{{}}",
                     "conversion": "{!r}", "format-spec": "{:>5}", "attribute": "{.upper}", "empty": ""}
    cases += [Case(f"prompt-file:{name}", write("prompt.txt", text, prompt), 2, says="data.prompt_file=")
              for name, text in bad_templates.items()]
    cases += [
        Case("prompt-file:non-utf8", write("prompt.txt", b"\xff{}", prompt), says="not UTF-8"),
        Case("prompt-file:missing", lambda f: [f"data.prompt_file={f / 'none.txt'}"], says="no such file"),
        Case("prompt-file:folder", lambda f: [f"data.prompt_file={f}"], says="is a folder"),
        Case("system-prompt:non-utf8", write("system.txt", b"\xfe\xff", "data.system_prompt_file={file}"),
             says="data.system_prompt_file="),
        Case("system-prompt:folder", lambda f: [f"data.system_prompt_file={f}"], says="is a folder"),
        Case("prompt-file-valid:plain", write("prompt.txt", "Q: {} A:", prompt, "policy.max_seq_length=64"), 0),
        Case("prompt-file-valid:doubled-braces", write("prompt.txt", "{{x}} is {}", prompt, "policy.max_seq_length=64"),
             0),
        Case("system-prompt-valid", write("system.txt", "Add. {braces} are fine here.",
                                          "data.system_prompt_file={file}", "policy.max_seq_length=64"), 0),
    ]
    return cases


# ------------------------------------------------------------ model folders
def model_folder(change: Callable[[Path], None]) -> Callable[[Path], list[str]]:
    def make(folder: Path) -> list[str]:
        model = folder / "model"
        shutil.copytree(TINY_MODEL, model)
        change(model)
        return [f"policy.model_name={model}"]
    return make


def config_json(**changes) -> Callable[[Path], None]:
    def change(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, **changes}))
    return change


def put(name: str, content: bytes | None) -> Callable[[Path], None]:
    def change(model: Path) -> None:
        if content is None:
            (model / name).unlink()
        else:
            (model / name).write_bytes(content)
    return change


def safetensors_header(tensors: dict) -> bytes:
    header = json.dumps(tensors).encode()
    return struct.pack("<Q", len(header)) + header


def empty_folder(folder: Path) -> list[str]:
    (folder / "empty").mkdir()
    return [f"policy.model_name={folder / 'empty'}"]


def model_cases() -> list[Case]:
    weights = (TINY_MODEL / "model.safetensors").read_bytes()
    changes = {
        "config-empty": put("config.json", b""), "config-list": put("config.json", b"[]"),
        "config-empty-object": put("config.json", b"{}"),
        "config-non-utf8": put("config.json", b'{"model_type": "llama", "x": "\xff"}'),
        "config-garbage": put("config.json", bytes(range(256))),
        "unknown-model-type": config_json(model_type="nonsense"), "vocab-string": config_json(vocab_size="x"),
        "heads-zero": config_json(num_attention_heads=0), "layers-1e12": config_json(num_hidden_layers=10**12),
        "hidden-mismatch": config_json(hidden_size=256), "vocab-mismatch": config_json(vocab_size=40),
        "layers-mismatch": config_json(num_hidden_layers=3),
        "weights-empty": put("model.safetensors", b""),
        "weights-garbage": put("model.safetensors", bytes(random.Random(3).randrange(256) for _ in range(5000))),
        "weights-truncated": put("model.safetensors", weights[:len(weights) // 2]),
        "weights-header-lies": put("model.safetensors", safetensors_header(
            {"model.embed_tokens.weight": {"dtype": "F32", "shape": [10**6], "data_offsets": [0, 4 * 10**6]}})),
        "weights-missing": put("model.safetensors", None),
        "index-missing-shard": put("model.safetensors.index.json",
                                   json.dumps({"weight_map": {"a": "model-00002.safetensors"}}).encode()),
        "index-garbage": put("model.safetensors.index.json", b"{{{"),
        "tokenizer-garbage": put("tokenizer.json", bytes(random.Random(4).randrange(256) for _ in range(300))),
        "tokenizer-missing": put("tokenizer.json", None),
    }
    cases = [Case(f"model:{name}", model_folder(change), 2, says="") for name, change in changes.items()]
    cases += [
        Case("model:empty-folder", empty_folder, says="no config.json"),
        Case("model:a-file", lambda f: [f"policy.model_name={BUNDLED_RECIPE}"], says="no model folder"),
        Case("model:missing", lambda f: [f"policy.model_name={f / 'none'}"], says="no model folder"),
        Case("model-valid:copy", model_folder(lambda m: None), 0),
        Case("model-valid:unknown-architecture-name", model_folder(config_json(architectures=["Nope"])), 0),
    ]
    return cases


# ------------------------------------------------------------ reward functions
REWARDS_PY = '''
import fractions, math, re, sys, time


def ok(completion, answer):
    return float(completion.strip() == answer.strip())


def boolean(completion, answer): return True
def fraction(completion, answer): return fractions.Fraction(1, 3)
def at_limit(completion, answer): return -1e15
def raises(completion, answer): raise RuntimeError("the reward service is down")
def nan(completion, answer): return math.nan
def inf(completion, answer): return math.inf
def minus_inf(completion, answer): return -math.inf
def huge(completion, answer): return 1e308
def over_float32(completion, answer): return 3.5e38
def over_limit(completion, answer): return 1e16
def big_int(completion, answer): return 10 ** 400
def string(completion, answer): return "1.0"
def none(completion, answer): return None
def listed(completion, answer): return [1.0]
def mapping(completion, answer): return {"score": 1.0}
def reward_dict(completion, answer): return {"reward": 1.0, "length": len(completion)}
def complex_number(completion, answer): return 1j
def exits(completion, answer): sys.exit(3)
def sleeps(completion, answer): time.sleep(3600)
def spins(completion, answer):
    while True:
        pass
def backtracks(completion, answer): return float(bool(re.match(r"(a+)+$", "a" * 40 + "b")))
def swallows(completion, answer):
    while True:
        try:
            time.sleep(3600)
        except BaseException:
            pass

# Right for a completion that is the answer (the trial call before the run passes), wrong later.
def late_nan(completion, answer): return 1.0 if completion.strip() == answer.strip() else math.nan
def late_huge(completion, answer): return 1.0 if completion.strip() == answer.strip() else 1e308
def late_sleep(completion, answer):
    if completion.strip() != answer.strip():
        time.sleep(3600)
    return 1.0
not_callable = 3
'''


def reward(fn: str, *extra: str) -> Callable[[Path], list[str]]:
    def make(folder: Path) -> list[str]:
        (folder / "rewards.py").write_text(REWARDS_PY)
        return [f"reward.function={folder / 'rewards.py'}:{fn}", "reward.timeout_s=0.5", *extra]
    return make


def reward_cases() -> list[Case]:
    bad = ["raises", "nan", "inf", "minus_inf", "huge", "over_float32", "over_limit", "big_int", "string", "none",
           "listed", "mapping", "complex_number", "exits", "sleeps", "spins", "backtracks", "not_callable", "absent"]
    cases = [Case(f"reward:{fn}", reward(fn), 2, limit_s=20, says="reward.function=") for fn in bad]
    cases += [Case(f"reward-valid:{fn}", reward(fn), 0) for fn in ("ok", "boolean", "fraction", "at_limit",
                                                                   "reward_dict")]
    cases += [
        Case("reward:syntax-error", write("bad.py", "def f(:\n", "reward.function={file}:f"), says="SyntaxError"),
        Case("reward:import-raises", write("bad.py", "raise ImportError('no gpu')\n", "reward.function={file}:f"),
             says="no gpu"),
        Case("reward:missing-file", lambda f: [f"reward.function={f / 'none.py'}:f"], says="does not exist"),
        Case("reward:folder", lambda f: [f"reward.function={f}/:f"], says="is a folder"),
        Case("reward:no-module", overrides("reward.function=no_such_module_for_fuzz:f"), says="ModuleNotFoundError"),
        Case("reward:long-path", lambda f: [f"reward.function={'r' * 300}.py:f"], says="255 bytes"),
        Case("reward:not-a-spec", overrides("reward.function=exact_mtch"), says="neither a registered reward"),
    ]
    return cases


# ------------------------------------------------------------ random edits of the bundled recipe
def mutation_cases(count: int, rng: random.Random) -> list[Case]:
    """The bundled recipe with one random edit (a byte deleted, replaced, or inserted, or a line
    duplicated): many are still valid, the rest must be refused cleanly."""
    text = BUNDLED_RECIPE.read_bytes()
    cases = []
    for i in range(count):
        data = bytearray(text)
        at = rng.randrange(len(data))
        edit = rng.choice(["delete", "replace", "insert", "duplicate-line"])
        if edit == "delete":
            del data[at]
        elif edit == "replace":
            data[at] = rng.choice(b"\x00\xff:-[]{}&*!|>'\"#%@`\t\n 0123456789.eE")
        elif edit == "insert":
            data[at:at] = rng.choice([b"&x ", b"*x", b"!!", b": ", b"\n  - ", b"${", b"1e999", b"\xfe"])
        else:
            start = data.rfind(b"\n", 0, at) + 1
            end = data.find(b"\n", at) + 1 or len(data)
            data[start:start] = data[start:end]
        cases.append(Case(f"mutation:{i}:{edit}@{at}", write("cfg.yaml", bytes(data)), None, limit_s=20))
    return cases


def all_cases(per_field: int = 2, mutations: int = 30, seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    return [*schema_cases(per_field, rng), *yaml_cases(), *override_cases(), *plan_cases(), *data_cases(),
            *model_cases(), *reward_cases(), *mutation_cases(mutations, rng)]


# ------------------------------------------------------------ train runs
TRAIN = ["grpo.max_num_steps=2", "grpo.val_at_start=false", "grpo.val_at_end=false", "policy.max_seq_length=16",
         "policy.generation.max_new_tokens=4"]


def refused_at_load(model: Path) -> None:
    """A model folder that passes every check and that transformers refuses to load (4-bit
    quantization without its packages)."""
    config_json(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})(model)


def train_cases() -> list[Case]:
    """`train` with a tiny workload: input that preflight cannot see fails while the run starts
    or on its first step, and the run stops with exit code 2 all the same."""
    return [
        Case("train-valid:tiny", lambda f: TRAIN, 0, "train", 180),
        Case("train:weights-refused-at-load", lambda f: [*TRAIN, *model_folder(refused_at_load)(f)], 2, "train",
             120, says="Cannot load model"),
        Case("train:reward-nan-in-step-1", lambda f: [*TRAIN, *reward("late_nan")(f)], 2, "train", 120,
             says="returned nan"),
        Case("train:reward-1e308-in-step-1", lambda f: [*TRAIN, *reward("late_huge")(f)], 2, "train", 120,
             says="returned 1e+308"),
        Case("train:reward-hangs-in-step-1", lambda f: [*TRAIN, *reward("late_sleep")(f)], 2, "train", 120,
             says="did not return within reward.timeout_s=0.5 s"),
        Case("train:weights-corrupt", lambda f: [*TRAIN, *model_folder(put("model.safetensors", b"\0" * 64))(f)],
             2, "train", 60, says="not a readable safetensors file"),
    ]


# ============================================================ running a case
def prepare(case: Case, folder: Path) -> list[str]:
    """The case's inputs under `folder`, and the command line that runs it."""
    folder.mkdir(parents=True, exist_ok=True)
    return [case.command, *base_args(folder), *case.make(folder)]


def run_case(case: Case, argv: list[str], capsys) -> tuple[int, str, float]:
    """Run the case in this process; (exit code, stderr, seconds). A case that hangs past
    twice its limit ends the test process with every thread's stack (faulthandler)."""
    faulthandler.dump_traceback_later(2 * case.limit_s + 30, exit=True, file=sys.__stderr__)
    start = time.monotonic()
    try:
        code = main(argv)
    finally:
        seconds = time.monotonic() - start
        faulthandler.cancel_dump_traceback_later()
    return code, capsys.readouterr().err, seconds


def check(case: Case, code: int, err: str, seconds: float) -> None:
    assert "Traceback" not in err, err[-3000:]
    if case.expect is None:
        assert code in (0, 2), err[-2000:]
    else:
        assert code == case.expect, f"exit {code}, expected {case.expect}: {err[-2000:]}"
    if code == 2:
        message = err[err.find("novarl: error: "):]
        assert message.startswith("novarl: error: "), err[-2000:]
        assert case.says in message, message
    assert seconds < case.limit_s, f"took {seconds:.1f} s (limit {case.limit_s} s)"


def files_under(folder: Path) -> set[Path]:
    return set(folder.rglob("*"))


CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_cleanly(case, tmp_path, capsys):
    folder = tmp_path / "case"
    argv = prepare(case, folder)
    before = files_under(folder)
    code, err, seconds = run_case(case, argv, capsys)
    check(case, code, err, seconds)
    assert files_under(folder) == before, "validate wrote files"


TRAIN_CASES = train_cases()


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c.id for c in TRAIN_CASES])
def test_train_stops_cleanly_on_bad_input(case, tmp_path, capsys):
    folder = tmp_path / "case"
    earlier = folder / "logs" / "exp_001"  # a run from before: nothing of it may go
    earlier.mkdir(parents=True)
    (earlier / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    code, err, seconds = run_case(case, prepare(case, folder), capsys)
    check(case, code, err, seconds)
    assert (earlier / "metrics.jsonl").read_text() == '{"kind": "train", "step": 1}\n'
    runs = sorted(p.name for p in (folder / "logs").iterdir())
    assert runs == (["exp_001", "exp_002"] if code == 0 else ["exp_001"]), runs  # a failed start leaves none


def test_alias_bomb_is_refused_within_2_seconds(tmp_path):
    from novarl.config import load_config

    path = tmp_path / "bomb.yaml"
    path.write_text(BILLION_LAUGHS)
    start = time.monotonic()
    with pytest.raises(UserError, match="more than 100,000 values"):
        load_config(path)
    assert time.monotonic() - start < 2.0


def test_a_reward_function_that_swallows_the_timeout_still_ends_the_process(tmp_path):
    """Its `except BaseException: pass` catches every interruption: the process exits with the
    error (exit code 2) rather than wait forever."""
    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "novarl", "validate", *base_args(tmp_path),
                           f"reward.function={tmp_path / 'rewards.py'}:swallows", "reward.timeout_s=0.5"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "novarl: error: Reward function" in proc.stderr and "the process exits now" in proc.stderr
    assert time.monotonic() - start < 60


def test_reward_timeout_off_the_main_thread_leaves_the_call_behind():
    """train() called from another thread: the call runs in a daemon thread, abandoned when the
    limit passes; the caller gets the error at once."""
    prompt = Prompt(text="1+1=", token_ids=[1], answer="2", index=0)
    sample = Completion(prompt=prompt, token_ids=[], logprobs=[], text="2", finish_reason="stop", policy_version=0)
    scorer = RewardScorer.from_spec(lambda completion, answer: time.sleep(30), timeout_s=0.2)
    outcome: list[BaseException] = []

    def score() -> None:
        try:
            scorer.score([sample])
        except UserError as err:
            outcome.append(err)

    start = time.monotonic()
    caller = threading.Thread(target=score)
    caller.start()
    caller.join(10)
    assert time.monotonic() - start < 5
    assert len(outcome) == 1 and "did not return within reward.timeout_s=0.2 s" in str(outcome[0])
    assert any(t.name == "novarl-reward-call" and t.daemon for t in threading.enumerate())


def test_reward_timer_gives_back_an_earlier_alarm():
    """A SIGALRM timer set before a reward call (by the caller) still fires after it."""
    import signal

    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        scores = RewardScorer.from_spec(lambda completion, answer: 1.0, timeout_s=5).score(
            [Completion(prompt=Prompt(text="a", token_ids=[1], answer="b", index=0), token_ids=[], logprobs=[],
                        text="b", finish_reason="stop", policy_version=0)])
        time.sleep(0.6)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert scores == [1.0] and fired == [signal.SIGALRM]


def test_the_cases_cover_every_setting_and_a_few_hundred_inputs():
    keys = {key for key, _, _ in schema_fields()}
    assert {"policy.generation.temperature", "reward.timeout_s", "policy.megatron_cfg.optimizer.lr"} <= keys
    assert len(CASES) >= 300
