"""Megatron generation's spec: the policy's own Megatron model samples on the policy's ranks."""

from __future__ import annotations

from novarl.backends.spec import GenerationSpec


class MegatronGenerationSpec(GenerationSpec):
    title = "Megatron"
    name = "megatron"
    on_policy_ranks_class = "novarl.backends.generation.megatron:MegatronGeneration"
    vllm_cfg_note = "Megatron generation samples with the policy's own model"
    on_training_weights = True

    def on_policy_ranks_arguments(self, cfg) -> dict:
        return {"config": cfg.policy.generation.mcore_generation_config}


SPEC = MegatronGenerationSpec()
