"""Tools: a user's Python functions that the model calls during an episode.

`ToolEnvironment` is an environment (rollout/environment.py) built from its env block's cfg:

    env:
      calc:
        actor_class_fqn: novarl.rollout.tools:ToolEnvironment
        cfg:
          tools: [my_tools.py:add, my_tools.py:multiply]   # functions, by import path
          reward: exact_match        # scores the final answer: a registered reward or 'module:function'
          parser: hermes             # how tool calls are written (TOOL_CALL_PARSERS)
          timeout_s: 10              # per call
          max_calls_per_turn: 4

Each of the model's turns is read for tool calls. With calls, they run concurrently (each with its
timeout; at most max_calls_per_turn, the rest refused) and their results go back as one message of
role "tool" (Hermes's `<tool_response>` blocks, as Qwen's chat template renders tool messages), and
the episode goes on. A turn without a call is the final answer: scored by `reward(answer text,
example's answer)`, and the episode ends. A malformed call, an unknown tool, a tool that raises or
times out: the model reads what went wrong in the response and the episode goes on. Counted per
step (`take_metrics`): tool_calls, tool_errors, tool_timeouts.

The schemas (`tool_schemas`) are OpenAI's function format, made from each function's signature and
docstring; a run passes them to the chat template as `tools` when its prompts are chat messages.
A timed-out call's thread (a daemon) is left to finish on its own (Python cannot stop a thread): a
tool that must be contained runs in the sandbox of the reward-services issue.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import time
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from novarl.rollout.environment import EnvStep

JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class BadCall:
    """A tool call the parser could not read."""

    text: str
    why: str


def parse_hermes(text: str) -> list[ToolCall | BadCall]:
    """Hermes / Qwen's form: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number."""
    calls: list[ToolCall | BadCall] = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.DOTALL):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(BadCall(body.strip(), f"not JSON ({err.msg})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(BadCall(body.strip(), 'a call is {"name": ..., "arguments": {...}}'))
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(BadCall(body.strip(), "arguments is an object of the parameters"))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


TOOL_CALL_PARSERS: dict[str, Callable[[str], list[ToolCall | BadCall]]] = {"hermes": parse_hermes}
"""cfg.parser -> how a turn's text holds its tool calls."""


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """OpenAI's function schema from a function: its name, its docstring's first paragraph, and a
    JSON-schema parameter for each argument (its type from the annotation, its description from
    a docstring line `name: text`); parameters without a default are required."""
    doc = inspect.getdoc(fn) or ""
    described = dict(re.findall(r"^\s*(\w+)(?:\s*\([^)]*\))?\s*:\s*(.+)$", doc, flags=re.MULTILINE))
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for name, parameter in inspect.signature(fn).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        kind = typing.get_origin(hints.get(name)) or hints.get(name)
        spec: dict[str, Any] = {"type": JSON_TYPES.get(kind, "string")} if kind in JSON_TYPES else {}
        if name in described:
            spec["description"] = described[name].strip()
        properties[name] = spec
        if parameter.default is parameter.empty:
            required.append(name)
    summary = doc.split("\n\n")[0].replace("\n", " ").strip()
    return {"type": "function", "function": {"name": fn.__name__, "description": summary,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


class ToolEnvironment:
    """An environment whose model calls the user's tools until it answers (see the module doc)."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        from novarl.errors import UserError
        from novarl.rewards.registry import import_attribute, import_reward_fn

        specs = cfg.get("tools") or []
        if not isinstance(specs, list) or not specs:
            raise ValueError("cfg.tools is a list of functions by import path ('module:function')")
        self.tools: dict[str, Callable[..., Any]] = {}
        for spec in specs:
            fn, where = import_attribute(str(spec), "cfg.tools")
            if not callable(fn):
                raise UserError(f"cfg.tools: '{spec}' in {where} is not a function")
            self.tools[fn.__name__] = fn
        self.tool_schemas = [tool_schema(fn) for fn in self.tools.values()]
        self.reward = import_reward_fn(str(cfg.get("reward", "exact_match")))
        parser = cfg.get("parser", "hermes")
        if parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"cfg.parser={parser!r}: one of {', '.join(TOOL_CALL_PARSERS)}")
        self.parse = TOOL_CALL_PARSERS[parser]
        self.timeout_s = float(cfg.get("timeout_s", 10.0))
        self.max_calls = int(cfg.get("max_calls_per_turn", 4))
        self.counts = dict.fromkeys(("tool_calls", "tool_errors", "tool_timeouts"), 0)
        self.lock = threading.Lock()
        """Episodes' steps run on several threads at once (env.<name>.num_workers): the counts are shared."""

    def take_metrics(self) -> dict[str, float]:
        """The calls, errors and timeouts since the last time (a step's)."""
        with self.lock:
            out = {name: float(count) for name, count in self.counts.items()}
            self.counts = dict.fromkeys(self.counts, 0)
        return out

    def count(self, name: str) -> None:
        with self.lock:
            self.counts[name] += 1

    def step(self, conversation, metadata: Mapping[str, Any]) -> EnvStep:
        text = conversation[-1]["content"]
        calls = self.parse(text)
        if not calls:
            answer = metadata.get("answer")
            return EnvStep(reward=float(self.reward(text, "" if answer is None else str(answer))), done=True,
                           metadata=metadata)
        responses = self.run(calls)
        content = "".join(f"<tool_response>\n{response}\n</tool_response>\n" for response in responses)
        invalid = any(isinstance(call, BadCall) or call.name not in self.tools for call in calls)
        return EnvStep(reward=0.0, done=False, observation={"role": "tool", "content": content}, metadata=metadata,
                       flags=frozenset({"invalid_tool_call"}) if invalid else frozenset())

    def run(self, calls: list[ToolCall | BadCall]) -> list[str]:
        """Each call's response text, in order: the tool's result (JSON when it is not a string),
        or what went wrong; the calls past max_calls_per_turn are refused. The calls run at once and
        share one deadline, timeout_s from now."""
        futures: list[Any] = []
        for index, call in enumerate(calls):
            self.count("tool_calls")
            if index >= self.max_calls:
                futures.append(f"error: at most {self.max_calls} tool calls a turn")
            elif isinstance(call, BadCall):
                futures.append(f"error: a malformed tool call ({call.why}): {call.text[:200]}")
            elif call.name not in self.tools:
                futures.append(f"error: no tool named {call.name!r} (tools: {', '.join(self.tools)})")
            else:
                futures.append(Running(self.tools[call.name], call.arguments))
        responses = []
        deadline = time.monotonic() + self.timeout_s
        for item in futures:
            if isinstance(item, str):
                self.count("tool_errors")
                responses.append(item)
                continue
            finished, result, err = item.wait(max(0.0, deadline - time.monotonic()))
            if not finished:
                self.count("tool_timeouts")
                responses.append(f"error: the tool did not answer within {self.timeout_s:g} s")
            elif err is not None:  # the tool's own error, or arguments it does not take
                self.count("tool_errors")
                responses.append(f"error: {type(err).__name__}: {' '.join(str(err).split())[:300]}")
            else:
                responses.append(result if isinstance(result, str) else json.dumps(result, default=str))
        return responses


class Running:
    """A tool call on a daemon thread of its own: one that never returns does not hold the process
    at exit (a thread pool's workers would)."""

    def __init__(self, fn: Callable[..., Any], arguments: dict[str, Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, arguments), daemon=True, name="novarl-tool")
        self.thread.start()

    def _run(self, fn: Callable[..., Any], arguments: dict[str, Any]) -> None:
        try:
            self.result = fn(**arguments)
        except BaseException as err:  # handed to the caller, who tells the model
            self.error = err

    def wait(self, seconds: float) -> tuple[bool, Any, BaseException | None]:
        """(finished within `seconds`, its result, what it raised)."""
        self.thread.join(seconds)
        return not self.thread.is_alive(), self.result, self.error
