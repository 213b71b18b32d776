"""The Megatron-core training backend's spec: tensor, pipeline, context and expert parallelism,
first in the seeds' precedence; on CUDA GPUs (emulated on the CPU for tests)."""

from __future__ import annotations

import os

from novarl import host
from novarl.backends.spec import ParallelSizes, TrainingSpec
from novarl.host import installed

MEGATRON_ON_CPU = "NOVARL_MEGATRON_ON_CPU"
"""backends/megatron/cpu.py's switch (read here without importing it: it imports torch)."""


TE_OPTIONS = (
    ("apply_rope_fusion", lambda mc: mc.apply_rope_fusion),
    ("moe_permute_fusion", lambda mc: mc.moe_permute_fusion),
    ("sequence_parallel (with tensor_model_parallel_size > 1)",
     lambda mc: mc.sequence_parallel and mc.tensor_model_parallel_size > 1),
    ("fp8_cfg.enabled", lambda mc: mc.fp8_cfg is not None and mc.fp8_cfg.enabled),
    ("context_parallel_size (> 1: its attention)", lambda mc: mc.context_parallel_size > 1),
)
"""Megatron options whose kernels come from Transformer Engine, which GPU hosts have."""


def transformer_engine_options(cfg) -> list[str]:
    """What megatron_cfg asks of Transformer Engine when it is not installed (one line)."""
    if installed("transformer_engine"):
        return []
    mc = cfg.policy.megatron_cfg
    asked = [f"policy.megatron_cfg.{name}" for name, used in TE_OPTIONS if used(mc)]
    if not asked:
        return []
    return [f"Transformer Engine (pip install --no-build-isolation 'novarl[te]' on the GPU hosts; NGC's PyTorch "
            f"images have it) for {', '.join(asked)}"]


def _layout(cfg) -> dict[str, int | bool]:
    """A run's Megatron layout as its config gives it (the ranks write it to the checkpoint's layout.json)."""
    from novarl.backends.contract.resolve import world_size

    mc = cfg.policy.megatron_cfg
    sizes = {"tp": mc.tensor_model_parallel_size, "pp": mc.pipeline_model_parallel_size,
             "cp": mc.context_parallel_size, "ep": mc.expert_model_parallel_size,
             "etp": mc.expert_tensor_parallel_size, "vpp": mc.virtual_pipeline_model_parallel_size or 1}
    model_parallel = sizes["tp"] * sizes["pp"] * sizes["cp"]
    return {**sizes, "dp": max(world_size(cfg) // model_parallel, 1),
            "distributed_optimizer": mc.optimizer.use_distributed_optimizer and mc.use_distributed_optimizer}


class MegatronSpec(TrainingSpec):
    name = "megatron"
    section = "megatron_cfg"
    policy_class = "novarl.backends.training.megatron:MegatronPolicy"
    reference_class = "novarl.backends.training.megatron:MegatronReference"
    critic_class = "novarl.backends.training.megatron_critic:MegatronCritic"
    checkpoint_module = "novarl.backends.training.megatron_checkpoint"
    lora = False
    pipeline = True
    sequence_parallel_with_tp = True
    own_generation = "megatron"
    async_in_process = False
    reads_model_files = True

    def missing(self, cfg) -> tuple[list[str], list[str]]:
        if not installed("megatron.core"):
            return ["megatron-core, for policy.megatron_cfg.enabled: pip install 'novarl[megatron]'"], []
        if not host.has_cuda() and os.environ.get(MEGATRON_ON_CPU, "") in ("", "0"):
            return [], ["a CUDA GPU: Megatron-core trains and generates on CUDA GPUs only, and this host has none "
                        "(its weight conversion runs anywhere; "
                        f"{MEGATRON_ON_CPU}=1 runs it on the CPU for tests, slowly)"]
        return [], []

    def parallel_sizes(self, cfg) -> ParallelSizes:
        mg = cfg.policy.megatron_cfg
        return ParallelSizes(
            "dp x tp x pp x cp",
            "policy.megatron_cfg.tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size",
            (mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size, mg.context_parallel_size),
            ("policy.megatron_cfg.tensor_model_parallel_size", mg.tensor_model_parallel_size))

    def describe_split(self, cfg, ranks: int, split: str) -> str:
        ep = cfg.policy.megatron_cfg.expert_model_parallel_size
        return f"{split}, ep {ep}" if ep > 1 else split

    def micro_batching_problems(self, section, name: str) -> list[str]:
        """Also: dynamic batching with a pipeline (as in NeMo RL)."""
        problems = super().micro_batching_problems(section, name)
        pipeline = section.megatron_cfg.pipeline_model_parallel_size
        if section.dynamic_batching.enabled and pipeline > 1:
            problems.append(f"policy.dynamic_batching with policy.megatron_cfg.pipeline_model_parallel_size="
                            f"{pipeline}: pipeline stages exchange buffers of one shape, which micro-batches of "
                            "varying rows would pad to the largest; use policy.sequence_packing instead.")
        return problems

    def layout_overrides(self, layout) -> list[str]:
        """Sequence parallelism with TP where Transformer Engine is there to run it and generation
        is not Megatron's (decoding feeds one token at a time, which it cannot split)."""
        from novarl.backends.megatron.model import transformer_engine_available

        sequence_parallel = (layout.tensor_parallel_size > 1 and transformer_engine_available()
                             and not layout.generation_on_training_weights)
        vpp = layout.virtual_pipeline_parallel_size
        return ["policy.dtensor_cfg.tensor_parallel_size=1",
                f"policy.megatron_cfg.tensor_model_parallel_size={layout.tensor_parallel_size}",
                f"policy.megatron_cfg.pipeline_model_parallel_size={layout.pipeline_parallel_size}",
                f"policy.megatron_cfg.expert_model_parallel_size={layout.expert_parallel_size}",
                f"policy.megatron_cfg.virtual_pipeline_model_parallel_size={vpp if vpp > 1 else 'null'}",
                f"policy.megatron_cfg.sequence_parallel={str(sequence_parallel).lower()}",
                f"policy.megatron_cfg.activation_checkpointing={str(layout.activation_checkpointing).lower()}"]

    def resume_problem(self, saved, cfg) -> str | None:
        """The layout the config gives (the ranks check the rest of it, e.g. the model's, when they load)."""
        was, now = _layout(saved), _layout(cfg)
        if was == now:
            return None
        return (f"was written with {was} (Megatron ranks); this run has {now}. Resume with the same layout, or "
                "export it with `novarl convert` and start from the Hugging Face folder.")

    def role_arguments(self) -> dict:
        return {"emulate_cuda": self.emulated()}  # the ranks' processes may not see the variable

    def emulated(self) -> bool:
        from novarl.backends.megatron import cpu

        return cpu.requested()

    def host_options(self, cfg) -> list[str]:
        return transformer_engine_options(cfg)

    def check_model(self, cfg, model_path: str, *, shape_only: bool = False) -> None:
        """What megatron_cfg asks of this model, checked here rather than on every rank; shape_only:
        its layers, heads and experts against the parallel sizes (not the TransformerConfig this
        host would build)."""
        import torch
        from transformers import AutoConfig

        from novarl.backends.contract.resolve import world_size
        from novarl.backends.megatron.model import check_model, transformer_config
        from novarl.models.scores import training_precision

        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.policy.trust_remote_code)
        shape = check_model(hf_config, cfg.policy)
        if shape_only:
            return
        precision = training_precision(cfg.policy.precision, on_gpu=torch.cuda.is_available())
        transformer_config(hf_config, shape, cfg.policy, precision=precision, world_size=world_size(cfg))


SPEC = MegatronSpec()
