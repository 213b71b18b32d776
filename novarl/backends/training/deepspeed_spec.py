"""The DeepSpeed ZeRO training backend's spec: every rank a data-parallel rank."""

from __future__ import annotations

from novarl.backends.spec import ParallelSizes, TrainingSpec
from novarl.host import installed


class DeepSpeedSpec(TrainingSpec):
    name = "deepspeed"
    section = "deepspeed_cfg"
    policy_class = "novarl.backends.training.deepspeed:DeepSpeedPolicy"
    reference_class = "novarl.backends.training.deepspeed:DeepSpeedReference"
    critic_class = "novarl.backends.training.deepspeed:DeepSpeedCritic"
    checkpoint_module = "novarl.backends.training.deepspeed_checkpoint"

    def missing(self, cfg) -> tuple[list[str], list[str]]:
        if installed("deepspeed"):
            return [], []
        return ["DeepSpeed, for policy.deepspeed_cfg.enabled: pip install 'novarl[deepspeed]' "
                "(the Makefile shows how on a CPU-only host)"], []

    def parallel_sizes(self, cfg) -> ParallelSizes:
        return ParallelSizes("dp", "", (1,), None)  # ZeRO: every rank is a data-parallel rank

    def describe_split(self, cfg, ranks: int, split: str) -> str:
        return f"dp {ranks} (ZeRO-{cfg.policy.deepspeed_cfg.zero_stage})"

    def config_problems(self, cfg) -> list[str]:
        """DeepSpeed takes precedence over an enabled DTensor section, and ZeRO has no tensor
        parallelism: a DTensor tensor-parallel size there would be dropped, so it is refused.
        (A disabled dtensor_cfg is not read.)"""
        policy = cfg.policy
        tp = policy.dtensor_cfg.tensor_parallel_size
        if not policy.dtensor_cfg.enabled or tp == 1:
            return []
        return [f"policy.dtensor_cfg.tensor_parallel_size={tp} with policy.deepspeed_cfg.enabled: DeepSpeed takes "
                "precedence over DTensor, and novarl's ZeRO shards over every rank as data parallel, with no tensor "
                "parallelism. Set policy.dtensor_cfg.tensor_parallel_size=1 to train with ZeRO, or "
                "policy.deepspeed_cfg.enabled=false to train with DTensor's tensor parallelism."]

    def layout_overrides(self, layout) -> list[str]:
        return [f"policy.deepspeed_cfg.zero_stage={layout.zero_stage}",
                f"policy.deepspeed_cfg.activation_checkpointing={str(layout.activation_checkpointing).lower()}"]

    def resume_problem(self, saved, cfg) -> str | None:
        from novarl.backends.contract.resolve import world_size

        if world_size(saved) == world_size(cfg):
            return None
        return (f"holds a DeepSpeed checkpoint written by {world_size(saved)} ranks; ZeRO's partitions load only on "
                f"as many ranks, and this config has {world_size(cfg)} (cluster.gpus_per_node x cluster.num_nodes). "
                "`novarl convert` turns it into a Hugging Face folder on any number.")

    def trainer_arguments(self, *, accumulation_steps: int) -> dict:
        return {"accumulation_steps": accumulation_steps}  # DeepSpeed's engine counts its micro-batches


SPEC = DeepSpeedSpec()
