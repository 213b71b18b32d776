"""reward.function 'dapo_math_verify' (novarl/rewards/dapo_math.py) scores as NeMo RL's math
environment does with `math_verify_impl: dapo_math_verify`: the same score, and the same normalised
answer, as NeMo RL's own function (copied verbatim at the end of this file, as test data) on
hand-written inputs (each normalisation rule, each way of writing the 'Answer:' line) and on
generated ones (numbers with commas, fractions, \\boxed, units, '=' chains, TeX in $...$, text past
the 300 characters read, random strings of the rules' tokens). It is registered, scores through
novarl's scorer, and NeMo RL's files that name it load."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from novarl.config import load_config
from novarl.errors import ConfigError
from novarl.rewards import REWARD_FUNCTIONS
from novarl.rewards.dapo_math import (COMPLETION_TAIL, MINERVA_REMOVED, dapo_math_verify, final_answer,
                                      minerva_normalize)
from novarl.rewards.scorer import RewardScorer
from novarl.types import Completion, Prompt

NEMO_RL = Path(__file__).parent / "data" / "nemo_rl"

# Answers written to hit each of Minerva's rules, and the edges around them.
ANSWERS = [
    # the text after the last '='
    "x = 5", "a = b = 7", "=", "x=", "5 =", "\\frac{1}{2} = 0.5", "y=\\boxed{3}",
    # the substitutions
    "an apple", "a dog", "a", "5.$", "$5.$", "\\$5", "10\\ 000", "1 2 3", "\\mbox{cm}", "\\mbox{yes}",
    "1,\\text{and}2", "1\\text{and}2", "5\\text{m}", "5 \\text{ m}",
    # $...$: a line's first span alone
    "the answer is $5$", "$1$ and $2$", "$x$", "$$", "$", "$5", "5$", "a $b$ c\n$d$ e", "$\\frac{1}{2}$.",
    "$1$$2$", "one $\n2$ two",
    # \text{}, \textbf{}, \overline{}
    "\\text{yes}", "\\text{(A)}", "\\text{a}\\text{b}", "\\text{unclosed", "\\text{a\nb}", "\\text{{x}}",
    "\\textbf{B}", "\\textbf{}", "0.\\overline{3}", "\\overline{AB}", "\\overline{x",
    # \boxed{}: from the first \boxed{ to the line's last }
    "\\boxed{5}", "\\boxed{\\frac{1}{2}}", "\\boxed{a}, \\boxed{b}", "\\boxed{", "\\boxed{x\n}", "\\boxed{\\boxed{3}}",
    "\\boxed{5}}", "}\\boxed{5", "\\boxed{1}\n\\boxed{2}",
    # \fracab and \sqrta
    "\\frac12", "\\frac123", "\\frac{1}{2}", "\\dfrac34", "frac", "frac1", "fraction", "\\frac1\n", "\\frac\n1",
    "\\sqrt2", "\\sqrt{2}", "2\\sqrt3", "sqrt", "\\sqrt\n", "\\frac{\\sqrt3}2", "\\sqrt\\frac12",
    # digit strings with commas; other numbers
    "1,000", "1,000,000", "12,34", ",", "1,", ",1", "1.5", "-1,000", "1,000.5", "\u00b2", "1,\u00b2", "\u0663,\u0664",
    "  7  ", "\t8\n", "007",
    # TeX spacing and degrees, quotes, dots
    "90^\\circ", "90^{\\circ}", "5\\;cm", "1{,}000", '"yes"', "1,\\!000", "1, 2, \\ldots", "1,2,\\dots",
    "4\\text{ cm}^2", "\\text{\ns}", "6\\text{s}", "3\\text{.}", "2\\mathrm{th}", "8 \\text{}^3",
    # empty and odd
    "", " ", "\n", "[INVALID]", "\\pi", "x^2+1", "(1, 2)", "\\{1,2\\}", "\\left( 3, \\frac{\\pi}{2} \\right)",
    "Answer: 5", "\\$\\$", "\\\\", "{", "}",
]
# and each unit word or removed expression, around a number
ANSWERS += [f"12 {removed}" for removed in MINERVA_REMOVED] + [f"{removed}7" for removed in MINERVA_REMOVED]

# Ways a completion gives its answer `{}`: the 'Answer:' line in its variants, several lines, none.
COMPLETIONS = [
    "Let me think step by step. 2 + 3 = 5.\nAnswer: {}",
    "answer:{}\n",
    "ANSWER :  {}",
    "Answer:\n{}",
    "Answer: 3\nAnswer: {}",
    "Answer: {}\nAnswer: 3",
    "Answer: {} Answer: 4",
    "Final Answer: The final answer is {}. I hope it is correct.",
    "{}",
    "The final answer is \\boxed{{{}}}",
    "Answer: ${}$.",
    "Answer:   \n\n{}",
    "x" * 400 + "\nAnswer: {}",
    "Answer: {}\n" + "y" * 400,
    "Answer: {}\n" + "." * (COMPLETION_TAIL - 12),  # the 300 characters read start in the Answer line
    "Answer: {}\r\nDone.",
    "answer\t:\t{}\t",
]


def nemo_rl_score(completion: str, answer: str | None) -> float:
    """NeMo RL's environment's score: compute_score's, and 0.0 for a check that raises
    (nemo_rl/environments/math_environment.py, HFVerifyWorker.verify)."""
    try:
        return float(compute_score(completion, answer)["score"])
    except Exception:
        return 0.0


def nemo_rl_pred(completion: str) -> str:
    """The normalised answer NeMo RL reads from a completion (compute_score's 'pred')."""
    return compute_score(completion, "")["pred"]


def generated_pairs(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """(completion, reference) pairs about one value written two ways, a correct answer often."""
    rng = random.Random(seed)
    units = ["dollars", "cm", "units", "degrees", "^\\circ", "\\text{ cm}", "students", "", "\\%"]
    pairs = []
    for _ in range(count):
        n, p, q = rng.randint(0, 10**7), rng.randint(1, 9), rng.randint(1, 9)
        value, written = rng.choice([
            (str(n), f"{n:,}"), (f"{n:,}", str(n)), (str(n), f"{n:,}.0"),
            (f"\\frac{{{p}}}{{{q}}}", f"\\frac{p}{q}"), (f"\\frac{{{p}}}{{{q}}}", f"$\\dfrac{{{p}}}{{{q}}}$"),
            (f"{p}/{q}", f"\\frac{{{p}}}{{{q}}}"), (f"\\sqrt{{{p}}}", f"\\sqrt{p}"),
            (f"{p}\\sqrt{{{q}}}", f"{p}\\sqrt{q}"),
            (str(p), f"\\boxed{{{p}}}"), (str(n), f"x = y = {n}"), (str(p), f"{p} {rng.choice(units)}"),
            (f"{p}", f"${p}$ {rng.choice(units)}"), (f"\\text{{({'ABCD'[p % 4]})}}", f"({'ABCD'[p % 4]})"),
            (f"{p}.{q}", f"{p}.{q}0"), (str(-n), f"-{n:,}"), (str(p), str(q)),
        ])
        template = rng.choice(COMPLETIONS)
        padding = "z" * rng.choice([0, 0, 100, COMPLETION_TAIL - 12, COMPLETION_TAIL - 5, COMPLETION_TAIL])
        pairs.append((padding + template.format(written), value))
    return pairs


TOKENS = ["Answer", "answer:", "ANSWER :", ":", " ", "  ", "\n", "\t", "$", "{", "}", "\\", "=", ",", ".", "frac",
          "sqrt", "\\frac", "\\sqrt", "\\text{", "\\textbf{", "\\overline{", "\\boxed{", "\\mbox", "1", "2", "23",
          "1,000", "a ", "an ", "cm", "units", "^\\circ", "{,}", "\\!", '"', "x", "\u00b2", "[INVALID]", "\\$"]


def random_strings(count: int, seed: int = 1) -> list[str]:
    """Strings of 0-14 of the rules' tokens in random order: the rules' interactions."""
    rng = random.Random(seed)
    return ["".join(rng.choice(TOKENS) for _ in range(rng.randint(0, 14))) for _ in range(count)]


def test_minerva_normalize_is_nemo_rls_normalize_final_answer():
    texts = [*ANSWERS, *random_strings(400)]
    differ = [(t, minerva_normalize(t), normalize_final_answer(t)) for t in texts
              if minerva_normalize(t) != normalize_final_answer(t)]
    assert not differ, differ[:5]
    assert len(set(map(minerva_normalize, texts))) > 200  # the inputs are varied


def test_the_score_and_the_answer_read_are_nemo_rls_on_every_input():
    """~4,500 pairs: every hand-written answer in every way of writing it (the reference as it is,
    or another answer), 400 generated pairs of one value written two ways, and 800 of random strings."""
    rng = random.Random(2)
    pairs = [(template.format(given), rng.choice([given, rng.choice(ANSWERS)]))
             for template in COMPLETIONS for given in ANSWERS]
    pairs += generated_pairs(400)
    fuzz = random_strings(400, seed=3)
    pairs += list(zip(fuzz, reversed(fuzz))) + [(f"Answer: {text}", text) for text in fuzz]
    differ = [(c, a, dapo_math_verify(c, a), nemo_rl_score(c, a)) for c, a in pairs
              if dapo_math_verify(c, a) != nemo_rl_score(c, a)]
    assert not differ, differ[:5]
    read = [(c, minerva_normalize(final_answer(c)), nemo_rl_pred(c)) for c, _ in pairs
            if minerva_normalize(final_answer(c)) != nemo_rl_pred(c)]
    assert not read, read[:5]
    scores = [dapo_math_verify(c, a) for c, a in pairs]
    assert len(pairs) > 4000 and scores.count(1.0) > 1000 and scores.count(0.0) > 1000  # both outcomes, often


@pytest.mark.parametrize("completion, answer, expected", [
    ("So 2 + 3 = 5.\nAnswer: 5", "5", 1.0),
    ("answer : 1,000", "1000", 1.0),  # commas of a digit string; any case; spaces around the colon
    ("Answer: $\\frac12$.", "\\frac{1}{2}", 1.0),  # $...$, a trailing '.$', \fracab
    ("Answer: 5 dollars", "\\$5", 1.0),  # unit words and '\$' removed
    ("Answer: x = y = 90^\\circ", "90", 1.0),  # after the last '='; degrees removed
    ("Answer: \\boxed{\\text{(B)}}", "(B)", 1.0),
    ("Answer: 3\nAnswer: 4", "4", 1.0),  # the last Answer line
    ("Answer: 4 Answer: 5", "5", 0.0),  # one match, to the end of its line: '4Answer:5'
    ("The answer is \\boxed{4}.", "4", 0.0),  # no Answer line: a boxed answer alone is not read
    ("Answer: 4\n" + "." * (COMPLETION_TAIL - 10), "4", 1.0),  # 'A' is the 300th character from the end
    ("Answer: 4\n" + "." * (COMPLETION_TAIL - 9), "4", 0.0),  # 'A' is the 301st, not read: no answer
    ("Answer: 0.5", "\\frac{1}{2}", 0.0),  # text, not values
    ("Answer: 4", None, 0.0),  # no reference
    ("no answer line", "[INVALID]", 1.0),  # NeMo RL's placeholder for a missing answer, matched as text
    ("", "", 0.0),
])
def test_dapo_math_verify_scores_the_answer_line_as_normalised_text(completion, answer, expected):
    assert dapo_math_verify(completion, answer) == expected
    if answer is not None:
        assert nemo_rl_score(completion, answer) == expected


def completion(text: str, answer: str) -> Completion:
    prompt = Prompt(text="Solve. Give the answer as 'Answer: ...'.", token_ids=[1], answer=answer)
    return Completion(prompt=prompt, token_ids=[2], logprobs=[0.0], text=text, finish_reason="stop", policy_version=0)


def test_it_is_registered_and_scores_through_the_scorer():
    assert REWARD_FUNCTIONS["dapo_math_verify"] is dapo_math_verify
    cfg = load_config({"env": {"math": {"math_verify_impl": "dapo_math_verify"}}})
    scorer = RewardScorer.from_spec(cfg.reward.function, weights=cfg.reward.weights, timeout_s=cfg.reward.timeout_s)
    assert scorer.score([completion("... so 1,024.\nAnswer: 1,024", "1024"), completion("\\boxed{1024}", "1024"),
                         completion("Answer: 5 cm", "5")]) == [1.0, 0.0, 1.0]
    assert scorer.name == "dapo_math_verify"


def test_nemo_rls_math_environment_with_dapo_math_verify_scores_with_it():
    cfg = load_config({"env": {"math_default": {"num_workers": 8, "math_verify_impl": "dapo_math_verify"}}})
    assert cfg.reward.function == "dapo_math_verify" and cfg.env["math_default"].math_verify_impl == "dapo_math_verify"
    assert cfg.load_warnings == ("env.math_default: completions are scored by reward.function='dapo_math_verify' (the "
                                 "'Answer:' line, Minerva-normalised, as NeMo RL's dapo_math_verify); num_workers=8 is "
                                 "not used (the reward runs in the driver)",)
    both = {"math": {"math_verify_impl": "dapo_math_verify"}, "math_default": {"math_verify_impl": "dapo_math_verify"}}
    assert load_config({"env": both}).reward.function == "dapo_math_verify"
    # a reward the config names itself wins
    assert load_config({"env": {"math": {"math_verify_impl": "dapo_math_verify"}},
                        "reward": {"function": "boxed_match"}}).reward.function == "boxed_match"


def test_math_blocks_that_disagree_or_name_another_checker_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"1 problem\(s\):\n  - 'env.math.math_verify_impl' = 'dapo_math_verify' and "
                                          r"'env.math_default.math_verify_impl' = 'hf_math_verify': novarl scores "
                                          r"every math example with one reward.function; give the blocks the same "
                                          r"checker, or name reward.function.$"):
        load_config({"env": {"math": {"math_verify_impl": "dapo_math_verify"}, "math_default": {"num_workers": 2}}})
    named = load_config({"env": {"math": {"math_verify_impl": "dapo_math_verify"}, "math_default": {}},
                         "reward": {"function": "exact_match"}})
    assert named.reward.function == "exact_match"
    assert named.load_warnings == ("env.math and env.math_default are not used: reward.function='exact_match' scores "
                                   "the completions",)
    with pytest.raises(ConfigError, match=r"1 problem\(s\):\n  - 'env.math.math_verify_impl' = 'dapo': that checker "
                                          r"is not built; 'hf_math_verify' \(reward.function: math_verify\) and "
                                          r"'dapo_math_verify' \(reward.function: dapo_math_verify\) are.$"):
        load_config({"env": {"math": {"math_verify_impl": "dapo"}}})
    with pytest.raises(ConfigError, match=r"'env.again.math_verify_impl' = 'dapo': Input should be 'hf_math_verify' "
                                          r"or 'dapo_math_verify'"):
        load_config({"env": {"again": {"actor_class_fqn": "tests.helpers.agents:Game", "math_verify_impl": "dapo"}}})


def test_nemo_rls_ppo_math_1B_loads_as_ppo_with_a_critic_scored_by_dapo_math_verify():
    cfg = load_config(NEMO_RL / "2026-08/ppo_math_1B.yaml")
    assert cfg.reward.function == "dapo_math_verify"
    estimator = cfg.grpo.adv_estimator
    assert (estimator.name, estimator.gae_lambda, estimator.gae_gamma, cfg.grpo.ppo_epochs) == ("gae", 0.95, 1, 4)
    assert (cfg.value_loss_fn.scale, cfg.value_loss_fn.cliprange) == (0.4, 0.2)
    assert cfg.value.model_name == cfg.policy.model_name and cfg.value.optimizer.kwargs["lr"] == 1e-5
    assert cfg.policy.optimizer.kwargs["lr"] == 1e-6 and cfg.value.precision == "bfloat16"


# ---------------------------------------------------------------------------------------------------
# Test data: NeMo RL's checker, the reference the tests above compare novarl's with. Copied verbatim
# (nothing changed below its license header) from NVIDIA-NeMo/RL, nemo_rl/environments/
# dapo_math_verifier.py at commit 7ea279a (7ea279abfbeb698b092856d0dab61e7cf39bc909), Apache-2.0;
# itself adapted from volcengine/verl, verl/utils/reward_score/math_dapo.py. Not part of novarl.
# ---------------------------------------------------------------------------------------------------

# Copyright (c) 2025, NVIDIA CORPORATION.  All rights reserved.
# Copyright 2024 Bytedance Ltd. and/or its affiliates
# Copyright 2022 EleutherAI and the HuggingFace Inc. team. All rights reserved.
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# Adapted from https://github.com/volcengine/verl/blob/main/verl/utils/reward_score/math_dapo.py

import re
from typing import Optional


def last_boxed_only_string(string: str) -> Optional[str]:
    """Extract the last LaTeX boxed expression from a string.

    Args:
        string: Input string containing LaTeX code

    Returns:
        The last boxed expression or None if not found
    """
    idx = string.rfind("\\boxed{")
    if idx < 0:
        return None

    i = idx
    right_brace_idx = None
    num_left_braces_open = 0

    while i < len(string):
        if string[i] == "{":
            num_left_braces_open += 1
        if string[i] == "}":
            num_left_braces_open -= 1
            if num_left_braces_open == 0:
                right_brace_idx = i
                break
        i += 1

    return string[idx : right_brace_idx + 1] if right_brace_idx is not None else None


def remove_boxed(s: str) -> str:
    r"""Remove the LaTeX boxed command from a string.

    Args:
        s: String with format "\\boxed{content}"

    Returns:
        The content inside the boxed command
    """
    left = "\\boxed{"
    assert s[: len(left)] == left, f"box error: {s}"
    assert s[-1] == "}", f"box error: {s}"
    return s[len(left) : -1]


# Constants for normalization
SUBSTITUTIONS = [
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
]

REMOVED_EXPRESSIONS = [
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    r"\mathrm{th}",
    r"^\circ",
    r"^{\circ}",
    r"\;",
    r",\!",
    "{,}",
    '"',
    "\\dots",
]


def normalize_final_answer(final_answer: str) -> str:
    """Normalize a final answer to a quantitative reasoning question.

    Args:
        final_answer: The answer string to normalize

    Returns:
        Normalized answer string
    """
    final_answer = final_answer.split("=")[-1]

    # Apply substitutions and removals
    for before, after in SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expr, "")

    # Extract and normalize LaTeX math
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)

    # Normalize shorthand TeX:
    #  \fracab -> \frac{a}{b}
    #  \frac{abc}{bef} -> \frac{abc}{bef}
    #  \fracabc -> \frac{a}{b}c
    #  \sqrta -> \sqrt{a}
    #  \sqrtab -> sqrt{a}b
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")

    # Normalize numbers
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")

    return final_answer.strip()


def is_correct_minerva(
    solution_str: str,
    gt: str,
    gt_need_extract: bool = False,
    answer_pattern: str = r"(?i)Answer\s*:\s*([^\n]+)",
) -> tuple[bool, str]:
    """Check if the solution is correct according to Minerva criteria.

    Args:
        solution_str: The solution string to check
        gt: The ground truth answer
        gt_need_extract: Whether the ground truth needs extraction
        answer_pattern: Regex pattern to extract the answer

    Returns:
        Tuple of (is_correct, normalized_prediction)
    """
    # Extract answer from solution
    match = re.findall(answer_pattern, solution_str)
    extracted_answer = match[-1] if match else "[INVALID]"
    pred = normalize_final_answer(extracted_answer)

    # Process ground truth
    if gt_need_extract:
        gt = normalize_final_answer(remove_boxed(last_boxed_only_string(gt)))
    else:
        gt = normalize_final_answer(gt)

    return (pred == gt), pred


def is_correct_strict_box(
    pred: str, gt: str, pause_tokens_index: Optional[list[int]] = None
) -> tuple[int, Optional[str]]:
    """Check if the prediction is correct using strict boxed answer criteria.

    Args:
        pred: The prediction string
        gt: The ground truth answer
        pause_tokens_index: Indices of pause tokens

    Returns:
        Tuple of (score, extracted_prediction)
    """
    # Extract the relevant part of the prediction
    if pause_tokens_index is not None:
        assert len(pause_tokens_index) == 4
        pred = pred[pause_tokens_index[-1] - 100 :]
    else:
        pred = pred[-100:]

    # Extract and check the boxed answer
    boxed_pred = last_boxed_only_string(pred)
    extracted_pred = remove_boxed(boxed_pred) if boxed_pred is not None else None

    return 1 if (extracted_pred == gt) else -1, extracted_pred


def verify(
    solution_str: str,
    answer: str,
    strict_box_verify: bool = False,
    pause_tokens_index: Optional[list[int]] = None,
) -> bool:
    """Verify if the solution is correct.

    Args:
        solution_str: The solution string to verify
        answer: The ground truth answer
        strict_box_verify: Whether to use strict box verification
        pause_tokens_index: Indices of pause tokens

    Returns:
        True if the solution is correct, False otherwise
    """
    if strict_box_verify:
        correct, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return correct == 1, pred

    correct, pred = is_correct_minerva(solution_str, answer)
    return correct, pred


def compute_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: Optional[list[int]] = None,
) -> float:
    """Compute the reward score for a solution.

    Args:
        solution_str: The solution string
        ground_truth: The ground truth answer
        strict_box_verify: Whether to use strict box verification
        pause_tokens_index: Indices of pause tokens

    Returns:
        Reward score (1.0 for correct, 0.0 for incorrect)
    """
    # Limit solution length for efficiency
    solution_str = solution_str[
        -300:
    ]  # The longest answer in MATH-500 has 159 characters

    # Verify the solution
    correct, pred = verify(
        solution_str, ground_truth, strict_box_verify, pause_tokens_index
    )

    reward = 1.0 if correct else 0.0
    acc = correct

    return {
        "score": reward,
        "acc": acc,
        "pred": pred,
    }
