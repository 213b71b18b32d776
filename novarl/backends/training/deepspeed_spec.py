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
        (A disabled dtensor_cfg is not read.) Compiled layers under ZeRO-3 are refused too: stage 3
        fetches each submodule's parameters in a forward hook that DeepSpeed wraps in
        torch.compiler.disable, so dynamo breaks each layer's graph at those hooks (torch 2.13 and DeepSpeed
        0.19 on a CPU: equal to eager, in pieces between the linears and norms), not the fused layer."""
        policy, problems = cfg.policy, []
        tp = policy.dtensor_cfg.tensor_parallel_size
        if policy.dtensor_cfg.enabled and tp > 1:
            problems.append(
                f"policy.dtensor_cfg.tensor_parallel_size={tp} with policy.deepspeed_cfg.enabled: DeepSpeed takes "
                "precedence over DTensor, and novarl's ZeRO shards over every rank as data parallel, with no tensor "
                "parallelism. Set policy.dtensor_cfg.tensor_parallel_size=1 to train with ZeRO, or "
                "policy.deepspeed_cfg.enabled=false to train with DTensor's tensor parallelism.")
        for name, section in (("policy", policy), ("value", cfg.value)):
            ds = section.deepspeed_cfg if section is not None else None
            if ds is not None and ds.torch_compile and ds.zero_stage == 3:
                problems.append(
                    f"{name}.deepspeed_cfg.torch_compile=true with zero_stage=3: ZeRO-3 gathers each submodule's "
                    "parameters in a hook that DeepSpeed keeps out of compiled code, so a decoder layer would "
                    "compile in pieces between its linears, not as one fused graph. Set torch_compile: false, "
                    "or use zero_stage 2 (or DTensor's FSDP2, whose layers compile whole) for compiled layers.")
        return problems

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
