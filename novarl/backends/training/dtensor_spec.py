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
        """Compiled tensor-parallel decoder layers run on the default plans (local tensors inside: local_tp.py).
        On torch's DTensor styles (a custom plan), once a micro-batch's sequence length differed from the first
        one's, torch (2.13, two CPU ranks) failed to trace their training pass. The policy's and the critic's
        sections."""
        problems = []
        for name, section in (("policy", cfg.policy), ("value", cfg.value)):
            dt = section.dtensor_cfg if section is not None else None
            if dt is None or not dt.torch_compile or dt.tensor_parallel_size == 1 or not dt.custom_parallel_plan:
                continue
            problems.append(f"{name}.dtensor_cfg.torch_compile=true with tensor_parallel_size="
                            f"{dt.tensor_parallel_size} and a custom_parallel_plan: its layers run on torch's "
                            "DTensor styles, which torch cannot trace once the sequence length varies; compiled "
                            "tensor-parallel layers need the default plan. Set torch_compile: false, or drop "
                            "custom_parallel_plan.")
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
