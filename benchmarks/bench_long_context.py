"""Peak memory per rank against sequence length, without and with context parallelism, measured
and as the planner predicts it.

    .venv/bin/python benchmarks/bench_long_context.py [--lengths 2048 4096 8192 16384]
        [--vocab 64] [--heads plain] [--out benchmarks/results/long_context_cpu.md]

A random Llama (hidden 256, 4 layers, 8 query heads and 2 key/value heads, a 64-token vocabulary unless
--vocab says otherwise, fp32: activations, not weights, decide) computes the logprobs of one
sequence of each length and the gradient of their sum, through novarl's training forward
(backends/training/rows.py model_logprobs): on one process (cp=1), and split over 2 gloo processes
by novarl's context parallelism (cp=2, models/context_parallel.py); with --heads, its output head
plain (the logits over the vocabulary, then their log-softmax) or picking (models/logprob_head.py, as
the DTensor and DeepSpeed backends install it: chunk by chunk, the logits kept for the backward).
Each rank measures the rise of its resident set during the forward and backward, above its level
after a warm-up pass at the same length (freed memory given back to the system with malloc_trim, the peak reset:
novarl/distributed/memory.py). The one-process run uses the DTensor backend's own attention for
packed rows (models/attention.py). Predicted: the planner's
activations for FSDP2 at that sequence length and cp (novarl/plan/memory.py, fp32, the attention
scores never materialised, as SDPA computes them on the CPU).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import multiprocessing as mp
import os
import socket
import time
from datetime import date
from pathlib import Path

from models import cpu_name

VOCAB = 64
"""About the bundled character tokenizer's vocabulary: the logits stay small (--vocab: another)."""
CONFIG = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=32768)


def build_model(vocab: int, head: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from novarl.models.logprob_head import use_picking_head

    torch.manual_seed(0)
    config = LlamaConfig(**{**CONFIG, "vocab_size": vocab})
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).float()
    if head == "picking":
        assert use_picking_head(model)
    return model


def measure(length: int, context, vocab: int, head: str) -> tuple[float, float]:
    """(MB the resident set rose by during one forward and backward, seconds it took)."""
    import torch

    from novarl.backends.training.batching import MicroBatching
    from novarl.backends.training.rows import model_logprobs
    from novarl.distributed.memory import current_rss_bytes, peak_rss_bytes, reset_peak
    from novarl.types import TrainBatch

    torch.set_num_threads(1)
    model = build_model(vocab, head)
    if context is None:  # the DTensor backend's own attention for packed rows
        from novarl.models.attention import use_varlen_attention

        attention = use_varlen_attention(model)
    else:
        from novarl.models.context_parallel import use_context_parallel_attention

        attention = use_context_parallel_attention(model)
    ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, length, dtype=torch.bool)
    mb = TrainBatch.from_rows(ids, mask, mask.clone(), torch.zeros(1))
    batching = MicroBatching("packed", 1, length, 8)

    def step() -> None:
        model.zero_grad(set_to_none=False)
        logprobs, _ = model_logprobs(model, attention, mb, batching, 1.0, context=context)
        logprobs.sum().backward()

    step()  # warm-up: gradients allocated
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the warm-up freed goes back to the system: the rise is real
    reset_peak()
    before = current_rss_bytes()
    start = time.perf_counter()
    step()
    return (peak_rss_bytes() - before) / 1e6, time.perf_counter() - start


def rank_main(rank: int, world: int, port: int, length: int, vocab: int, head: str, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results.put((rank, *measure(length, dist.group.WORLD if world > 1 else None, vocab, head)))
    dist.barrier()
    dist.destroy_process_group()


def run(length: int, cp: int, vocab: int, head: str) -> tuple[float, float]:
    """(the largest rank's peak rise in MB, the slowest rank's seconds) on `cp` processes."""
    ctx = mp.get_context("spawn")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, cp, port, length, vocab, head, results)) for r in range(cp)]
    for proc in procs:
        proc.start()
    got = [results.get(timeout=1800) for _ in range(cp)]
    for proc in procs:
        proc.join(timeout=120)
    return max(g[1] for g in got), max(g[2] for g in got)


def predicted(length: int, cp: int, vocab: int, head: str) -> float:
    import dataclasses

    from novarl.plan.memory import Parallelism, Workload, estimate_memory
    from novarl.backends.contract.model_shape import ModelShape

    shape = ModelShape.from_hf_config({"model_type": "llama", "tie_word_embeddings": False, **CONFIG,
                                       "vocab_size": vocab})
    shape = dataclasses.replace(shape, picking_head=head == "picking")
    work = Workload(sequence_length=length, micro_batch_size=1, precision="float32", flash_attention=True)
    return estimate_memory(shape, strategy="fsdp2", workload=work,
                           parallel=Parallelism(context_parallel_size=cp)).activations / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--heads", nargs="+", choices=("plain", "picking"), default=["plain"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "long_context_cpu.md")
    args = parser.parse_args()
    rows = []
    for length in args.lengths:
        for cp in (1, 2):
            for head in args.heads:
                peak, seconds = run(length, cp, args.vocab, head)
                rows.append((length, cp, head, peak, predicted(length, cp, args.vocab, head), seconds))
                print(f"{length} tokens, cp={cp}, {head} head: {peak:.0f} MB measured, {rows[-1][4]:.0f} MB "
                      f"predicted, {seconds:.1f} s", flush=True)
    lines = [f"# Long context: peak memory per rank, cp=1 and cp=2, vocabulary {args.vocab} ({date.today()}, "
             f"{cpu_name()}, {os.cpu_count()} cores)", "",
             f"`.venv/bin/python benchmarks/bench_long_context.py --vocab {args.vocab} --heads {' '.join(args.heads)}`"
             ": " + __doc__.split("\n\n", 2)[2].strip().replace("\n", " "), "",
             "| tokens | cp | head | measured MB per rank | predicted MB (planner) | measured / predicted | "
             "cp=2 / cp=1 measured | picking / plain measured | seconds (forward + backward) |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    by_case = {(r[0], r[1], r[2]): r for r in rows}
    for length, cp, head, peak, want, seconds in rows:
        split = f"{peak / by_case[(length, 1, head)][3]:.2f}" if cp == 2 else ""
        plain = by_case.get((length, cp, "plain"))
        picking = f"{peak / plain[3]:.2f}" if head == "picking" and plain else ""
        lines.append(f"| {length} | {cp} | {head} | {peak:.0f} | {want:.0f} | {peak / want:.2f} | {split} | {picking} "
                     f"| {seconds:.1f} |")
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
