"""The DTensor (FSDP2) training backend's spec: the default, with tensor and context parallelism."""

from __future__ import annotations

from novarl.backends.spec import ParallelSizes, TrainingSpec


class DTensorSpec(TrainingSpec):
    name = "dtensor"
    section = "dtensor_cfg"
    policy_class = "novarl.backends.training.dtensor:DTensorPolicy"
    reference_class = "novarl.backends.training.dtensor:DTensorReference"
    critic_class = "novarl.backends.training.dtensor:DTensorCritic"
    checkpoint_module = "novarl.backends.training.dtensor_checkpoint"
    context_parallel = True

    def missing(self, cfg) -> tuple[list[str], list[str]]:
        """Compiled tensor-parallel decoder layers (refused: not built). Once a micro-batch's sequence length
        differs from the first one's, torch (2.13, on two CPU ranks) failed to trace their training pass: without
        sequence parallelism the backward's view of the split activations recursed without end; with it, the
        norms' sharded inputs of a symbolic length could not be hashed. Context parallelism, LoRA and activation
        checkpointing compile."""
        sections = [("policy", cfg.policy)] + ([("value", cfg.value)] if cfg.value is not None else [])
        return [f"compiled tensor-parallel layers ({name}.dtensor_cfg.torch_compile: true with tensor_parallel_size="
                f"{dt.tensor_parallel_size}: torch cannot trace their training pass once the sequence length varies, "
                "with or without sequence_parallel); set torch_compile: false (context parallelism, LoRA and "
                "activation checkpointing compile)"
                for name, dt in ((name, section.dtensor_cfg) for name, section in sections)
                if dt.torch_compile and dt.tensor_parallel_size > 1], []

    def parallel_sizes(self, cfg) -> ParallelSizes:
        dt = cfg.policy.dtensor_cfg
        return ParallelSizes("dp x tp x cp", "policy.dtensor_cfg.tensor_parallel_size x context_parallel_size",
                             (dt.tensor_parallel_size, dt.context_parallel_size),
                             ("policy.dtensor_cfg.tensor_parallel_size", dt.tensor_parallel_size))

    def layout_overrides(self, layout) -> list[str]:
        return [f"policy.dtensor_cfg.tensor_parallel_size={layout.tensor_parallel_size}",
                f"policy.dtensor_cfg.context_parallel_size={layout.context_parallel_size}",
                f"policy.dtensor_cfg.activation_checkpointing={str(layout.activation_checkpointing).lower()}",
                f"policy.dtensor_cfg.cpu_offload={str(layout.cpu_offload).lower()}"]


SPEC = DTensorSpec()
