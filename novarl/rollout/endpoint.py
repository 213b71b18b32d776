"""An OpenAI-compatible chat endpoint over the run's engines, for agents written against the
`openai` client (or any framework that speaks its API): `POST .../v1/chat/completions`, tools
included, served on 127.0.0.1 with a bearer token made for the run.

Each episode is a session of its own (its id in the base URL the agent's client is given). The
endpoint renders a request's messages with the run's chat template and records what the
engine sampled, token by token, with the engine's logprobs, so that the run trains on exactly
the tokens sampled -- never on a re-tokenisation of the conversation:
- a request whose messages continue the session's conversation (the messages it knows, its
  own replies included, then new ones: tool results, the user's next message) extends the
  trajectory: the new messages are rendered once, as the template writes them after the
  model's turn (episodes.TemplateTokens), and appended as observed tokens (no loss);
- a request that does not (the agent rewrote or dropped part of the history) starts a new
  segment from the whole rendering; each segment trains as a sequence of its own with the
  episode's advantage (Completion.segments), and the rewrite is counted (agent_rewrites).

Requests from all the sessions are gathered into batches for the engines (a batch goes once every
session with a request in flight has sent it, or after a short wait), each turn seeded by its
episode and turn (episodes.turn_seed). The run's sampling holds: a request's own temperature,
top_p or seed are not used (the trainer's logprobs assume the run's); its max_tokens may lower
the run's max_new_tokens. Streaming and n > 1 are refused (400).
"""

from __future__ import annotations

import hmac
import itertools
import json
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from novarl.backends.protocols import ContinuousEngine, GenerationBackend
from novarl.rollout.environment import Message
from novarl.rollout.episodes import Episode, ObservationTokens, turn_seed
from novarl.types import Completion, Prompt, SamplingConfig

BATCH_WAIT_S = 0.02
"""A batch waits for the requests of the open sessions that have none in yet while they keep coming:
until none came for this long (agents that answered the last batch are still writing their next
request: generating meanwhile would share the CPU with them, and run a smaller batch)."""
BATCH_MAX_WAIT_S = 1.0
"""The longest a request waits for others to join its batch."""


class RequestError(Exception):
    """A request the endpoint refuses: its HTTP status and OpenAI-style message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def message_key(message: Mapping[str, Any]) -> tuple:
    """What identifies a message when a request repeats the conversation: its role, its text and
    its tool calls (names and arguments), whatever else a client adds (ids, refusal: null)."""
    content = message.get("content")
    if isinstance(content, list):  # OpenAI's content parts: their text
        content = "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    calls = tuple((c.get("function", {}).get("name"), _canonical(c.get("function", {}).get("arguments")))
                  for c in message.get("tool_calls") or () if isinstance(c, Mapping))
    return message.get("role"), content or "", calls


def _canonical(arguments: Any) -> str:
    try:
        return json.dumps(json.loads(arguments) if isinstance(arguments, str) else arguments, sort_keys=True)
    except (TypeError, ValueError):
        return str(arguments)


def plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """Messages as the chat template reads them: text content, tool calls kept as the template's
    `tool_calls` (arguments parsed), a tool result's tool_call_id kept."""
    out = []
    for m in messages:
        role, content, _ = message_key(m)
        message: dict[str, Any] = {"role": role, "content": content}
        if m.get("tool_calls"):
            message["tool_calls"] = [{"type": "function", "function": {
                "name": c["function"]["name"], "arguments": json.loads(_canonical(c["function"].get("arguments")))}}
                for c in m["tool_calls"]]
        if m.get("tool_call_id"):
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


@dataclass
class Session:
    """One episode's requests: its segments (the last one in progress) and what it has seen."""

    index: int
    """The episode's position in the round (its turns' seeds)."""
    example: Prompt
    sampling: SamplingConfig
    segments: list[Episode] = field(default_factory=list)
    known: list[tuple] = field(default_factory=list)
    """message_key of the conversation so far, the last reply included."""
    turns: int = 0
    rewrites: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def completion(self) -> Completion | None:
        """The last segment's trajectory, the earlier ones (with a turn) in its `segments`; None before
        any turn."""
        if not self.segments:
            return None
        earlier = tuple(s.completion() for s in self.segments[:-1] if s.turns)
        return replace(self.segments[-1].completion(), turns=self.turns, segments=earlier)


@dataclass(frozen=True)
class RenderPrompt:
    """A conversation's prompt token ids: the chat template's rendering with the generation prompt
    and the request's tools (as the run's prompts are rendered); without a template the messages'
    contents one after the other, tokenised as the run's plain-text prompts are."""

    tokenizer: Any
    template: str | None
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, messages: list[Message], tools: list | None) -> list[int]:
        if self.template is None:
            return list(self.tokenizer("".join(m.get("content") or "" for m in messages))["input_ids"])
        from novarl.data.datasets import render_chat
        from novarl.errors import UserError

        try:
            kwargs = {**self.kwargs, **({"tools": tools} if tools else {})}
            text = render_chat(self.tokenizer, messages, self.template, kwargs)
        except UserError as err:  # the template refused the agent's messages: the agent's error, not the run's
            raise RequestError(400, str(err)) from None
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


class Batcher:
    """Gathers the sessions' requests into batches for the engines, on a thread of its own; with an
    engine that takes requests while it generates (`continuous`: vLLM's, wherever it runs), hands each
    to it as it comes instead, so that no request waits for another's batch."""

    def __init__(self, generator: GenerationBackend, live: Callable[[], int],
                 continuous: ContinuousEngine | None = None) -> None:
        self.generator, self.live, self.continuous = generator, live, continuous
        self.requests: queue.Queue = queue.Queue()
        loop = self._loop if continuous is None else self._stream
        self.thread = threading.Thread(target=loop, daemon=True, name="novarl-endpoint-batcher")
        self.thread.start()

    def generate(self, prompt: Prompt, sampling: SamplingConfig) -> Completion:
        done: Future = Future()
        self.requests.put((prompt, sampling, done))
        return done.result()

    def close(self) -> None:
        self.requests.put(None)

    def _loop(self) -> None:
        while True:
            first = self.requests.get()
            if first is None:
                return
            batch, latest = [first], time.monotonic() + BATCH_MAX_WAIT_S
            while len(batch) < self.live():  # until every open session has a request in, or they stop coming
                try:
                    item = self.requests.get(timeout=max(min(BATCH_WAIT_S, latest - time.monotonic()), 0))
                except queue.Empty:
                    break
                if item is None:
                    self.requests.put(None)
                    break
                batch.append(item)
            self._run(batch)

    def _stream(self) -> None:
        assert self.continuous is not None
        engine, waiting, keys = self.continuous, {}, itertools.count()
        while True:
            try:  # block for a request only when the engine has nothing to do
                item = self.requests.get(block=not engine.unfinished())
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                prompt, sampling, done = item
                key = next(keys)
                waiting[key] = done
                try:
                    engine.add(key, prompt, sampling)
                except BaseException as err:  # this request fails with it
                    waiting.pop(key).set_exception(err)
                continue
            try:
                finished = engine.step()
            except BaseException as err:  # every request in flight fails with it
                for done in waiting.values():
                    done.set_exception(err)
                waiting.clear()
                continue
            for key, completion in finished:
                waiting.pop(key).set_result(completion)

    def _run(self, batch: list) -> None:
        by_sampling: dict[SamplingConfig, list] = {}
        for prompt, sampling, done in batch:  # one submission per sampling (its seeds aside)
            by_sampling.setdefault(replace(sampling, seeds=None), []).append((prompt, sampling, done))
        for sampling, items in by_sampling.items():
            seeds = None if sampling.seed is None else tuple(s.seeds[0] for _, s, _ in items)
            try:
                completions = self.generator.submit([p for p, _, _ in items], replace(sampling, seeds=seeds)).result()
            except BaseException as err:  # every waiting request fails with it
                for _, _, done in items:
                    done.set_exception(err)
                continue
            for (_, _, done), completion in zip(items, completions):
                done.set_result(completion)


class Server(ThreadingHTTPServer):
    """A thread per connection; a backlog for a round's agents connecting at once (the default, 5,
    refuses a burst)."""

    daemon_threads = True
    request_queue_size = 1024


class ChatEndpoint:
    """The endpoint (see the module doc): `open` a session per episode, hand its `base_url` and
    `token` to the agent, read its `completion()` once the agent returns."""

    def __init__(self, generator: GenerationBackend, tokenizer, observations: ObservationTokens, *,
                 render: Callable[[list[Message], list | None], list[int]], model: str, max_turns: int,
                 max_tokens: int | None, host: str = "127.0.0.1", port: int = 0,
                 continuous: ContinuousEngine | None = None) -> None:
        """render(messages, tools): a conversation's prompt token ids (the chat template, with the
        generation prompt); observations: how messages after a turn become tokens; continuous: the
        generator's engine, to hand each request to as it comes (see Batcher)."""
        self.tokenizer, self.observations, self.render = tokenizer, observations, render
        self.model, self.max_turns, self.max_tokens = model, max_turns, max_tokens
        self.token = secrets.token_urlsafe(24)
        self.sessions: dict[str, Session] = {}
        self.counts = {"agent_requests": 0, "agent_rewrites": 0, "agent_refused": 0}
        self.lock = threading.Lock()
        self.batcher = Batcher(generator, lambda: len(self.sessions), continuous)
        self.server = Server((host, port), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="novarl-endpoint")
        self.thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.server.server_address[:2]

    def base_url(self, session: str) -> str:
        host, port = self.address
        return f"http://{host}:{port}/sessions/{session}/v1"

    def open(self, index: int, example: Prompt, sampling: SamplingConfig) -> str:
        """A session for the episode at `index` of the round, sampled with `sampling`; its id."""
        session = secrets.token_hex(8)
        with self.lock:
            self.sessions[session] = Session(index, example, sampling)
        return session

    def close(self, session: str) -> Session:
        with self.lock:
            return self.sessions.pop(session)

    def take_metrics(self) -> dict[str, float]:
        with self.lock:
            out = {name: float(count) for name, count in self.counts.items()}
            self.counts = dict.fromkeys(self.counts, 0)
        return out

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.batcher.close()

    # ------------------------------------------------------------ a request
    def authorized(self, header: str | None) -> bool:
        return header is not None and hmac.compare_digest(header.encode(), f"Bearer {self.token}".encode())

    def chat(self, session_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        with self.lock:
            session = self.sessions.get(session_id)
            self.counts["agent_requests"] += 1
        if session is None:
            raise RequestError(404, f"no open session {session_id!r} (its episode is over)", "not_found_error")
        if body.get("stream"):
            raise RequestError(400, "stream=true is not served: novarl answers whole completions")
        if body.get("n", 1) != 1:
            raise RequestError(400, "n must be 1 (each sample of a group is an episode of its own)")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
            raise RequestError(400, "messages must be a non-empty list of message objects")
        with session.lock:  # one request of a session at a time, in order
            return self._turn(session, messages, body)

    def _turn(self, session: Session, messages: list[Mapping[str, Any]], body: Mapping[str, Any]) -> dict[str, Any]:
        if session.turns >= self.max_turns:
            raise RequestError(400, f"the episode has had its {self.max_turns} turn(s) (grpo.max_rollout_turns)")
        keys = [message_key(m) for m in messages]
        tools = body.get("tools") or None
        known = len(session.known)
        if session.segments and known < len(keys) and keys[:known] == session.known:
            episode = session.segments[-1]
            added = plain_messages(messages[known:])
            episode.observe(self.observations(added, episode.last_tokens), added)
        else:  # the first request, or a history the agent rewrote: a new segment
            if session.segments:
                session.rewrites += 1
                with self.lock:
                    self.counts["agent_rewrites"] += 1
            conversation = plain_messages(messages)
            ids = self.render(conversation, tools)
            example = session.example
            prompt = Prompt(self.tokenizer.decode(ids), ids, answer=example.answer, index=example.index,
                            columns=example.columns, source=example.source)
            episode = Episode(prompt, conversation, {})
            session.segments.append(episode)
        request = episode.request()
        if self.max_tokens is not None and len(request.token_ids) >= self.max_tokens:
            raise RequestError(400, f"the conversation is {len(request.token_ids)} tokens, the run's "
                               f"policy.max_seq_length is {self.max_tokens}", "context_length_exceeded")
        sampling = session.sampling
        if isinstance(body.get("max_tokens") or body.get("max_completion_tokens"), int):
            wanted = body.get("max_completion_tokens") or body["max_tokens"]
            sampling = replace(sampling, max_new_tokens=max(1, min(sampling.max_new_tokens, wanted)))
        seed = turn_seed(sampling, session.index, session.turns)
        sampling = replace(sampling, seeds=None if seed is None else (seed,))
        completion = self.batcher.generate(request, sampling)
        episode.took(completion)
        session.turns += 1
        reply = self._reply(completion, tools)
        session.known = [*keys, message_key(reply)]
        return self._response(completion, reply, request)

    @staticmethod
    def _reply(completion: Completion, tools: list | None) -> dict[str, Any]:
        """The assistant message: the text, and the tool calls found in it (Hermes' form) when tools were given."""
        from novarl.rollout.tools import TOOL_CALL_PARSERS, ToolCall

        reply: dict[str, Any] = {"role": "assistant", "content": completion.text}
        calls = [c for c in TOOL_CALL_PARSERS["hermes"](completion.text) if isinstance(c, ToolCall)] if tools else []
        if calls:
            reply["tool_calls"] = [{"id": f"call_{secrets.token_hex(6)}", "type": "function",
                                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                   for c in calls]
        return reply

    def _response(self, completion: Completion, reply: dict[str, Any], request: Prompt) -> dict[str, Any]:
        finish = "tool_calls" if reply.get("tool_calls") else completion.finish_reason
        return {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model, "choices": [{"index": 0, "message": reply, "finish_reason": finish,
                                                  "logprobs": None}],
                "usage": {"prompt_tokens": len(request.token_ids), "completion_tokens": len(completion.token_ids),
                          "total_tokens": len(request.token_ids) + len(completion.token_ids)}}


class Handler(BaseHTTPRequestHandler):
    """One connection's requests to the endpoint (`endpoint`: set on a subclass per endpoint)."""

    protocol_version = "HTTP/1.1"
    endpoint: ChatEndpoint

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        """Quiet: a request is not worth a line in the user's terminal."""

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, kind: str) -> None:
        if status in (401, 404):
            with self.endpoint.lock:
                self.endpoint.counts["agent_refused"] += 1
        self._send(status, {"error": {"message": message, "type": kind, "code": status}})

    def _route(self, served: str) -> str | None:
        """The session id of a .../sessions/<id>/v1/<served>, after the token is checked; None
        when the request was answered here (refused)."""
        if not self.endpoint.authorized(self.headers.get("Authorization")):
            self._error(401, "a bearer token is needed (the run's own: the client novarl hands the agent carries "
                        "it)", "authentication_error")
            return None
        parts = self.path.split("?")[0].strip("/").split("/")
        if len(parts) < 4 or parts[0] != "sessions" or parts[2] != "v1" or "/".join(parts[3:]) != served:
            self._error(404, f"no route {self.path} (served: .../v1/chat/completions, .../v1/models)",
                        "not_found_error")
            return None
        return parts[1]

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self._route("models") is not None:
            self._send(200, {"object": "list", "data": [{"id": self.endpoint.model, "object": "model",
                                                         "owned_by": "novarl"}]})

    def do_POST(self) -> None:  # noqa: N802
        session = self._route("chat/completions")
        if session is None:
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        except ValueError:
            self._error(400, "the body is not JSON", "invalid_request_error")
            return
        try:
            self._send(200, self.endpoint.chat(session, body if isinstance(body, Mapping) else {}))
        except RequestError as err:
            self._error(err.status, str(err), err.kind)
        except Exception as err:  # the engines' failure: the agent sees a 500, the episode fails
            self._error(500, f"{type(err).__name__}: {' '.join(str(err).split())[:300]}", "server_error")


def _handler(endpoint: ChatEndpoint) -> type[BaseHTTPRequestHandler]:
    return type("EndpointHandler", (Handler,), {"endpoint": endpoint})
