"""TRL's side of bench_demo_vs_trl.py: GRPOTrainer on the demo workload, each optimizer step timed.

Runs with the TRL environment's python (it imports nothing of novarl):

    .cache/trl-venv/bin/python benchmarks/trl_child.py --model M --train-jsonl F --steps N --out-json J [--save-dir D]

`--train-jsonl` holds the bundled arithmetic train split as novarl sees it (prompt, answer and
novarl's prompt token ids, `tokenizer(prompt).input_ids`), exported by the parent from the novarl
environment; the prompts TRL tokenizes are checked against those ids before training. Writes
the seconds of each step (on_step_begin -> on_step_end) and of its generation phase, the
training loop's wall time (first step's begin -> last step's end), the mean reward of each
generated batch and the versions to `--out-json`; with `--save-dir` the final model and
tokenizer as a Hugging Face folder.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.metadata import version
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--train-jsonl", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out-json", type=Path, required=True)
    parser.add_argument("--save-dir", type=Path)
    parser.add_argument("--work-dir", type=Path, required=True, help="TRL's output_dir (nothing is saved there)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in args.train_jsonl.read_text().splitlines() if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if getattr(tokenizer, "chat_template", None):
        raise SystemExit("the tokenizer has a chat template: TRL would not tokenize the raw prompt as novarl does")
    # What TRL's GRPOTrainer._tokenize_prompts does with a plain-text prompt: processing_class(text=prompts).
    trl_ids = tokenizer(text=[r["prompt"] for r in rows])["input_ids"]
    bad = [r["prompt"] for r, ids in zip(rows, trl_ids, strict=True) if list(ids) != r["prompt_ids"]]
    if bad:
        raise SystemExit(f"{len(bad)} prompts tokenize differently in TRL than in novarl, e.g. {bad[0]!r}")
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    batch_rewards: list[float] = []

    def exact_match(completions, answer, **_):
        """novarl's exact_match: the decoded completion (special tokens removed, which TRL does) equals
        the answer, surrounding whitespace ignored."""
        scores = [1.0 if c.strip() == a.strip() else 0.0 for c, a in zip(completions, answer, strict=True)]
        batch_rewards.append(sum(scores) / len(scores))
        return scores

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    # novarl's bundled recipe: AdamW, and 10 warm-up steps from 0.1x then a linear decay to 0.1x by
    # the last step, chained by SequentialLR (novarl/backends/training/optim.py builds the same).
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    lrs = torch.optim.lr_scheduler
    scheduler = lrs.SequentialLR(optimizer, [
        lrs.LinearLR(optimizer, start_factor=0.1, end_factor=1.0, total_iters=10),
        lrs.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=max(1, args.steps - 10)),
    ], milestones=[10])

    config = GRPOConfig(
        output_dir=str(args.work_dir), report_to="none", use_cpu=True, bf16=False, fp16=False, seed=args.seed,
        max_steps=args.steps, save_strategy="no", eval_strategy="no", logging_steps=25, disable_tqdm=True,
        gradient_checkpointing=False, dataloader_num_workers=0,
        # 64 prompts x 8 completions generated at once, trained as novarl does: 2 micro-batches of 256
        # accumulated into one optimizer step (one generation per optimizer step, used once).
        num_generations=8, per_device_train_batch_size=256, gradient_accumulation_steps=2, steps_per_generation=2,
        num_iterations=1,
        max_completion_length=4, temperature=1.0, top_p=1.0, top_k=0, use_vllm=False,
        beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_type="dapo", scale_rewards="group",
        mask_truncated_completions=False, max_grad_norm=1.0, learning_rate=4e-4, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
    )

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.begin: list[float] = []
            self.end: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(time.perf_counter())

    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=dataset,
                          processing_class=tokenizer, optimizers=(optimizer, scheduler), callbacks=[timer])
    # The generation phase (generate, decode, reward, advantages) of each step, timed by wrapping the
    # trainer's own method: no change to what it does.
    generation_seconds: list[float] = []
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(*a, **kw):
        start = time.perf_counter()
        result = generate_and_score(*a, **kw)
        generation_seconds.append(time.perf_counter() - start)
        return result

    trainer._generate_and_score_completions = timed_generate_and_score
    output = trainer.train()
    if args.save_dir:
        trainer.save_model(str(args.save_dir))
        tokenizer.save_pretrained(str(args.save_dir))
    steps = [e - b for b, e in zip(timer.begin, timer.end, strict=True)]
    args.out_json.write_text(json.dumps({
        "step_seconds": steps,
        "generation_seconds": generation_seconds,
        "loop_seconds": timer.end[-1] - timer.begin[0],
        "train_runtime": output.metrics.get("train_runtime"),
        "steps": trainer.state.global_step,
        "batch_rewards": batch_rewards,
        "final_lr": optimizer.param_groups[0]["lr"],
        "threads": torch.get_num_threads(),
        "versions": {name: version(name) for name in ("trl", "torch", "transformers", "accelerate", "datasets")},
    }))


if __name__ == "__main__":
    main()
