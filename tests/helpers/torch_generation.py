"""A generation backend defined outside novarl, to prove that one module and one registry line add
one (issue 32): `TorchSampler` samples token by token from the policy model's logits with torch
alone (no `generate`, no KV cache: every step runs the whole sequence, fine for a tiny model), and
takes the trainer's weights at each sync like any engine.

Registered by a test with `monkeypatch.setitem(registry.GENERATION, NAME, __name__)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from novarl.backends.generation.hf import make_completion
from novarl.backends.protocols import Engine
from novarl.backends.spec import GenerationSpec
from novarl.models.loading import DTYPES, load_causal_lm
from novarl.types import Completion, Prompt, SamplingConfig

NAME = "torch_sampler"


class TorchSamplerSpec(GenerationSpec):
    name = NAME
    title = "torch sampling (a test backend)"
    engine_class = f"{__name__}:TorchSampler"
    vllm_cfg_note = "the test's torch sampler reads no vllm_cfg key"


SPEC = TorchSamplerSpec()


class TorchSampler(Engine):
    """Implements Engine: left-padded prompt rows, one forward of the whole rows per new token."""

    built: list[TorchSampler] = []
    """Every engine built, so that a test can see what the run did with its own."""

    @staticmethod
    def engine_kwargs(cfg, *, model_path: str, tokenizer, precision: str) -> dict:
        """The constructor's arguments for a run's config (trainer/setup.py build_generator asks)."""
        return dict(model_path=model_path, tokenizer=tokenizer, precision=precision,
                    max_seq_length=cfg.policy.max_seq_length)

    def __init__(self, model_path: str, tokenizer, *, precision: str, max_seq_length: int) -> None:
        self.model = load_causal_lm(model_path, dtype=DTYPES[precision]).requires_grad_(False)
        self.tokenizer, self.max_seq_length = tokenizer, max_seq_length
        self.version = 0
        self.generate_calls = 0
        self.weight_versions: list[int] = []
        """The version of every update_weights, in order."""
        TorchSampler.built.append(self)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> list[Completion]:
        self.generate_calls += 1
        pad = self.tokenizer.pad_token_id
        width = max(len(p.token_ids) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt.token_ids):] = torch.tensor(prompt.token_ids)
            mask[row, width - len(prompt.token_ids):] = 1
        stop_ids = {self.tokenizer.eos_token_id, *sampling.stop_token_ids}
        budget = max(1, min(sampling.max_new_tokens, self.max_seq_length - min(len(p.token_ids) for p in prompts)))
        rng = torch.Generator().manual_seed(sampling.seed + sampling.seed_offset) if sampling.seed is not None else None
        new, logprobs = [], []
        for _ in range(budget):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
            if sampling.temperature == 0:
                token = logits.argmax(-1)
                scores = torch.log_softmax(logits, -1)
            else:
                scores = torch.log_softmax(logits / sampling.temperature, -1)
                token = torch.multinomial(scores.exp(), 1, generator=rng).squeeze(1)
            new.append(token)
            logprobs.append(scores.gather(-1, token[:, None]).squeeze(1))
            ids = torch.cat([ids, token[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(token)[:, None]], 1)
        tokens, logprobs = torch.stack(new, 1).tolist(), torch.stack(logprobs, 1).tolist()
        return [make_completion(p, tokens[i], logprobs[i], stop_ids=stop_ids, tokenizer=self.tokenizer,
                                max_seq_length=self.max_seq_length, version=self.version)
                for i, p in enumerate(prompts)]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)
        self.version = version
        self.weight_versions.append(version)
