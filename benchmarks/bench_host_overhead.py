"""The host's time in a training step of novarl's DTensor policy, by how FSDP2's units are laid out.

    python benchmarks/bench_host_overhead.py [--steps 20] [--rounds 3] [--out FILE]

On a GPU the host queues a step's kernels ahead of the device; where its own time per layer (Python, autograd,
FSDP2's hooks) comes near the kernels' time, the GPU waits for it (issue 35: 26 % of the profiled H100 step of
`fixed-compile` had no kernel running). This measures that host time where it can be seen alone: on the CPU,
with a model of Qwen2.5-1.5B's depth (28 decoder layers) and a width so small that its arithmetic is a few
percent of the step. One step = a logprob pass + forward/backward over 2 micro-batches + the optimizer step, as
in bench_train_gpu.py, on one rank (one data-parallel shard: the gathered weights are kept through the step).

Layouts, side by side in one process (rounds interleaved, each layout's median step of each round):
- `per-layer units`: each decoder layer its own FSDP2 unit (one gather, one gradient reduction and one set of
  hooks a layer), as novarl sharded before;
- `kept runs`: consecutive layers in one unit up to KEPT_UNIT_PARAMETERS (parallelize.py fsdp_units; here all 28,
  the layers being tiny): novarl's layout where the gathered weights are kept;
each eager and with compiled decoder layers. (With a torch whose FSDP2 does not group modules fully, before 2.13,
both layouts are a unit a layer: the table's unit counts say so.) Writes benchmarks/results/host_overhead_cpu.md
(or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=28, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
LAYOUTS = ("per-layer units", "kept runs")


def save_model(folder: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                                 pad_token_id=0)).save_pretrained(folder)


def build(folder: Path, layout: str, compiled: bool):
    from novarl.backends.training import parallelize
    from novarl.backends.training.dtensor import DTensorPolicy
    from novarl.config import load_config

    kept_runs = parallelize.fsdp_units
    parallelize.fsdp_units = kept_runs if layout == "kept runs" else lambda layers, keep: [[x] for x in layers]
    try:
        cfg = load_config(None, overrides=[
            f"policy.model_name={folder}", "policy.max_seq_length=64", "policy.train_micro_batch_size=4",
            "policy.logprob_batch_size=4", "policy.scheduler=[]", "policy.optimizer.kwargs.lr=1e-6",
            f"policy.dtensor_cfg.torch_compile={str(compiled).lower()}"])
        return DTensorPolicy(cfg.policy, str(folder), total_steps=1_000)
    finally:
        parallelize.fsdp_units = kept_runs


def make_step(policy):
    import torch

    from novarl.algorithms.losses import make_loss
    from novarl.config.schema import LossConfig
    from novarl.models.scores import Logprobs
    from novarl.types import TrainBatch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, SHAPE["vocab_size"], (8, 48), generator=generator)
    mask = torch.ones_like(ids, dtype=torch.bool)
    batch = TrainBatch.from_rows(ids, mask, mask & (torch.arange(48) >= 8), torch.randn(8, generator=generator))
    loss, head = make_loss(LossConfig()), Logprobs(1.0)

    def step() -> None:
        batch.old_logprobs = policy.forward(batch, head)
        policy.forward_backward(batch, loss, head)
        policy.optim_step()

    return step


def measure(steps: int, rounds: int) -> dict:
    """{"times": {f"{layout}, {eager|compiled}": [median seconds of each round]}, "modules": {the same: the FSDP2
    units (gathered together) its model has, the root's included}}."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from novarl.distributed.local import ensure_single_process_group

    torch.set_num_threads(1)
    ensure_single_process_group()
    times: dict[str, list[float]] = {}
    units: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp))
        cases = {}
        for compiled in (False, True):
            for layout in LAYOUTS:
                name = f"{layout}, {'compiled' if compiled else 'eager'}"
                policy = build(Path(tmp), layout, compiled)
                units[name] = len({id(m._get_fsdp_state()) for m in policy.model.modules() if isinstance(m, FSDPModule)})
                cases[name] = make_step(policy)
                for _ in range(3 if compiled else 1):  # warm-up (compiling)
                    cases[name]()
        for _ in range(rounds):
            for name, step in cases.items():
                seconds = []
                for _ in range(steps):
                    tic = time.perf_counter()
                    step()
                    seconds.append(time.perf_counter() - tic)
                times.setdefault(name, []).append(statistics.median(seconds))
    return {"times": times, "modules": units}


def report(result: dict, steps: int, rounds: int) -> str:
    from benchmarks.models import cpu_name

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or "?"
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                      cwd=ROOT).stdout.strip():
        commit += " + uncommitted changes"
    lines = [f"# Host time of a DTensor training step by FSDP2 unit layout ({cpu_name()}, one thread)", "",
             f"{date.today()}, commit {commit}: `python benchmarks/bench_host_overhead.py --steps {steps} --rounds "
             f"{rounds}`. Qwen2-shaped model of 28 layers of width {SHAPE['hidden_size']} (its arithmetic is a "
             "few percent of the step: what is measured is the host's work), one rank; a step = a logprob pass + "
             "forward/backward over 2 micro-batches of 4 x 48 tokens + AdamW. Median step of each round (rounds "
             "interleaved across the layouts, on a shared machine), then the median of the rounds.", "",
             "| layout | FSDP2 units | step (ms) | rounds (ms) | vs per-layer units |", "|---|---|---|---|---|"]
    times = result["times"]
    for name, rounds_s in times.items():
        base = times[name.replace("kept runs", "per-layer units")]
        lines.append(f"| {name} | {result['modules'][name]} | {statistics.median(rounds_s) * 1e3:.1f} | "
                     f"{', '.join(f'{s * 1e3:.1f}' for s in rounds_s)} | "
                     f"{statistics.median(rounds_s) / statistics.median(base):.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "host_overhead_cpu.md")
    args = parser.parse_args()
    result = measure(args.steps, args.rounds)
    text = report(result, args.steps, args.rounds)
    print(text)
    print(json.dumps(result))
    args.out.write_text(text)


if __name__ == "__main__":
    main()
