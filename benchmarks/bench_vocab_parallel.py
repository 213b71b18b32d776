"""Tensor parallelism with the embeddings and the head split over the vocabulary, against them whole on every rank.

    .venv/bin/python benchmarks/bench_vocab_parallel.py [--steps 3] [--tokens 128] [--out FILE]

A model whose vocabulary dominates (Qwen2.5's 151,936 tokens, tied embeddings, 2 narrow decoder layers: the
embeddings are 38.9 M of its 40.1 M parameters), on the DTensor backend, float32, as Ray actors on the CPU (gloo):
one rank, then tensor parallelism 2 with the vocabulary split (models/vocab_parallel.py, what novarl runs) and
whole (split_vocabulary turned off in the rank processes: novarl before the split). A step = a logprob pass +
forward/backward + AdamW over 4 sequences of --tokens tokens. Per layout: the median step, each rank's model
state (its parameters' local elements x 16 bytes: fp32 weights, gradients, two Adam moments) and its peak
resident memory. Writes benchmarks/results/vocab_parallel_cpu.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from models import TimedPolicy  # noqa: E402 (benchmarks/models.py, beside this script)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
SHAPE = dict(vocab_size=151_936, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)
LAYOUTS = {"1 rank": (1, True), "TP x2, vocabulary split": (2, True), "TP x2, vocabulary whole": (2, False)}


class Rank(TimedPolicy):
    """One rank's DTensor policy on a fixed batch; `split` False: the embeddings and the head left whole."""

    def __init__(self, model_path: str, tensor_parallel: int, split: bool, tokens: int) -> None:
        import torch

        from novarl.algorithms.losses import make_loss
        from novarl.backends.training import parallelize
        from novarl.config.schema import LossConfig, PolicyConfig
        from novarl.models.scores import Logprobs
        from novarl.types import TrainBatch

        if not split:  # (the last layout measured: a rank process kept for another group would keep this)
            parallelize.split_vocabulary = lambda model, mesh: "the vocabulary whole (the bench's reference)"
        from novarl.backends.training.dtensor import DTensorPolicy

        policy = PolicyConfig(model_name=model_path, precision="float32", train_micro_batch_size=4,
                              logprob_batch_size=4, dtensor_cfg={"tensor_parallel_size": tensor_parallel})
        self.policy = DTensorPolicy(policy, model_path, total_steps=100)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(3, SHAPE["vocab_size"], (4, tokens), generator=generator)
        mask = torch.ones_like(ids, dtype=torch.bool)
        self.batch = TrainBatch.from_rows(ids, mask, mask & (torch.arange(tokens) >= tokens // 2),
                                          torch.randn(4, generator=generator))
        self.loss, self.head = make_loss(LossConfig()), Logprobs()

    def state_mb(self) -> float:
        from torch.distributed.tensor import DTensor

        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                    for p in {id(p): p for p in self.policy.model.parameters()}.values())
        return 16 * local / 2**20


def save_model(folder: Path) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**SHAPE)).save_pretrained(folder)
    return str(folder)


def measure(steps: int, tokens: int) -> list[tuple[str, float, float, float]]:
    """[(layout, median s/step, model state MB per rank, peak RSS MB per rank (the largest))]."""
    import ray

    from novarl.distributed.ray_group import RayWorkerGroup, ensure_ray

    ensure_ray(num_cpus=2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = save_model(Path(tmp) / "model")
        for layout, (ranks, split) in LAYOUTS.items():
            group = RayWorkerGroup(Rank, dict(model_path=path, tensor_parallel=ranks, split=split, tokens=tokens),
                                   world_size=ranks, name=layout)
            times = [group.call("step") for _ in range(steps + 1)][1:]  # the first step warms up
            rows.append((layout, statistics.median(times), max(group.call_all("state_mb")),
                         max(group.call_all("peak_rss_mb"))))
            group.shutdown()
            print(rows[-1], flush=True)
    ray.shutdown()
    return rows


def report(rows, steps: int, tokens: int) -> str:
    import torch

    whole = {layout: row for layout, *row in rows}["TP x2, vocabulary whole"]
    table = "\n".join(f"| {layout} | {t:.3f} | {t / whole[0]:.2f}x | {state:,.0f} | {peak:,.0f} |"
                      for layout, t, state, peak in rows)
    return f"""# Tensor parallelism: the vocabulary split over the ranks or whole on each (CPU)

- date: {date.today()}
- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; each rank a Ray actor with 1 CPU, gloo
- software: torch {torch.__version__}, Python {platform.python_version()}
- command: `.venv/bin/python benchmarks/bench_vocab_parallel.py --steps {steps} --tokens {tokens}`
- model: random Qwen2 shape, vocabulary 151,936, hidden 256, 2 layers, tied embeddings (40.1 M parameters, 38.9 M
  of them the embeddings); float32; step = logprob pass + forward/backward + AdamW over 4 x {tokens} tokens,
  median of {steps} after a warm-up step

| layout | s/step | vs vocabulary whole | model state per rank (MB) | peak RSS per rank (MB) |
|---|---|---|---|---|
{table}

Model state = each rank's parameters' local elements x 16 bytes (fp32 weights, gradients, two Adam moments).
"Vocabulary whole" is novarl before models/vocab_parallel.py (split_vocabulary turned off in its rank processes):
every rank holds the tied embeddings whole and computes the head's whole matmul for the same tokens.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vocab_parallel_cpu.md")
    args = parser.parse_args()
    text = report(measure(args.steps, args.tokens), args.steps, args.tokens)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
