"""What the benchmarks share: a random-initialised ~100M-parameter Llama with the
bundled character tokenizer (no download needed), and the machine's CPU name.
Imports nothing of novarl at module level (a benchmark may run another checkout's)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def random_llama_100m(folder: Path) -> tuple[str, int]:
    """Save the model and tokenizer to `folder`; (path, parameter count)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from novarl.models.loading import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-arith"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=768, intermediate_size=2048, num_hidden_layers=14,
        num_attention_heads=12, num_key_value_heads=12, head_dim=64, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder), model.num_parameters()


def synthetic_batch(batch_size: int, seq_len: int):
    """A fixed TrainBatch of random tokens of the bundled vocabulary, the second half of each
    row trained on, random advantages (seeded)."""
    import torch

    from novarl.types import TrainBatch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 18, (batch_size, seq_len), generator=gen)
    mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask = mask.clone()
    loss_mask[:, :seq_len // 2] = False
    return TrainBatch.from_rows(ids, mask, loss_mask, torch.randn(batch_size, generator=gen))


class TimedPolicy:
    """A Ray rank's policy on a fixed batch (set by the subclass: policy, batch, loss, head): one timed
    step, and the process's peak resident memory."""

    def step(self) -> float:
        """Seconds of a logprob pass + forward/backward + optimizer step."""
        import time

        start = time.perf_counter()
        self.batch.old_logprobs = self.policy.forward(self.batch, self.head)
        self.policy.forward_backward(self.batch, self.loss, self.head)
        self.policy.optim_step()
        return time.perf_counter() - start

    def peak_rss_mb(self) -> float:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
