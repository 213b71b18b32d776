"""Sequence packing and dynamic batching against padded micro-batches, on the bundled
variable-length task (data.dataset_name=repeat: answers of 2 to 40 tokens).

    .venv/bin/python benchmarks/bench_packing.py [--rounds 3] [--out benchmarks/results/packing_cpu.md]

One DTensor policy per model (one rank, fp32, this machine's threads) trains on one fixed
batch of the task's prompts with their reference answers as completions (what a policy that
has learned the task generates: the lengths are the task's). Each layout in turn, alternating
round by round, times the trainer's work of a GRPO step: the policy's logprob forward (the
old logprobs when a batch gets several optimizer steps, the reference's with a KL penalty)
and forward + backward + optimizer step. The budgets give every layout the same memory: a
padded micro-batch holds rows x the task's longest sequence, a packed or dynamic one that
many tokens. Reports the median seconds, the tokens the model computed against the useful
ones, and the ratio to padded.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import cpu_name, random_llama_100m  # noqa: E402 -- after the path line above

LAYOUTS = ("fixed", "dynamic", "packed")
NAMES = {"fixed": "padded (fixed rows)", "dynamic": "dynamic batching", "packed": "sequence packing"}
ROUND = 8
"""sequence_length_round for both token layouts (NeMo RL's 64 would pad these short rows)."""


def task_batch(tokenizer, sequences: int, seed: int = 0):
    """`sequences` prompts of the repeat task with their answers (+ </s>) as completions."""
    import torch

    from novarl.data.repeat import repeat_examples
    from novarl.rollout.batch import build_train_batch
    from novarl.types import Completion, Prompt

    examples = random.Random(seed).choices(repeat_examples("train"), k=sequences)
    completions = []
    for e in examples:
        prompt = Prompt(text=e.prompt, token_ids=tokenizer(e.prompt).input_ids, answer=e.answer)
        tokens = tokenizer(e.answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        completions.append(Completion(prompt, tokens, [-1.0] * len(tokens), e.answer, "stop", 0))
    gen = torch.Generator().manual_seed(seed)
    return build_train_batch(completions, torch.randn(sequences, generator=gen))


def policy_for(model_path: str, rows: int, longest: int):
    from novarl.backends.training.dtensor import DTensorPolicy
    from novarl.config import load_config
    from novarl.distributed.local import ensure_single_process_group

    ensure_single_process_group()
    cfg = load_config(None, overrides=[f"policy.model_name={model_path}", f"policy.max_seq_length={longest}",
                                       f"policy.train_micro_batch_size={rows}", f"policy.logprob_batch_size={rows}",
                                       "policy.precision=float32", "policy.scheduler=[]"])
    return DTensorPolicy(cfg.policy, model_path, total_steps=1_000), cfg.policy


def batchings(policy_cfg, layout: str):
    from novarl.backends.training.batching import MicroBatching

    if layout == "fixed":
        return (MicroBatching.from_policy(policy_cfg, training=True),
                MicroBatching.from_policy(policy_cfg, training=False))
    section = "sequence_packing" if layout == "packed" else "dynamic_batching"
    cfg = policy_cfg.model_copy(update={section: getattr(policy_cfg, section).model_copy(
        update={"enabled": True, "sequence_length_round": ROUND})})
    return MicroBatching.from_policy(cfg, training=True), MicroBatching.from_policy(cfg, training=False)


def measure(label: str, model_path: str, sequences: int, rows: int, rounds: int) -> dict:
    from novarl.algorithms.losses import make_loss
    from novarl.config.schema import LossConfig
    from novarl.models.loading import load_tokenizer
    from novarl.models.scores import Logprobs

    tokenizer = load_tokenizer(model_path)
    batch = task_batch(tokenizer, sequences)
    longest = int(batch.lengths.max())
    policy, policy_cfg = policy_for(model_path, rows, longest)
    loss = make_loss(LossConfig())
    times = {layout: {"logprobs": [], "training": []} for layout in LAYOUTS}
    computed = {}
    for r in range(rounds + 1):  # round 0 warms up
        for layout in LAYOUTS:
            policy.train_batching, policy.logprob_batching = batchings(policy_cfg, layout)
            tic = time.perf_counter()
            batch.old_logprobs = policy.forward(batch, Logprobs())
            logprob_s = time.perf_counter() - tic
            tic = time.perf_counter()
            metrics = policy.forward_backward(batch, loss, Logprobs())
            policy.optim_step()
            training_s = time.perf_counter() - tic
            computed[layout] = metrics["tokens_computed"]
            if r:
                times[layout]["logprobs"].append(logprob_s)
                times[layout]["training"].append(training_s)
            print(f"{label} round {r} {layout}: logprobs {logprob_s:.3f}s training {training_s:.3f}s "
                  f"tokens {computed[layout]:.0f}", flush=True)
    lengths = batch.lengths.float()
    return {"label": label, "sequences": sequences, "rows": rows, "longest": longest, "useful": batch.num_tokens,
            "mean_length": float(lengths.mean()), "min_length": int(lengths.min()), "computed": computed,
            "median": {layout: {k: statistics.median(v) for k, v in t.items()} for layout, t in times.items()}}


def report(results: list[dict], rounds: int) -> str:
    lines = ["# Sequence packing and dynamic batching vs padded micro-batches", "",
             f"- date: {date.today()}; machine: {cpu_name()}, CPU only, one rank, fp32",
             f"- command: `.venv/bin/python benchmarks/bench_packing.py --rounds {rounds}`",
             "- task: the bundled `repeat` task (data.dataset_name=repeat), prompts with their reference answers as "
             "completions (2 to 40 answer tokens + </s>); one fixed batch per model",
             "- trainer step = the policy's logprob forward + forward/backward + optimizer step; medians over "
             f"{rounds} rounds after a warm-up round, the layouts alternating within each round",
             "- same memory per micro-batch: padded rows x the batch's longest sequence = the token budget "
             f"(train_mb_tokens = logprob_mb_tokens) of the other two; sequence_length_round={ROUND}, "
             "packing by modified_first_fit_decreasing", ""]
    for r in results:
        budget = r["rows"] * r["longest"]
        lines += [f"## {r['label']}", "",
                  f"{r['sequences']} sequences of {r['min_length']} to {r['longest']} tokens (mean "
                  f"{r['mean_length']:.1f}): {r['useful']} useful tokens; padded micro-batches of {r['rows']} rows, "
                  f"token budget {budget}", "",
                  "| layout | tokens computed (training) | useful / computed | logprobs (s) | forward+backward+step (s) "
                  "| trainer step (s) | speed-up vs padded |", "|---|---|---|---|---|---|---|"]
        base = sum(r["median"]["fixed"].values())
        for layout in LAYOUTS:
            m = r["median"][layout]
            step = sum(m.values())
            lines.append(f"| {NAMES[layout]} | {r['computed'][layout]:.0f} | {r['useful'] / r['computed'][layout]:.0%} "
                         f"| {m['logprobs']:.3f} | {m['training']:.3f} | {step:.3f} | x{base / step:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-100m", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from novarl.models.loading import resolve_model_path

    results = [measure("tiny-arith (298k parameters)", resolve_model_path("tiny-arith"), 512, 64, args.rounds)]
    if not args.skip_100m:
        with tempfile.TemporaryDirectory() as folder:
            path, count = random_llama_100m(Path(folder))
            results.append(measure(f"random Llama, {count / 1e6:.0f}M parameters", path, 64, 8, args.rounds))
    text = report(results, args.rounds)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
