"""Code rewards: each completion's program run against its example's tests in the sandbox
(novarl/rewards/sandbox.py), `reward.sandbox.workers` programs at once.

Two registered rewards:
- ``code_tests``: 1 when every test passes, else 0 (ROLL's CodeSandboxRewardWorker scores so);
- ``code_pass_rate``: the fraction of the tests passed.

The program is the completion's code: the text after its last ``</think>``; of its fenced blocks
(```` ```python ... ``` ````) the first that defines a function, else the first; the whole text
when it has none (ROLL's rule). Python only.

The tests come from the data row, in the forms code datasets use:
- ``test_cases`` (a list, or its JSON text), ROLL's: items ``{"assert_code": ...}`` for
  ``case_type`` assert / pytest (the code runs once, then each test in its globals; a test that
  defines ``test_*`` functions has them called), check_based (``check(<entry_point>)`` called),
  text (``{response}`` in the code replaced by the completion's text, nothing extracted); or
  items ``{"stdin": ..., "expected_stdout": ...}`` (also ``input`` / ``output``): the program run
  once per input, its output compared token by token;
- ``input_output`` or ``test_cases`` as ``{"inputs": [...], "outputs": [...]}`` (APPS, verl);
- ``tests`` / ``test_list``: assert statements (MBPP), or ``test`` with ``entry_point`` (HumanEval).
Call-based tests (``fn_name``, ``test_case_function``) are not built: a clear error says so.

Each completion's dict also gives, as metrics (reward/<name>/<key>), the fraction of completions
whose program timed out, ran out of memory, wrote too much, started too many processes, and the
fraction the sandbox itself failed on; past ``reward.sandbox.max_failed_fraction`` of a batch the
run stops with the sandbox's error (a sandbox that is down is not a row of zeros).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from novarl.errors import UserError
from novarl.rewards.sandbox import LocalSandbox, Outcome, Program, RemoteSandbox, SandboxError, SandboxLimits

FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
STATUSES = ("timeout", "memory", "output", "processes")
"""A program's limits, each counted per step."""


def extract_code(text: str) -> str:
    """The program in a completion (the module doc says which)."""
    text = text.rpartition("</think>")[2]
    blocks = FENCE.findall(text)
    if not blocks:
        return text.strip()
    return next((b for b in blocks if "def " in b), blocks[0])


@dataclass(frozen=True)
class Check:
    """How one completion is tested: the program to run and the outputs its runs must print
    (None: assert-style, the tests' verdicts count)."""

    program: Program
    expected: tuple[str, ...] | None = None

    @property
    def count(self) -> int:
        return len(self.expected) if self.expected is not None else len(self.program.tests or ()) or 1


def check_of(text: str, row: Mapping[str, Any]) -> Check:
    """The Check of completion `text` against data row `row`; a UserError naming what is missing."""
    cases = _json(row.get("test_cases"), "test_cases")
    if cases is None and row.get("input_output") is not None:
        cases = _json(row["input_output"], "input_output")
    if isinstance(cases, Mapping):
        return _stdio(text, cases.get("inputs"), cases.get("outputs"), cases.get("fn_name"))
    if isinstance(cases, list) and cases:
        return _listed(text, cases, row)
    tests = row.get("tests", row.get("test_list"))
    if isinstance(tests, str):
        tests = [tests]
    if tests:
        return Check(Program(extract_code(text), tests=tuple(map(str, tests))))
    if row.get("test"):
        return Check(Program(extract_code(text), tests=(str(row["test"]),), entry_point=row.get("entry_point")))
    raise UserError("code reward: the example has no tests: give a column test_cases (ROLL's), input_output "
                    f"(APPS'), tests / test_list (assert statements) or test with entry_point (columns: "
                    f"{', '.join(sorted(k for k in map(str, row) if k not in ('prompts', 'answers'))) or 'none'}).")


def _json(value: Any, column: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise UserError(f"code reward: column {column} is text but not JSON ({err.msg} at {err.pos}).") from None


def _stdio(text: str, inputs: Any, outputs: Any, function: Any) -> Check:
    if function not in (None, "", "None"):
        raise UserError(f"code reward: call-based tests (fn_name / test_case_function {function!r}) are not "
                        "built; give stdin/stdout or assert-style tests.")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise UserError("code reward: stdin/stdout tests need lists 'inputs' and 'outputs' of one length "
                        f"(got {type(inputs).__name__} and {type(outputs).__name__}).")
    return Check(Program(extract_code(text), stdins=tuple(map(_text, inputs))), tuple(map(_text, outputs)))


def _listed(text: str, cases: list, row: Mapping[str, Any]) -> Check:
    kind = str(row.get("case_type") or "").lower()
    first = cases[0] if isinstance(cases[0], Mapping) else {}
    if "assert_code" in first:
        codes = tuple(str(c.get("assert_code", "")) for c in cases)
        if kind == "text":
            return Check(Program("\n".join(codes).replace("{response}", repr(text.rpartition("</think>")[2])),
                                 tests=("",)))
        entry = first.get("entry_point", "candidate") if kind == "check_based" else None
        return Check(Program(extract_code(text), tests=codes, entry_point=entry))
    if "stdin" in first or "input" in first:
        return _stdio(text, [c.get("stdin", c.get("input")) for c in cases],
                      [c.get("expected_stdout", c.get("output")) for c in cases], row.get("test_case_function"))
    raise UserError(f"code reward: test_cases items are neither {{'assert_code': ...}} nor {{'stdin': ..., "
                    f"'expected_stdout': ...}} (the first has keys {', '.join(map(str, first)) or 'none'}).")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def same_output(got: str, want: str) -> bool:
    """Token by token, whitespace aside; numbers within 1e-6 (relative) of each other."""
    a, b = got.split(), want.split()
    if a == b:
        return True
    return len(a) == len(b) and all(x == y or _close(x, y) for x, y in zip(a, b))


def _close(x: str, y: str) -> bool:
    try:
        u, v = float(x), float(y)
    except ValueError:
        return False
    return abs(u - v) <= 1e-6 * max(1.0, abs(v))


def passed(check: Check, outcome: Outcome) -> list[bool]:
    """Each test's verdict."""
    if check.expected is None:
        verdicts = outcome.runs[0].passed
        return list(verdicts) if verdicts is not None else [outcome.runs[0].status == "ok"]
    return [run.status == "ok" and same_output(run.stdout, want) for run, want in zip(outcome.runs, check.expected)]


class CodeReward:
    """A batched reward over the sandbox: fn(completions, **columns) -> [{"reward": ..., ...}]."""

    def __init__(self, sandbox: LocalSandbox | RemoteSandbox, *, all_or_nothing: bool, max_failed_fraction: float,
                 name: str):
        self.sandbox, self.all_or_nothing, self.max_failed_fraction = sandbox, all_or_nothing, max_failed_fraction
        self.__name__ = name

    def __call__(self, completions: Sequence[str], **columns: Sequence[Any]) -> list[dict[str, float]]:
        rows = [{k: v[i] for k, v in columns.items() if isinstance(v, (list, tuple))} for i in range(len(completions))]
        checks = [check_of(text, row) for text, row in zip(completions, rows)]
        outcomes = self.sandbox.run_all([c.program for c in checks])
        failed = [o for o in outcomes if isinstance(o, SandboxError)]
        if failed and len(failed) > self.max_failed_fraction * len(outcomes):
            raise UserError(f"the code sandbox failed on {len(failed)} of {len(outcomes)} programs (past "
                            f"reward.sandbox.max_failed_fraction={self.max_failed_fraction:g}): {failed[0]}")
        return [self._score(c, o) for c, o in zip(checks, outcomes)]

    def _score(self, check: Check, outcome: Outcome | SandboxError) -> dict[str, float]:
        if isinstance(outcome, SandboxError):
            return {"reward": 0.0, "pass_rate": 0.0, "sandbox_failed": 1.0, **{s: 0.0 for s in STATUSES}}
        verdicts = passed(check, outcome)
        rate = sum(verdicts) / max(len(verdicts), 1)
        statuses = {run.status for run in outcome.runs}
        return {"reward": float(rate == 1.0) if self.all_or_nothing else rate, "pass_rate": rate,
                "sandbox_failed": 0.0, **{s: float(s in statuses) for s in STATUSES}}


def sandbox_of(block: Any) -> LocalSandbox | RemoteSandbox:
    """The sandbox of a reward.sandbox block: a SandboxFusion service at its url, else the local one."""
    if block is None:
        return LocalSandbox()
    limits = SandboxLimits(timeout_s=block.timeout_s, memory_mb=block.memory_mb, max_processes=block.max_processes,
                           max_output_bytes=block.max_output_bytes, max_file_mb=block.max_file_mb)
    if block.url:
        return RemoteSandbox(block.url, limits, workers=block.workers)
    return LocalSandbox(limits, workers=block.workers, isolate=block.isolate, site_packages=block.site_packages)


def _code_reward(settings: Any, *, all_or_nothing: bool, name: str) -> CodeReward:
    block = getattr(settings, "sandbox", None)
    return CodeReward(sandbox_of(block), all_or_nothing=all_or_nothing, name=name,
                      max_failed_fraction=block.max_failed_fraction if block is not None else 0.1)


def code_tests(settings: Any = None) -> CodeReward:
    """The registered reward ``code_tests`` (reward.sandbox's settings): 1 when every test passes."""
    return _code_reward(settings, all_or_nothing=True, name="code_tests")


def code_pass_rate(settings: Any = None) -> CodeReward:
    """The registered reward ``code_pass_rate`` (reward.sandbox's settings): the fraction of the tests passed."""
    return _code_reward(settings, all_or_nothing=False, name="code_pass_rate")
