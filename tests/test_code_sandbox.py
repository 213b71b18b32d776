"""The code sandbox (novarl/rewards/sandbox.py, sandbox_runner.py) and the code rewards over it
(novarl/rewards/code.py): hostile programs contained with the machine unharmed, rewards equal to
hand-computed pass rates in each test format, bad rows and a failing sandbox stopping the run."""

from __future__ import annotations

import json
import os
import queue
import socket
import sys
import threading
import uuid
from pathlib import Path

import pytest

from novarl.config.sections.data import RewardConfig
from novarl.errors import UserError
from novarl.rewards.code import extract_code, same_output
from novarl.rewards.sandbox import LocalSandbox, Program, SandboxError, SandboxLimits
from novarl.rewards.scorer import RewardScorer
from novarl.types import Completion, Prompt

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's tests run on Linux")


def runners() -> list[int]:
    """Processes of the sandbox still alive (its runner's command line names sandbox_runner.py)."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"sandbox_runner.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                alive.append(int(pid))
        except OSError:
            pass
    return alive


@pytest.fixture
def listener():
    """A TCP server on 127.0.0.1 that counts the connections it accepts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    accepted, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


def test_hostile_programs_are_contained_and_leave_nothing_behind(tmp_path, listener):
    port, accepted = listener
    outside = [tmp_path / "escape.txt", Path(f"/tmp/novarl-escape-{uuid.uuid4().hex}"), Path.home() / "escape.txt"]
    writes = "".join(f"try:\n    open({str(p)!r}, 'w').write('x')\nexcept OSError:\n    pass\n" for p in outside)
    hostile = {
        "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        # past the 256 MB at its first block: filling 64 MB blocks up to it took longer than the time limit
        # beside the fork bomb on a loaded 2-core host (status 'timeout')
        "memory": "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 28))\n",
        "loop": "while True:\n    pass\n",
        "output": "while True:\n    print('x' * 10000)\n",
        "files": writes + "open('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read())\n",
        "socket": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n",
        "daemon": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('left')\n",
    }
    sandbox = LocalSandbox(SandboxLimits(timeout_s=1.5, memory_mb=256, max_processes=16, max_output_bytes=1 << 16))
    outcomes = dict(zip(hostile, sandbox.run_all([Program(source) for source in hostile.values()])))
    if outcomes["loop"].isolation != "namespaces":
        pytest.skip(f"this host allows the sandbox no namespaces: {outcomes['loop'].notes}")
    status = {name: outcome.runs[0].status for name, outcome in outcomes.items()}
    assert status == {"fork bomb": "timeout", "memory": "memory", "loop": "timeout", "output": "output",
                      "files": "ok", "socket": "error", "daemon": "ok"}
    assert len(outcomes["output"].runs[0].stdout) == 1 << 16
    assert outcomes["files"].runs[0].stdout == "ok\n"
    assert not any(p.exists() for p in outside)
    assert "Network is unreachable" in outcomes["socket"].runs[0].stderr and not accepted
    assert outcomes["daemon"].runs[0].seconds < 1.0  # its detached child did not hold the run
    assert runners() == []

    # without namespaces (isolate: false; a container that refuses them) the limits still hold, a fork bomb
    # included: as root the runner becomes a user of the sandbox's first, whom the process count binds
    plain = LocalSandbox(SandboxLimits(timeout_s=1.0, max_output_bytes=1000, max_processes=16), isolate=False,
                         workers=3)
    loop, output, bomb = plain.run_all([Program(hostile["loop"]), Program(hostile["output"]),
                                        Program(hostile["fork bomb"])])
    assert (loop.isolation, loop.runs[0].status, output.runs[0].status) == ("limits", "timeout", "output")
    assert bomb.runs[0].status == "timeout" and runners() == []


def test_without_namespaces_a_fork_bomb_leaves_the_program_beside_it_its_processes():
    """The process count is a user's: each program running at once is a user of its own (as root), so
    a program that forks while a fork bomb beside it holds all its processes still forks. With one user
    for both (as before), it could not."""
    if os.getuid() != 0:
        pytest.skip("the sandbox changes user only where novarl runs as root")
    sandbox = LocalSandbox(SandboxLimits(timeout_s=4.0, max_processes=16), isolate=False, workers=2)
    # the late fork waits until the sandbox's users hold 16 processes (the bomb at its limit: on a loaded machine
    # its runner may start seconds after this one), or 3 s
    late_fork = (f"import os, time\nusers = {{{sandbox.uid}, {sandbox.uid - 1}}}\n"
                 "def held():\n    n = 0\n    for pid in filter(str.isdigit, os.listdir('/proc')):\n"
                 "        try:\n            n += os.stat('/proc/' + pid).st_uid in users\n"
                 "        except OSError:\n            pass\n    return n\n"
                 "deadline = time.time() + 3\nwhile held() < 16 and time.time() < deadline:\n    time.sleep(0.05)\n"
                 "pid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\nprint('forked')\n")
    programs = [Program("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"),
                Program(late_fork)]
    bomb, beside = sandbox.run_all(programs)
    assert bomb.runs[0].status == "timeout"
    assert (beside.runs[0].status, beside.runs[0].stdout) == ("ok", "forked\n")
    shared = LocalSandbox(SandboxLimits(timeout_s=4.0, max_processes=16), isolate=False, workers=2)
    shared._free_uids = queue.SimpleQueue()
    shared._free_uids.put(shared.uid), shared._free_uids.put(shared.uid)  # both slots one user: the old way
    _, starved = shared.run_all(programs)  # its runner or its program finds no process left to start
    assert isinstance(starved, SandboxError) or starved.runs[0].status == "error", starved
    assert runners() == []


def completion(text: str, **columns) -> Completion:
    return Completion(Prompt("write the program", [1], None, columns=columns), [1], [0.0], text, "stop", 0)


ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TWICE = "Here it is:\n```python\ndef twice(x):\n    return 2 * x\n```\n```python\nprint(twice(3))\n```"
STDIO = [{"stdin": "2 3", "expected_stdout": "5"}, {"stdin": "10 5\n", "expected_stdout": "15\n"},
         {"stdin": "1 1", "expected_stdout": "3"}]


ROWS = [  # (completion, columns, tests passed of tests)
    (ADD, {"test_cases": json.dumps(STDIO), "case_type": "input"}, (2, 3)),
    (ADD, {"input_output": {"inputs": ["1 2", "3 4"], "outputs": ["3", "7.0000000001"]}}, (2, 2)),
    (TWICE, {"test_cases": [{"assert_code": "assert twice(2) == 4"}, {"assert_code": "assert twice(3) == 7"},
                            {"assert_code": "def test_zero():\n    assert twice(0) == 0\n"}],
             "case_type": "pytest"}, (2, 3)),
    (TWICE, {"test_cases": [{"assert_code": "def check(candidate):\n    assert candidate(5) == 10\n",
                             "entry_point": "twice"}], "case_type": "check_based"}, (1, 1)),
    (TWICE, {"tests": ["assert twice(1) == 2", "assert twice(1) == 3"]}, (1, 2)),
    (TWICE, {"test": "def check(f):\n    assert f(4) == 9\n", "entry_point": "twice"}, (0, 1)),
    ("The answer is 42.", {"test_cases": [{"assert_code": "assert '42' in {response}"}], "case_type": "text"},
     (1, 1)),
    ("```python\nimport os\ndef twice(x):\n    os._exit(0)\n```", {"tests": ["assert twice(1) == 2"]}, (0, 1)),
    ("```python\nraise ValueError('broken')\ndef twice(x):\n    return 2 * x\n```",
     {"tests": ["assert twice(1) == 2"]}, (0, 1)),
    ("```python\nwhile True:\n    pass\n```", {"tests": ["assert True"]}, (0, 1)),
]


def test_code_rewards_equal_hand_computed_pass_rates():
    rows = ROWS
    completions = [completion(text, **columns) for text, columns, _ in rows]
    for name, expected in (("code_pass_rate", [p / n for _, _, (p, n) in rows]),
                           ("code_tests", [float(p == n) for _, _, (p, n) in rows])):
        settings = RewardConfig(function=name, sandbox={"timeout_s": 1.0})
        scorer = RewardScorer.from_spec(settings.function, settings=settings)
        assert scorer.score(completions) == pytest.approx(expected)
        metrics = scorer.take_metrics()
        assert metrics[f"reward/{name}/timeout"] == pytest.approx(1 / len(rows))
        assert metrics[f"reward/{name}/sandbox_failed"] == 0.0
    assert runners() == []


def test_extraction_and_output_comparison():
    assert extract_code(TWICE) == "def twice(x):\n    return 2 * x\n"
    assert extract_code("<think>```python\nprint(1)\n```</think>print(2)") == "print(2)"
    assert extract_code("```\nprint(1)\n```\n```\nprint(2)\n```") == "print(1)\n"
    assert same_output("1 2\n3  \n", "1 2 3") and same_output("0.3333333", "0.33333331")
    assert not same_output("1 2", "1 2 3") and not same_output("abc", "abd")


def test_rows_without_usable_tests_and_a_failing_sandbox_stop_the_run():
    scorer = RewardScorer.from_spec("code_tests", settings=RewardConfig(function="code_tests"))
    with pytest.raises(UserError, match="has no tests: give a column test_cases.*columns: prompt_id"):
        scorer.score([completion(ADD, prompt_id=3)])
    with pytest.raises(UserError, match="call-based tests .* are not built"):
        scorer.score([completion(ADD, test_cases=STDIO, test_case_function="solve")])
    with pytest.raises(UserError, match="test_cases items are neither"):
        scorer.score([completion(ADD, test_cases=[{"given": 1}])])
    broken = RewardScorer.from_spec("code_tests", settings=RewardConfig(function="code_tests"))
    broken.terms[0].fn.sandbox.python = "/nonexistent/python"
    with pytest.raises(UserError, match="the code sandbox failed on 2 of 2 programs .* did not start"):
        broken.score([completion(ADD, test_cases=STDIO)] * 2)


def test_sandbox_settings_are_warned_about_when_no_code_reward_runs():
    from novarl.config import load_config

    unused = load_config(overrides=["reward.sandbox.timeout_s=3"])
    assert any("'reward.sandbox' is set" in w for w in unused.load_warnings)
    used = load_config(overrides=["reward.function=code_tests", "reward.sandbox.timeout_s=3"])
    assert not any("reward.sandbox" in w for w in used.load_warnings)


def test_the_remote_sandbox_scores_as_the_local_one_and_a_service_that_is_down_stops_the_run():
    """reward.sandbox.url: SandboxFusion's /run_code (served here by tests/helpers/sandbox_fusion.py)."""
    from tests.helpers.sandbox_fusion import FusionService

    rows = ROWS[:9]  # the endless loop aside (the service's own timeout is tested locally)
    completions = [completion(text, **columns) for text, columns, _ in rows]
    with FusionService() as service:
        settings = RewardConfig(function="code_pass_rate", sandbox={"timeout_s": 2.0, "url": service.url})
        scorer = RewardScorer.from_spec(settings.function, settings=settings)
        assert scorer.score(completions) == pytest.approx([p / n for _, _, (p, n) in rows])
        assert service.requests == sum(n for _, _, (_, n) in rows)  # one request per input or test
        url = service.url
    down = RewardConfig(function="code_tests", sandbox={"timeout_s": 2.0, "url": url})
    with pytest.raises(UserError, match="the code sandbox failed on 2 of 2 programs .* failed 3 time"):
        RewardScorer.from_spec("code_tests", settings=down).score(completions[:2])
