"""Math rewards: the answer a completion gives (the last \\boxed{...}, or its last number), checked
against the reference answer, exactly after normalisation or by math-verify.

Registered names (reward.function):
- ``math_verify``: math-verify's parser and verifier, as NeMo RL's math environment uses
  them (`env.math.math_verify_impl: hf_math_verify`): the reference is read as
  ``\\boxed{answer}``, the completion's answer is its last LaTeX or plain expression;
  equal values score 1.0 (``1/2`` = ``0.5`` = ``\\frac{1}{2}``). Needs the ``math-verify``
  package (``pip install 'novarl[math]'``).
- ``boxed_match``: 1.0 when the completion's last ``\\boxed{...}`` equals the answer after
  normalisation (or as numbers), else 0.0. No dependency.
- ``last_number``: 1.0 when the completion's last number equals the answer's number.
- ``boxed_format``: a format reward, 1.0 when the completion puts an answer in ``\\boxed{}``.
- ``dapo_math_verify``: NeMo RL's other checker (`math_verify_impl: dapo_math_verify`), the last
  ``Answer:`` line compared as Minerva-normalised text: novarl/rewards/dapo_math.py.
"""

from __future__ import annotations

import re
import threading

from novarl.errors import UserError

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched; None when
    there is none or it is not closed."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
        i += 1
    return None


def last_number(text: str) -> str | None:
    """The last number written in `text` ('1,234.5' -> '1234.5'), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def normalize(answer: str) -> str:
    """An answer's text for comparison: no surrounding $ or spaces, no \\left / \\right, \\dfrac
    as \\frac, no thousands separators, no trailing period, no '\\text{...}' wrapper."""
    text = answer.strip().strip("$").strip()
    text = re.sub(r"\\text\{(.*?)\}", r"\1", text)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\!", ""),
                     ("\\,", ""), ("\\;", ""), (" ", "")):
        text = text.replace(old, new)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    return text.rstrip(".")


def _same(given: str | None, answer: str) -> bool:
    if given is None:
        return False
    a, b = normalize(given), normalize(answer)
    if a == b:
        return True
    try:
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))
    except ValueError:
        return False


def boxed_match(completion: str, answer: str) -> float:
    """1.0 when the completion's last \\boxed{} holds the answer (normalised, or the same number)."""
    return 1.0 if _same(extract_boxed(completion), answer) else 0.0


def last_number_match(completion: str, answer: str) -> float:
    """1.0 when the completion's last number is the answer's number."""
    expected = last_number(answer)
    return 1.0 if expected is not None and _same(last_number(completion), expected) else 0.0


def boxed_format(completion: str, answer: str) -> float:
    """1.0 when the completion gives an answer in \\boxed{} (a format reward; the answer is not read)."""
    return 1.0 if extract_boxed(completion) not in (None, "") else 0.0


def math_verify(completion: str, answer: str) -> float:
    """1.0 when math-verify finds the completion's answer equal to the reference (see the module
    docstring); 0.0 otherwise, also when either side does not parse."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
        from math_verify.errors import TimeoutException
    except ImportError:
        raise UserError("reward.function='math_verify' needs the math-verify package: "
                        "pip install 'novarl[math]'.") from None
    # math-verify bounds its own parsing with SIGALRM, which exists in the main thread only;
    # elsewhere novarl's reward.timeout_s bounds the call.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(f"\\boxed{{{answer}}}", extraction_config=(LatexExtractionConfig(),), parsing_timeout=timeout)
        given = parse(completion, extraction_config=(ExprExtractionConfig(), LatexExtractionConfig()),
                      parsing_timeout=timeout)
        return 1.0 if gold and given and verify(gold, given, timeout_seconds=timeout) else 0.0
    except (Exception, TimeoutException):  # what sympy cannot handle, or in time, is wrong, as in NeMo RL
        return 0.0
