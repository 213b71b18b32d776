"""DAPO's math answer check: the completion's last ``Answer: ...`` line against the reference, both
normalised as Minerva normalises final answers (Lewkowycz et al. 2022), compared as text.

Registered names (reward.function):
- ``dapo_math_verify``: 1.0 when the two normalised answers are the same string, else 0.0. This is
  NeMo RL's math environment with `env.math.math_verify_impl: dapo_math_verify`
  (nemo_rl/environments/dapo_math_verifier.py at 7ea279a, adapted from verl's
  verl/utils/reward_score/math_dapo.py), score for score on every input: the prompt must ask for a
  final ``Answer: ...`` line (DAPO-Math-17k's prompts do); a ``\\boxed{}`` answer alone scores 0.0.
  No dependency.

The check, in NeMo RL's order (each step matters: e.g. spaces go before units are removed):
1. only the completion's last COMPLETION_TAIL characters are read;
2. its answer is the text after the last ``Answer:`` (any case, spaces around the colon) to the end
   of that line; with none, the placeholder NO_ANSWER stands for it (as in NeMo RL, a reference
   that normalises to that placeholder then matches);
3. both sides go through `minerva_normalize`.
verl's other mode, the strict \\boxed{} check of the last 100 characters, is not built: NeMo RL's
environment never selects it.
"""

from __future__ import annotations

import re

COMPLETION_TAIL = 300
"""Characters read from the end of a completion (NeMo RL: the longest MATH-500 answer has 159)."""

NO_ANSWER = "[INVALID]"
"""What a completion without an ``Answer:`` line is taken to answer (it normalises to itself)."""

_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
"""'Answer:', then the rest of the line. The spaces after the colon may run over line breaks, and
a match swallows any later 'Answer:' on its own line: the last match is the answer, not the last
'Answer:'."""

# Minerva's final-answer normalisation (Lewkowycz et al. 2022, "Solving Quantitative Reasoning
# Problems with Language Models", appendix), as DAPO/verl (verl/utils/reward_score/math_dapo.py) and
# NeMo RL (nemo_rl/environments/dapo_math_verifier.py) use it. The two lists are that specification's
# data, applied in this order, each entry to the whole text.
MINERVA_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
"""(text, replacement) pairs, replaced in this order."""

MINERVA_REMOVED: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)
"""Unit words and TeX spacing removed, in this order (after the substitutions)."""

# `.` in these patterns stops at a line break, as in Minerva's: each rewrite stays within a line.
_UNWRAPPED = tuple(re.compile(rf"\\{command}\{{([^}}\n]*)\}}") for command in ("text", "textbf", "overline"))
"""\\text{x}, then \\textbf{x}, then \\overline{x} -> x, each up to its first closing brace."""
_BOXED = re.compile(r"\\boxed\{(.*)\}")
"""\\boxed{x} -> x, from a line's first \\boxed{ to its last closing brace (so nested braces stay)."""
_FRAC_SHORTHAND = re.compile(r"frac([^{])(.)")
"""\\fracab -> \\frac{a}{b} (and \\fracabc -> \\frac{a}{b}c); \\frac{a}{b} is left as it is."""
_SQRT_SHORTHAND = re.compile(r"sqrt([^{])")
"""\\sqrta -> \\sqrt{a}."""


def dapo_math_verify(completion: str, answer: str | None) -> float:
    """1.0 when the completion's final answer (the last ``Answer: ...`` line in its last
    COMPLETION_TAIL characters) and `answer` are the same after `minerva_normalize`, else 0.0;
    0.0 without a reference answer (NeMo RL's environment scores a check that fails as 0.0)."""
    if answer is None:
        return 0.0
    return 1.0 if minerva_normalize(final_answer(completion)) == minerva_normalize(answer) else 0.0


def final_answer(completion: str) -> str:
    """The text after the last ``Answer:`` (case ignored) of the completion's last COMPLETION_TAIL
    characters, to the end of that line, not normalised; NO_ANSWER when there is none."""
    found = _ANSWER_LINE.findall(completion[-COMPLETION_TAIL:])
    return found[-1] if found else NO_ANSWER


def minerva_normalize(answer: str) -> str:
    """Minerva's normal form of a final answer: the text after its last '=', with
    MINERVA_SUBSTITUTIONS and MINERVA_REMOVED applied (spaces and unit words go), each line's first
    $...$ kept alone, \\text{} / \\textbf{} / \\overline{} / \\boxed{} unwrapped, \\fracab and
    \\sqrta written out, '$' dropped, the commas of a digit string ('1,000') dropped, and the ends
    stripped. E.g. 'x = \\$1,000' -> '1000', '\\boxed{\\frac12}' -> '\\frac{1}{2}'."""
    text = answer.rpartition("=")[2]
    for old, new in MINERVA_SUBSTITUTIONS:
        text = text.replace(old, new)
    for removed in MINERVA_REMOVED:
        text = text.replace(removed, "")
    text = "\n".join(_first_math_span(line) for line in text.split("\n"))
    for wrapper in _UNWRAPPED:
        text = wrapper.sub(r"\1", text)
    text = _BOXED.sub(r"\1", text)
    text = _FRAC_SHORTHAND.sub(r"frac{\1}{\2}", text)
    text = _SQRT_SHORTHAND.sub(r"sqrt{\1}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():  # str.isdigit, as Minerva's: superscript digits count too
        text = text.replace(",", "")
    return text.strip()


def _first_math_span(line: str) -> str:
    """'so $x$ or $y$' -> '$x$': a line with two '$' or more becomes its first $...$ span, the
    text around it dropped; any other line is kept."""
    parts = line.split("$", 2)
    return f"${parts[1]}$" if len(parts) == 3 else line
