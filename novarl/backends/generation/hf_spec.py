"""Hugging Face generation's spec: engines of the policy's transformers model, anywhere."""

from __future__ import annotations

from novarl.backends.spec import GenerationSpec


class HFSpec(GenerationSpec):
    title = "Hugging Face"
    name = "hf"
    engine_class = "novarl.backends.generation.hf:HFGeneration"
    vllm_cfg_read = frozenset({"precision"})
    vllm_cfg_note = "Hugging Face generation reads only vllm_cfg.precision, its dtype"

    def _standalone(self, model_path: str, tokenizer, **kwargs):
        import torch

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return self.implementation()(model_path, tokenizer, device, **kwargs)


SPEC = HFSpec()
