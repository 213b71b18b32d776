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

    def config_problems(self, cfg) -> list[str]:
        """Compiled tensor-parallel decoder layers are not built: once a micro-batch's sequence length differs
        from the first one's, torch (2.13, two CPU ranks) failed to trace their training pass (without sequence
        parallelism the backward's view of the split activations recursed without end; with it, the norms'
        sharded inputs of a symbolic length could not be hashed). The policy's and the critic's sections."""
        problems = []
        for name, section in (("policy", cfg.policy), ("value", cfg.value)):
            dt = section.dtensor_cfg if section is not None else None
            if dt is not None and dt.torch_compile and dt.tensor_parallel_size > 1:
                problems.append(f"{name}.dtensor_cfg.torch_compile=true with tensor_parallel_size="
                                f"{dt.tensor_parallel_size}: compiled tensor-parallel layers are not available yet "
                                "(torch cannot trace their training pass once the sequence length varies, with or "
                                "without sequence_parallel); set torch_compile: false (context parallelism, LoRA "
                                "and activation checkpointing compile).")
        return problems

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
