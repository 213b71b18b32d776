"""reward.function as 'module:function' found in the working directory, and as a
path to a Python file ('rewards.py:fn', './rewards.py:fn', 'sub/dir/rewards.py:fn',
'/abs/rewards.py:fn'): each imports the user's real file, and every way that can
fail is a `UserError` naming reward.function, the file and what went wrong."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from novarl.cli import main
from novarl.errors import UserError
from novarl.rewards.registry import import_reward_fn
from novarl.rewards.scorer import RewardScorer
from novarl.types import Completion, Prompt

PROMPT = Prompt(text="1+1=", token_ids=[1, 2, 3], answer="2", index=0)

# Scores no built-in reward gives: seeing them proves the user's file ran.
REWARD_SOURCE = """
def fn(completion, answer):
    return 0.75 if completion.strip() == answer else -0.25
"""


def completion(text: str) -> Completion:
    return Completion(prompt=PROMPT, token_ids=[4, 5], logprobs=[-0.1, -0.2], text=text,
                      finish_reason="stop", policy_version=0)


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """tmp_path as the working directory, which is NOT on sys.path (as under the `novarl`
    console script); sys.path and the modules the test imports are restored after it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith(("novarl_reward_file_", "cwd_")):
            del sys.modules[name]


def scores(spec: str) -> list[float]:
    scorer = RewardScorer.from_spec(spec)
    assert scorer.name == spec
    return scorer.score([completion(" 2"), completion("3")])


# ============================================================ module:function from the working directory
def test_module_in_the_working_directory(workdir):
    write(workdir / "cwd_myreward.py", REWARD_SOURCE)
    assert scores("cwd_myreward:fn") == [0.75, -0.25]
    assert sys.path[-1] == str(workdir)  # appended last: it shadows no installed module


def test_package_in_the_working_directory(workdir):
    write(workdir / "cwd_rewards_pkg" / "__init__.py", "")
    write(workdir / "cwd_rewards_pkg" / "scoring.py", REWARD_SOURCE)
    assert scores("cwd_rewards_pkg.scoring:fn") == [0.75, -0.25]


def test_module_on_sys_path_wins_over_the_working_directory(workdir):
    write(workdir / "json.py", "def loads(*args):\n    return 'shadowed'\n")
    assert import_reward_fn("json:loads")("[1]") == [1]


def test_module_found_nowhere_says_where_it_looked(workdir):
    with pytest.raises(UserError) as err:
        import_reward_fn("cwd_not_there:fn")
    assert str(err.value) == (f"reward.function='cwd_not_there:fn': importing module 'cwd_not_there' failed: "
                              f"ModuleNotFoundError: No module named 'cwd_not_there' (looked on sys.path and in "
                              f"the working directory {workdir}).")


def test_module_in_the_working_directory_that_fails_to_import(workdir):
    write(workdir / "cwd_broken.py", "import json\nimport cwd_missing_dependency\n")
    with pytest.raises(UserError) as err:
        import_reward_fn("cwd_broken:fn")
    msg = str(err.value)
    assert msg.startswith(f"reward.function='cwd_broken:fn': importing module 'cwd_broken' from the working "
                          f"directory {workdir} failed: ModuleNotFoundError: No module named 'cwd_missing_dependency'")
    assert f"(raised at {workdir / 'cwd_broken.py'}:2)" in msg
    assert str(workdir) not in sys.path


# ============================================================ path/to/file.py:function
@pytest.mark.parametrize("location, spec", [
    ("rewards.py", "rewards.py:fn"),
    ("rewards.py", "./rewards.py:fn"),
    ("sub/dir/rewards.py", "sub/dir/rewards.py:fn"),
    ("elsewhere/rewards.py", "{root}/elsewhere/rewards.py:fn"),
])
def test_file_path_forms(workdir, location, spec):
    write(workdir / location, REWARD_SOURCE)
    assert scores(spec.format(root=workdir)) == [0.75, -0.25]


def test_file_path_from_another_working_directory_is_relative_to_it(workdir, monkeypatch):
    write(workdir / "a" / "rewards.py", REWARD_SOURCE)
    monkeypatch.chdir(workdir / "a")
    assert scores("rewards.py:fn") == [0.75, -0.25]


def test_two_files_with_the_same_name_do_not_clash(workdir):
    write(workdir / "one" / "rewards.py", "def fn(completion, answer):\n    return 1.0\n")
    write(workdir / "two" / "rewards.py", "def fn(completion, answer):\n    return 2.0\n")
    assert import_reward_fn("one/rewards.py:fn")("", None) == 1.0
    assert import_reward_fn("two/rewards.py:fn")("", None) == 2.0
    assert import_reward_fn("./one/rewards.py:fn")("", None) == 1.0  # the same file: the same module


def test_file_imports_the_files_beside_it(workdir):
    write(workdir / "sub" / "cwd_helper_scores.py", "RIGHT = 0.5\n")
    write(workdir / "sub" / "rewards.py", """
        from cwd_helper_scores import RIGHT

        def fn(completion, answer, prompt):
            return RIGHT if prompt == "1+1=" and completion.strip() == answer else 0.0
    """)
    assert scores("sub/rewards.py:fn") == [0.5, 0.0]


@pytest.mark.parametrize("files, spec, expected", [
    ({}, "nope.py:fn",
     "the file '{root}/nope.py' does not exist (a relative path is taken from the working directory, {root})."),
    ({}, "{root}/nope.py:fn", "the file '{root}/nope.py' does not exist."),
    ({"sub/x.py": ""}, "sub:fn", "importing module 'sub' failed: ModuleNotFoundError"),
    ({"sub/x.py": ""}, "./sub:fn", "the file '{root}/sub' is a folder, not a Python file"),
    ({"bad.py": "def fn(:\n    pass\n"}, "bad.py:fn",
     "loading file '{root}/bad.py' failed: SyntaxError: invalid syntax (bad.py, line 1)."),
    ({"boom.py": "x = 1\nraise RuntimeError('no GPU for the verifier')\n"}, "boom.py:fn",
     "loading file '{root}/boom.py' failed: RuntimeError: no GPU for the verifier (raised at {root}/boom.py:2)."),
    ({"rewards.py": REWARD_SOURCE}, "rewards.py:score", "file '{root}/rewards.py' has no function 'score'."),
    ({"rewards.py": "score = 1.0\n"}, "rewards.py:score",
     "'score' in file '{root}/rewards.py' is not a function (its type is float)."),
    ({}, "rewards.py:", "is neither a registered reward (exact_match, math_verify, boxed_match, last_number, "
                        "boxed_format, crossthinkqa, crossthinkqa_loose, crossthinkqa_strict, ifeval, dapo_math_verify, code_tests, "
                        "code_pass_rate, reward_model, llm_judge) nor an import path 'module:function' or 'path/to/file.py:function'."),
], ids=["missing", "missing-absolute", "folder-as-module", "folder-as-file", "syntax-error", "raises-on-import",
        "no-such-function", "not-callable", "no-function-named"])
def test_file_path_errors_name_the_setting_the_file_and_the_problem(workdir, files, spec, expected):
    for name, source in files.items():
        write(workdir / name, source)
    spec = spec.format(root=workdir)
    with pytest.raises(UserError) as err:
        import_reward_fn(spec)
    msg = str(err.value)
    assert msg.startswith(f"reward.function='{spec}'")
    assert expected.format(root=workdir) in msg


def test_a_file_that_failed_to_load_loads_once_fixed(workdir):
    write(workdir / "rewards.py", "raise ImportError('half-written')\n")
    with pytest.raises(UserError, match="ImportError: half-written"):
        import_reward_fn("rewards.py:fn")
    assert str(workdir) not in sys.path
    write(workdir / "rewards.py", REWARD_SOURCE)
    assert scores("rewards.py:fn") == [0.75, -0.25]


def test_train_with_a_broken_reward_file_exits_2_without_traceback(workdir, capsys):
    write(workdir / "rewards.py", "def fn(completion, answer)\n    return 1.0\n")
    code = main(["train", f"logger.log_dir={workdir / 'logs'}", "reward.function=rewards.py:fn"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert f"novarl: error: reward.function='rewards.py:fn': loading file '{workdir}/rewards.py' failed: " \
           "SyntaxError" in err


# ============================================================ a fresh interpreter without the cwd on sys.path
def test_cwd_module_is_found_by_the_working_directory_not_sys_path(tmp_path):
    write(tmp_path / "myreward.py", REWARD_SOURCE)
    code = textwrap.dedent("""
        import os, sys
        assert "" not in sys.path and os.getcwd() not in sys.path, sys.path
        from novarl.rewards.registry import import_reward_fn
        fn = import_reward_fn("myreward:fn")
        print(fn.__module__, fn("2", "2"), fn("3", "2"))
    """)
    proc = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["myreward", "0.75", "-0.25"]
