"""Running generated programs without trusting them: novarl's code sandbox.

`LocalSandbox` runs each program in a process tree of its own (novarl/rewards/sandbox_runner.py
says how it is contained: on Linux, namespaces with no network, a read-only view of the host's
files and a tmpfs folder, a process-id namespace that takes every leftover process with it; limits
on memory, CPU seconds, processes, output and file sizes everywhere). Programs run `workers` at
once. A program is either run once per standard input (stdin/stdout tests) or run once followed
by assert-style tests in its globals (each test's verdict apart).

What a program does to itself is its result (`RunResult.status`: ok, error, timeout, memory,
output, processes, signal); only the sandbox failing (the runner did not start or report) is a
`SandboxError`.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

RUNNER = Path(__file__).with_name("sandbox_runner.py")
STARTUP_GRACE_S = 10.0
"""Seconds beyond the programs' own limits before the sandbox itself counts as failed."""


class SandboxError(RuntimeError):
    """The sandbox could not run a program (not the program's own failure)."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    """Wall-clock seconds of one run."""
    memory_mb: int = 1024
    """Address space of a program's process, MiB."""
    max_processes: int = 64
    """Processes a program may have at once."""
    max_output_bytes: int = 1 << 20
    """Standard output kept; past it the run stops (status 'output')."""
    max_file_mb: int = 64
    """Size of the program's folder (a tmpfs where namespaces are available) and of any file it writes."""
    cpu_s: float | None = None
    """CPU seconds of one run; None: timeout_s."""


@dataclass(frozen=True)
class Program:
    source: str
    stdins: tuple[str, ...] = ("",)
    """Runs it once per standard input (when `tests` is None)."""
    tests: tuple[str, ...] | None = None
    """Assert-style tests, run in order after the program in its globals (one run)."""
    entry_point: str | None = None
    """With tests that define check(candidate) (HumanEval's form): the program's function to pass."""


@dataclass(frozen=True)
class RunResult:
    status: str
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    passed: tuple[bool, ...] | None = None
    """Assert-style tests: each one's verdict."""


@dataclass(frozen=True)
class Outcome:
    runs: tuple[RunResult, ...]
    isolation: str = ""
    """'namespaces', or 'limits' where the host allows no namespaces."""
    notes: tuple[str, ...] = field(default=())


@dataclass
class LocalSandbox:
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    workers: int = 2
    isolate: bool = True
    """Namespaces where the host allows them (False: limits, process group and folder only)."""
    site_packages: bool = False
    """Programs may import the interpreter's installed packages (False: the standard library only)."""
    python: str = sys.executable
    uid: int = 65534
    """Where novarl runs as root: the host's user id of the sandbox's processes (nobody's by default;
    a process-count limit binds no process of root's), the first of `workers` ids (uid, uid - 1, ...):
    each program running at once has one of its own, so that another's processes never count against
    its limit (without namespaces the process count is the user's: a fork bomb would otherwise keep the
    programs beside it from starting)."""
    _free_uids: queue.SimpleQueue = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._free_uids = queue.SimpleQueue()
        for slot in range(max(1, self.workers)):
            self._free_uids.put(self.uid - slot if self.uid > slot else self.uid)

    def run_all(self, programs: Sequence[Program]) -> list[Outcome | SandboxError]:
        """Each program's outcome, or the SandboxError that stopped it, `workers` at a time."""
        def one(program: Program) -> Outcome | SandboxError:
            try:
                return self.run(program)
            except SandboxError as err:
                return err

        if len(programs) <= 1 or self.workers <= 1:
            return [one(p) for p in programs]
        with ThreadPoolExecutor(min(self.workers, len(programs)), thread_name_prefix="novarl-sandbox") as pool:
            return list(pool.map(one, programs))

    def run(self, program: Program) -> Outcome:
        """The program's outcome; at most `workers` run at once (each as a user of its own, see uid)."""
        uid = self._free_uids.get()
        try:
            return self._run(program, uid)
        finally:
            self._free_uids.put(uid)

    def _run(self, program: Program, uid: int) -> Outcome:
        limits = self.limits
        runs = 1 if program.tests is not None else len(program.stdins)
        workdir = tempfile.mkdtemp(prefix="novarl-sandbox-")
        job = {"nonce": secrets.token_hex(16), "workdir": workdir, "isolate": self.isolate, "uid": uid,
               "site": self.site_packages, "source": program.source, "entry_point": program.entry_point,
               "tests": None if program.tests is None else list(program.tests), "stdins": list(program.stdins),
               "limits": {"timeout_s": limits.timeout_s, "cpu_s": limits.cpu_s or limits.timeout_s,
                          "memory_mb": limits.memory_mb, "max_processes": limits.max_processes,
                          "max_output_bytes": limits.max_output_bytes, "max_file_mb": limits.max_file_mb}}
        try:
            lines, stderr = self._start(job, runs * limits.timeout_s + STARTUP_GRACE_S)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return _outcome(lines, stderr, runs)

    def _start(self, job: dict, deadline_s: float) -> tuple[list[str], str]:
        read, write = os.pipe()
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": job["workdir"],
               "OMP_NUM_THREADS": "1"}
        try:
            process = subprocess.Popen([self.python, "-I", "-S", str(RUNNER), str(read)], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(read,), env=env,
                                       cwd=job["workdir"], start_new_session=True)
        except OSError as err:
            os.close(read), os.close(write)
            raise SandboxError(f"the sandbox's interpreter {self.python} did not start: {err}") from None
        os.close(read)
        try:
            with os.fdopen(write, "wb") as channel:
                channel.write(json.dumps(job).encode())
            out, err = process.communicate(timeout=deadline_s)
        except BrokenPipeError:
            out, err = process.communicate()
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            process.communicate()
            raise SandboxError(f"the sandbox did not finish within {deadline_s:g} s (its programs' limits "
                               f"and {STARTUP_GRACE_S:g} s)") from None
        finally:
            _kill_group(process.pid)
        return out.decode("utf-8", "replace").splitlines(), err.decode("utf-8", "replace")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _outcome(lines: list[str], stderr: str, runs: int) -> Outcome:
    try:
        records = [json.loads(line) for line in lines if line.strip()]
    except json.JSONDecodeError:
        records = []
    if not records or "isolation" not in records[0] or len(records) != runs + 1:
        last = " ".join(stderr.strip().splitlines()[-3:])[-400:] or "no message"
        raise SandboxError(f"the sandbox reported {max(len(records) - 1, 0)} of {runs} run(s): {last}")
    head, results = records[0], records[1:]
    return Outcome(tuple(RunResult(r["status"], r["stdout"], r["stderr"], r["seconds"],
                                   None if r.get("passed") is None else tuple(r["passed"])) for r in results),
                   head["isolation"], tuple(head["notes"]))


@dataclass
class RemoteSandbox:
    """Programs run by a SandboxFusion service (its POST /run_code; verl's and ROLL's remote sandbox):
    one request per standard input, or per assert-style test (the program, then the test, then a
    line with a token the test must reach). Connection failures and the service's SandboxError are
    retried `retries` times, then the program's outcome is a SandboxError."""

    url: str
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    workers: int = 8
    retries: int = 2

    def run_all(self, programs: Sequence[Program]) -> list[Outcome | SandboxError]:
        import httpx

        with httpx.Client(timeout=self.limits.timeout_s + STARTUP_GRACE_S) as client:
            def one(program: Program) -> Outcome | SandboxError:
                try:
                    return self.run(program, client)
                except SandboxError as err:
                    return err

            with ThreadPoolExecutor(max(1, min(self.workers, len(programs))), thread_name_prefix="novarl-remote") \
                    as pool:
                return list(pool.map(one, programs))

    def run(self, program: Program, client=None) -> Outcome:
        if client is None:
            return _single(self.run_all([program]))
        if program.tests is None:
            return Outcome(tuple(self._request(client, program.source, stdin) for stdin in program.stdins), "remote")
        token = secrets.token_hex(16)
        verdicts, runs = [], []
        for test in program.tests:
            check = f"\ncheck({program.entry_point})" if program.entry_point else ""
            run = self._request(client, f"{program.source}\n{test}{check}\n{CALL_TESTS}\nprint({token!r})", "")
            verdicts.append(run.status == "ok" and token in run.stdout)
            runs.append(run)
        first = runs[0] if runs else RunResult("ok")
        return Outcome((RunResult(first.status, first.stdout, first.stderr, sum(r.seconds for r in runs),
                                  tuple(verdicts)),), "remote")

    def _request(self, client, code: str, stdin: str) -> RunResult:
        import httpx

        body = {"code": code, "language": "python", "stdin": stdin, "run_timeout": self.limits.timeout_s,
                "compile_timeout": self.limits.timeout_s, "memory_limit_MB": self.limits.memory_mb}
        problem = ""
        for _ in range(self.retries + 1):
            try:
                reply = client.post(f"{self.url.rstrip('/')}/run_code", json=body)
                answer = reply.json() if reply.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as err:
                problem = f"{type(err).__name__}: {err}"
                continue
            if answer is None or answer.get("status") == "SandboxError":
                problem = f"HTTP {reply.status_code}" if answer is None else f"SandboxError: {answer.get('message')}"
                continue
            return _remote_result(answer)
        raise SandboxError(f"the sandbox service at {self.url} failed {self.retries + 1} time(s): {problem[:300]}")


CALL_TESTS = ("for _name, _test in list(globals().items()):\n"
              "    if _name.startswith('test_') and callable(_test):\n"
              "        _test()")
"""Appended to a remote test: pytest's form, functions named test_*, called (as the local runner does)."""


def _remote_result(answer: dict) -> RunResult:
    run = answer.get("run_result") or {}
    kind = run.get("status")
    status = "timeout" if kind == "TimeLimitExceeded" else \
        "ok" if kind == "Finished" and run.get("return_code") == 0 else "error"
    return RunResult(status, run.get("stdout") or "", (run.get("stderr") or "")[-2000:],
                     float(run.get("execution_time") or 0.0))


def _single(outcomes: list[Outcome | SandboxError]) -> Outcome:
    if isinstance(outcomes[0], SandboxError):
        raise outcomes[0]
    return outcomes[0]
