"""PPO's critic on Megatron-core: the policy's model (megatron.py) with a scalar head on its last
pipeline stage in the place of the vocabulary-parallel output layer."""

from __future__ import annotations

from pathlib import Path

import torch

from novarl.backends.training.megatron import MegatronPolicy
from novarl.config.schema import PolicyConfig
from novarl.errors import NotAvailableYet


class MegatronCritic(MegatronPolicy):
    """PPO's value model (its critic) on Megatron-core, laid out like the policy: the same GPTModel
    with a scalar head on the last stage (ScalarHead), trained by the value loss. As on DTensor
    (dtensor.py DTensorCritic), `logprobs(batch)` here is the batch's per-token values, each
    token's from its predecessor's hidden state, 0 at each sequence's first token: its head is
    Values() (models/scores.py)."""

    def __init__(self, policy: PolicyConfig, model_path: str, device: torch.device | None = None, *,
                 total_steps: int, seed: int = 42, emulate_cuda: bool = False) -> None:
        super().__init__(policy, model_path, device, total_steps=total_steps, seed=seed,
                         emulate_cuda=emulate_cuda, value_head=True)

    def save_hf(self, path: Path, tokenizer, fmt=None) -> None:
        raise NotAvailableYet("a Hugging Face folder of a Megatron critic is not built yet (its checkpoints resume; "
                              "a DTensor or DeepSpeed critic exports with `novarl convert --critic`)")


class ScalarHead(torch.nn.Module):
    """The critic's output layer on Megatron's last stage, in the place of the vocabulary-parallel
    one (called as it is: hidden states [s, b, h], returns ([s, b, 1], None)): one value per
    position, weight and bias zero at the start, the same on every tensor-parallel rank. Under
    sequence parallelism the positions are gathered first; every rank computes the same loss,
    so the gradient is split back, not summed."""

    def __init__(self, hidden_size: int, *, dtype: torch.dtype, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core import tensor_parallel

            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None
