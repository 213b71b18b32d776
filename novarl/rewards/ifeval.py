"""Instruction-following rules (IFEval's checks in the form ROLL's GeneralRuleRewardWorker reads:
allenai open-instruct's RLVR-IFeval rows, whose answer is JSON naming a check and its arguments,
`{"func_name": "validate_lowercase"}`, `{"func_name": "verify_keywords", "keyword_list": [...]}`).

The registered reward ``ifeval`` scores a completion (its text after the last ``</think>``) 1 when
its check holds, else 0, plus the repetition penalty ROLL adds (rewards/verifiers.py). Arguments
the check does not take are dropped, as ROLL drops them. Differences from ROLL, on purpose:
``verify_keyword_frequency`` counts the word named (ROLL's counts every word), and an answer that
names no known check stops the run with an error naming it (ROLL's worker skips the row and its
batch goes out of step).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable

from novarl.errors import UserError
from novarl.rewards.verifiers import repetition_penalty


def _compare(count: int, n: int, quantifier: str | None) -> bool:
    quantifier = (quantifier or "exactly").lower()
    if quantifier in ("at least", "more than or equal to"):
        return count >= n
    if quantifier in ("at most", "less than or equal to"):
        return count <= n
    if quantifier == "less than":
        return count < n
    if quantifier == "more than":
        return count > n
    if quantifier == "around":
        return abs(count - n) <= max(1, round(0.1 * n))
    return count == n


def _words(text: str) -> list[str]:
    return re.findall(r"\b\w+\b", text.lower())


def verify_keywords(text: str, keyword_list: list[str]) -> bool:
    return all(k.lower() in text.lower() for k in keyword_list)


def verify_keyword_frequency(text: str, word: str, N: int) -> bool:
    return _words(text).count(word.lower()) == N


def validate_forbidden_words(text: str, forbidden_words: list[str]) -> bool:
    words = set(_words(text))
    return not any(w.lower() in words for w in forbidden_words)


def verify_letter_frequency(text: str, letter: str, N: int) -> bool:
    return len(letter) == 1 and text.lower().count(letter.lower()) == N


def validate_response_language(text: str, language: str) -> bool:
    try:
        from langdetect import detect
    except ImportError:
        raise UserError("ifeval: validate_response_language needs the langdetect package: pip install langdetect")
    try:
        return detect(text) == language
    except Exception:  # langdetect raises on text without features
        return False


def _paragraphs(text: str, splitter: str) -> list[str]:
    return [p for p in (part.strip() for part in text.split(splitter)) if p]


def verify_paragraph_count(text: str, N: int) -> bool:
    return len(_paragraphs(text, "* * *")) == N


def validate_word_constraint(text: str, N: int, quantifier: str) -> bool:
    return _compare(len(text.split()), N, quantifier)


def verify_sentence_constraint(text: str, N: int, quantifier: str) -> bool:
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]
    return _compare(len(sentences), N, quantifier)


def validate_paragraphs(text: str, N: int, first_word: str, i: int) -> bool:
    paragraphs = _paragraphs(text, "\n\n")
    if len(paragraphs) != N or not 1 <= i <= N:
        return False
    return paragraphs[i - 1].split()[0].strip("\"'*#").lower() == first_word.lower()


def verify_postscript(text: str, postscript_marker: str) -> bool:
    at = text.find(postscript_marker)
    return at >= 0 and len(text[at:].strip()) > len(postscript_marker)


def validate_placeholders(text: str, N: int) -> bool:
    return len(re.findall(r"\[[^\]\n]+\]", text)) >= N


def verify_bullet_points(text: str, N: int) -> bool:
    return sum(bool(re.match(r"\s*[*-]\s", line)) for line in text.splitlines()) == N


def validate_title(text: str) -> bool:
    return bool(re.search(r"<<[^\n]+>>", text))


def validate_choice(text: str, options: list[str]) -> bool:
    return any(option in text for option in options)


def validate_highlighted_sections(text: str, N: int) -> bool:
    return len(re.findall(r"\*[^\n*]+\*", text)) >= N


def validate_sections(text: str, N: int, section_splitter: str) -> bool:
    sections = text.split(section_splitter)
    if sections and not sections[0].strip():
        sections = sections[1:]
    return len(sections) == N


def validate_json_format(text: str) -> bool:
    body = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def validate_repeat_prompt(text: str, original_prompt: str) -> bool:
    return text.strip().lower().startswith(original_prompt.strip().lower())


def validate_two_responses(text: str) -> bool:
    parts = [p.strip() for p in text.split("******")]
    return len(parts) == 2 and all(parts) and parts[0] != parts[1]


def validate_uppercase(text: str) -> bool:
    return text == text.upper()


def validate_lowercase(text: str) -> bool:
    return text == text.lower()


def validate_frequency_capital_words(text: str, N: int, quantifier: str) -> bool:
    return _compare(len(re.findall(r"\b[A-Z]{2,}\b", text)), N, quantifier)


def validate_end(text: str, end_phrase: str) -> bool:
    return text.strip().endswith(end_phrase.strip())


def validate_quotation(text: str) -> bool:
    stripped = text.strip()
    return len(stripped) > 1 and stripped.startswith('"') and stripped.endswith('"')


def validate_no_commas(text: str) -> bool:
    return "," not in text


CHECKS: dict[str, Callable[..., bool]] = {fn.__name__: fn for fn in (
    verify_keywords, verify_keyword_frequency, validate_forbidden_words, verify_letter_frequency,
    validate_response_language, verify_paragraph_count, validate_word_constraint, verify_sentence_constraint,
    validate_paragraphs, verify_postscript, validate_placeholders, verify_bullet_points, validate_title,
    validate_choice, validate_highlighted_sections, validate_sections, validate_json_format, validate_repeat_prompt,
    validate_two_responses, validate_uppercase, validate_lowercase, validate_frequency_capital_words, validate_end,
    validate_quotation, validate_no_commas)}
"""The 25 checks of open-instruct's IFEval rows, by the name their answer gives."""


def ifeval(completion: str, answer: str) -> dict[str, float]:
    """1 when the check `answer` names holds for the completion, else 0; plus the repetition penalty.
    A check that raises on its arguments (a null count) is not held, and counted (check_errors)."""
    try:
        spec = json.loads(answer) if isinstance(answer, str) else dict(answer)
    except (ValueError, TypeError):
        raise UserError(f"ifeval: the answer is not JSON naming a check ({answer!r:.200}).") from None
    name = spec.get("func_name") if isinstance(spec, dict) else None
    check = CHECKS.get(str(name))
    if check is None:
        raise UserError(f"ifeval: the answer names check {name!r}, not one of the {len(CHECKS)} known "
                        f"({', '.join(CHECKS)}).")
    params = inspect.signature(check).parameters
    arguments = {k: v for k, v in spec.items() if k in params and k != "text"}
    missing = [p for p in params if p != "text" and p not in arguments]
    if missing:
        raise UserError(f"ifeval: check {name} needs {', '.join(missing)}, which the answer lacks ({answer!r:.200}).")
    text = completion.rpartition("</think>")[2].strip()
    try:
        held, error = bool(check(text, **arguments)), 0.0
    except UserError:
        raise
    except Exception:  # ROLL counts a check that raises as not held
        held, error = False, 1.0
    return {"reward": float(held) + repetition_penalty(text), "check_errors": error}
