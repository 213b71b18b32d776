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
