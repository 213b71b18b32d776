"""Build a bundled model from scratch: `tiny-arith` (novarl/models/tiny_arith/, `--task arith`, the
default), `tiny-math` (novarl/models/tiny_math/, `--task math`: the word problems of
novarl.data.word_problems, answered as `\\boxed{N}`) or `tiny-tools` (novarl/models/tiny_tools/,
`--task tools`: products of novarl.data.multiplication, which it answers directly -- mostly wrong --
or, in a share of its training sequences (`--tool-rate`), by calling the `multiply` tool and copying
its result: the bundled multi-turn task, where RL teaches it to use the tool).

A ~300k-parameter Llama (2 layers, hidden 128, head_dim 64) with a
character-level tokenizer is trained by supervised learning on the train
split of the two-digit addition task (novarl.data.arithmetic). Each training
sequence is ``<s>`` + prompt + answer + ``</s>`` (e.g. ``<s>37+58=95</s>``);
the loss is the cross-entropy on the answer and ``</s>`` tokens only (prompt
tokens are masked out). AdamW, constant learning rate, seeded.

Training stops *early on purpose*: the model is meant to be a weak starting
point for reinforcement learning (GRPO), so it must be right sometimes but
not often. From step `--eval-from` on, held-out greedy accuracy on all 1,000
validation examples is measured every `--eval-every` steps, and training stops
at the first evaluation inside [--target-min, --target-max] (default 25-35 %).
If an evaluation overshoots the band, the script fails and asks for a smaller
learning rate or evaluation interval.

At the end the folder is reloaded with AutoTokenizer / AutoModelForCausalLM
and the validation accuracy is measured again; the two figures must agree. It
also prints (and writes to the README) the mean exact-match reward of
temperature-1.0 samples, 8 on each of 64 validation prompts: RL needs it > 0.

    python scripts/build_tiny_model.py            # rebuilds novarl/models/tiny_arith/
    python scripts/build_tiny_model.py --out /tmp/tiny --seed 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, str(REPO))

from novarl.data.arithmetic import Example, arithmetic_examples  # noqa: E402
from novarl.data.word_problems import alphabet, word_problem_examples  # noqa: E402
from novarl.models.char_tokenizer import DEFAULT_ALPHABET, build_char_tokenizer  # noqa: E402
from novarl.rewards.math import boxed_match  # noqa: E402
from novarl.rewards.verifiers import exact_match  # noqa: E402

@dataclass(frozen=True)
class Task:
    examples: Callable[[str], list[Example]]
    alphabet: Callable[[], str]
    completion: Callable[[str], str]
    """The trained completion of an answer ("95", or "\\boxed{95}")."""
    reward: Callable[[str, str], float]
    new_tokens: int
    positions: int
    folder: str
    name: str
    described: str
    """For the README: what the model was trained on."""
    encode: Callable | None = None
    """(tokenizer, example, random.Random) -> (token ids, labels) of a training sequence; None: prompt +
    completion + </s>, trained on the completion."""
    greedy: Callable | None = None
    """(model, tokenizer, examples) -> held-out greedy success; None: greedy_accuracy."""
    sampled: Callable | None = None
    """(model, tokenizer, examples) -> success sampling at temperature 1, the RL signal; None: sampled_reward."""
    stop_on_sampled: bool = False
    """Stop training when the sampled success is in the target band (the greedy one's otherwise)."""


TASKS = {
    "arith": Task(arithmetic_examples, lambda: DEFAULT_ALPHABET, lambda a: a, exact_match, 4, 64, "tiny_arith",
                  "tiny-arith", "the train split of two-digit addition (`novarl.data.arithmetic`: prompt "
                  "`\"37+58=\"`, answer `\"95\"`)"),
    "math": Task(word_problem_examples, alphabet, lambda a: "\\boxed{" + a + "}", boxed_match, 12, 128, "tiny_math",
                 "tiny-math", "the train split of the bundled word problems (`novarl.data.word_problems`: "
                 "\"Ann has 37 pens and gets 58 more. ... Put the answer in \\boxed{}.\", completion "
                 "`\\boxed{95}`)"),
}
TASK = TASKS["arith"]
TOOL_RATE = 0.3
"""The share of tiny-tools' training sequences that call the tool (--tool-rate)."""


def tool_trace(tokenizer, ex: Example, rng) -> tuple[list[int], list[int]]:
    """<s>prompt, then: the tool call</s>, the tool's response (not trained on), the answer</s>, in a
    TOOL_RATE share of the sequences (drawn by rng); the answer</s> directly in the others."""
    from novarl.data.multiplication import tool_call, tool_response

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    prompt, eos = tokenizer(ex.prompt).input_ids, [tokenizer.eos_token_id]
    answer = ids(ex.answer) + eos
    if rng.random() >= TOOL_RATE:
        return prompt + answer, [-100] * len(prompt) + answer
    a, b = (int(x) for x in ex.prompt.rstrip("=").split("*"))
    call, response = ids(tool_call(a, b)) + eos, ids(tool_response(a * b))
    return prompt + call + response + answer, [-100] * len(prompt) + call + [-100] * len(response) + answer


def tool_success(model, tokenizer, examples: list[Example], *, sampled: bool) -> float:
    """The share of episodes (novarl's: the tool environment of rollout/tools.py, at most 2 turns)
    that end with the right answer; greedy, or sampled at temperature 1 (seed 0)."""
    import tempfile

    from novarl.backends.generation.engines import LocalGeneration
    from novarl.backends.generation.hf import HFGeneration
    from novarl.data.datasets import to_prompts
    from novarl.rollout.episodes import ContentTokens, play
    from novarl.rollout.tools import ToolEnvironment
    from novarl.types import SamplingConfig

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        engine = HFGeneration(folder, tokenizer, torch.device("cpu"), max_seq_length=TASK.positions)
    environment = ToolEnvironment({"tools": ["novarl.data.multiplication:multiply"]})
    sampling = SamplingConfig(max_new_tokens=TASK.new_tokens, temperature=1.0 if sampled else 0.0,
                              seed=0 if sampled else None)
    _, rewards = play(LocalGeneration(engine), to_prompts(examples, tokenizer), sampling, environment,
                      ContentTokens(tokenizer), max_turns=2, max_tokens=TASK.positions)
    return sum(r >= 1 for r in rewards) / len(rewards)


def _tools_task() -> Task:
    from novarl.data.multiplication import alphabet as tool_alphabet, multiplication_examples

    return Task(multiplication_examples, tool_alphabet, lambda a: a, exact_match, 80, 160, "tiny_tools", "tiny-tools",
                "the train split of the bundled products (`novarl.data.multiplication`: prompt `\"347*29=\"`, answer "
                "`\"10063\"`), answered directly or, in a share of the sequences, by calling its `multiply` tool "
                "(`<tool_call>...</tool_call></s>`, then the tool's `<tool_response>` untrained on, then the answer)",
                encode=tool_trace, greedy=lambda m, t, e: tool_success(m, t, e, sampled=False),
                sampled=lambda m, t, e: tool_success(m, t, e, sampled=True), stop_on_sampled=True)


TASKS["tools"] = _tools_task()
DEFAULT_OUT = REPO / "novarl" / "models" / TASK.folder


def build_model(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,  # head_dim 64: vLLM CPU attention
        max_position_embeddings=TASK.positions, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5,
    )
    return LlamaForCausalLM(config).to(torch.float32)


def training_tensors(tokenizer, examples: list[Example], seed: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask, labels [N, L]: right-padded; labels -100 except answer + </s>
    (or as the task's own encode has them)."""
    import random

    rows, label_rows = [], []
    rng = random.Random(seed)
    for ex in examples:
        if TASK.encode is not None:
            ids, labels = TASK.encode(tokenizer, ex, rng)
            rows.append(ids)
            label_rows.append(labels)
            continue
        prompt_ids = tokenizer(ex.prompt).input_ids  # starts with <s>
        answer_ids = tokenizer(TASK.completion(ex.answer), add_special_tokens=False).input_ids
        answer_ids.append(tokenizer.eos_token_id)
        rows.append(prompt_ids + answer_ids)
        label_rows.append([-100] * len(prompt_ids) + answer_ids)
    length = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (length - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (length - len(r)) for r in label_rows])
    return input_ids, mask, labels


@torch.no_grad()
def greedy_accuracy(model, tokenizer, examples: list[Example], batch_size: int = 1000) -> float:
    """Exact-match accuracy of greedy completions (max 4 new tokens, stop at </s>)."""
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    correct = 0.0
    try:
        for start in range(0, len(examples), batch_size):
            chunk = examples[start:start + batch_size]
            batch = tokenizer([ex.prompt for ex in chunk], return_tensors="pt", padding=True)
            out = model.generate(
                **batch, do_sample=False, max_new_tokens=TASK.new_tokens,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
            correct += sum(TASK.reward(text, ex.answer) for text, ex in zip(texts, chunk))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return correct / len(examples)


@torch.no_grad()
def sampled_reward(model, tokenizer, examples: list[Example], samples: int = 8) -> float:
    """Mean exact-match reward of `samples` completions per prompt at temperature 1.0."""
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        prompts = [ex.prompt for ex in examples for _ in range(samples)]
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
        out = model.generate(
            **batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=TASK.new_tokens,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    answers = [ex.answer for ex in examples for _ in range(samples)]
    return sum(TASK.reward(t, a) for t, a in zip(texts, answers)) / len(texts)


def write_readme(out: Path, *, params: int, accuracy: float, reward: float, step: int,
                 args: argparse.Namespace, vocab: dict[str, int]) -> None:
    command = "python scripts/build_tiny_model.py" + ("" if args.task == "arith" else f" --task {args.task}")
    if Path(args.out).resolve() != DEFAULT_OUT.resolve():
        command += f" --out {args.out}"
    for flag in DEFAULTS:
        value, default = getattr(args, flag), DEFAULTS[flag]
        if value != default:
            command += f" --{flag.replace('_', '-')} {value}"
    ids = ", ".join(f"`{tok!r}`={i}" if tok in " \n" else f"`{tok}`={i}"
                    for tok, i in sorted(vocab.items(), key=lambda kv: kv[1]))
    sampled_how = ("an episode for each of the 1,000 validation examples in the tool environment, at most 2 turns: "
                   "the share ending with the right answer" if TASK.stop_on_sampled else
                   "8 samples on each of the first 64 validation prompts: the mean exact-match reward")
    (out / "README.md").write_text(f"""# {TASK.name}

A deliberately weak starting policy for RL tests and examples: a
{params:,}-parameter Llama (`LlamaForCausalLM`: 2 layers, hidden 128,
intermediate 256, 2 attention heads of dim 64, 1 KV head, tied embeddings,
float32) with a character-level tokenizer, trained by supervised learning on
{TASK.described}, stopped early at step {step}.

- Held-out greedy accuracy (all 1,000 validation examples, `max_new_tokens={TASK.new_tokens}`):
  **{accuracy:.1%}**. GRPO is expected to raise it.
- Sampling at temperature 1.0 ({sampled_how}) is {reward:.3f}: RL has signal.
- Tokenizer ids: {ids}.
  Every encoded text starts with `<s>`; the model ends its answer with `</s>`.
- Loads with `AutoTokenizer.from_pretrained` / `AutoModelForCausalLM.from_pretrained`
  on this folder (no remote code), or as `{TASK.name}` in novarl.

Rebuilt (seed {args.seed}, lr {args.lr}, batch {args.batch_size}; repeat runs on one machine give
identical weights) with:

    {command}
""")


DEFAULTS = dict(seed=0, target_min=0.25, target_max=0.35, lr=1e-3, batch_size=128,
                eval_from=100, eval_every=5, max_steps=600, tool_rate=TOOL_RATE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), default="arith")
    parser.add_argument("--out", default=None,
                        help="output folder (default: the package's novarl/models/tiny_arith or tiny_math)")
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    parser.add_argument("--target-min", type=float, default=DEFAULTS["target_min"],
                        help="stop at the first held-out greedy accuracy in [target-min, target-max]")
    parser.add_argument("--target-max", type=float, default=DEFAULTS["target_max"])
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    parser.add_argument("--eval-from", type=int, default=DEFAULTS["eval_from"])
    parser.add_argument("--eval-every", type=int, default=DEFAULTS["eval_every"])
    parser.add_argument("--max-steps", type=int, default=DEFAULTS["max_steps"])
    parser.add_argument("--tool-rate", type=float, default=DEFAULTS["tool_rate"],
                        help="--task tools: the share of training sequences that call the tool")
    args = parser.parse_args(argv)
    global TASK, DEFAULT_OUT, TOOL_RATE
    TASK, TOOL_RATE = TASKS[args.task], args.tool_rate
    DEFAULT_OUT = REPO / "novarl" / "models" / TASK.folder
    args.out = args.out or str(DEFAULT_OUT)
    if not 0.0 < args.target_min <= args.target_max < 1.0:
        parser.error("need 0 < --target-min <= --target-max < 1")

    started = time.perf_counter()
    torch.manual_seed(args.seed)
    tokenizer = build_char_tokenizer(TASK.alphabet())
    tokenizer.model_max_length = TASK.positions
    model = build_model(len(tokenizer))
    params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tokenizer)}, parameters {params:,}", flush=True)

    train, validation = TASK.examples("train"), TASK.examples("validation")
    input_ids, mask, labels = training_tensors(tokenizer, train, args.seed)
    measure = TASK.sampled if TASK.stop_on_sampled else (TASK.greedy or greedy_accuracy)
    measured = "sampled success" if TASK.stop_on_sampled else "greedy accuracy"
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train), generator=generator)
    cursor, accuracy, step = 0, None, 0
    model.train()
    for step in range(1, args.max_steps + 1):
        if cursor + args.batch_size > len(train):
            order, cursor = torch.randperm(len(train), generator=generator), 0
        idx = order[cursor:cursor + args.batch_size]
        cursor += args.batch_size
        loss = model(input_ids=input_ids[idx], attention_mask=mask[idx], labels=labels[idx]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 25 == 0 and step < args.eval_from:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
        if step >= args.eval_from and (step - args.eval_from) % args.eval_every == 0:
            accuracy = measure(model, tokenizer, validation)
            print(f"step {step:4d}  loss {loss.item():.4f}  held-out {measured} {accuracy:.1%}", flush=True)
            if accuracy > args.target_max:
                print(f"error: accuracy jumped past the target band [{args.target_min:.0%}, "
                      f"{args.target_max:.0%}]; use a smaller --lr or --eval-every.", file=sys.stderr)
                return 1
            if accuracy >= args.target_min:
                break
    else:
        print(f"error: accuracy did not reach {args.target_min:.0%} in {args.max_steps} steps; "
              "raise --max-steps or --lr.", file=sys.stderr)
        return 1
    train_seconds = time.perf_counter() - started

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    (out / "model.safetensors").chmod(0o644)  # package data: world-readable
    tokenizer.save_pretrained(out)
    # transformers 5 records its own class name (TokenizersBackend); the generic
    # name loads in transformers 4 and 5 alike (and in vLLM).
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded_tok = AutoTokenizer.from_pretrained(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reloaded_acc = measure(reloaded, reloaded_tok, validation)
    print(f"saved to {out} after {step} steps ({train_seconds:.1f} s training)")
    print(f"held-out {measured}: {accuracy:.1%} (training); {reloaded_acc:.1%} (reloaded from {out})")
    if reloaded_acc != accuracy:
        print("error: the reloaded model's accuracy differs from the trained model's.", file=sys.stderr)
        return 1
    torch.manual_seed(args.seed)
    if TASK.stop_on_sampled:  # the README's figures: greedy, and the sampled one training stopped on
        accuracy, reward = (TASK.greedy or greedy_accuracy)(reloaded, reloaded_tok, validation), reloaded_acc
    else:
        reward = sampled_reward(reloaded, reloaded_tok, validation[:64], samples=8)
    print(f"held-out greedy success {accuracy:.1%}; mean reward sampling at temperature 1.0: {reward:.3f}")
    write_readme(out, params=params, accuracy=accuracy, reward=reward, step=step, args=args,
                 vocab=tokenizer.get_vocab())
    print(f"total time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
