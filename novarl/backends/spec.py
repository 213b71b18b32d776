"""What the run's contract, the planner and the trainer ask of a backend, in one object per
backend: its config section, what it needs installed and of the host, its parallel sizes, its
own config rules, its constructor arguments and what it can do. The registry maps names to
specs (backends/registry.py); code outside backends/ asks the spec instead of comparing names.

A spec imports no torch and no backend library: `novarl plan` and `novarl validate` read them
on a machine without either. Its implementation (module and classes) is imported when a run
uses it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from novarl.backends.contract.model_shape import ModelShape
    from novarl.config.schema import NovaRLConfig


def load(path: str) -> type:
    """The class at 'module:Class', imported now."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class ParallelSizes:
    """How a training backend splits its ranks: the layout in words ('dp x tp x cp'), the keys of
    its model-parallel sizes, their values, and its tensor-parallel (key, size) (None: none)."""
    layout: str
    keys: str
    sizes: tuple[int, ...]
    tensor_parallel: tuple[str, int] | None


@dataclass(frozen=True)
class PlannedLayout:
    """A layout the planner chose (plan/auto.py), for a spec to write as its config keys."""
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    virtual_pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    zero_stage: int | None = None
    generation_on_training_weights: bool = False


@dataclass(frozen=True)
class HfExport:
    """One role of a checkpoint to write as a Hugging Face folder (`TrainingSpec.export_hf`)."""
    folder: Path
    """The role's folder in the checkpoint: step_N/policy, or step_N/critic."""
    section: Any
    """Its config section: the saved config's `policy`, or `value` for the critic."""
    model_path: str
    tokenizer: Any
    output: Path
    fmt: Any
    """The folder's precision and file format (models.loading.export_format)."""
    critic: bool
    """PPO's critic: a token-classification folder (models/critic.py)."""
    save: Callable[[Path, Callable[[Path], None]], None]
    """save(output, write): write(folder) into a temporary sibling, then renamed (trainer.api.save_atomically)."""


class TrainingSpec:
    """A training backend. Subclasses set the class attributes and override what differs."""

    name: str
    section: str
    """Its config section under `policy` ('dtensor_cfg'), whose `enabled` turns it on."""
    policy_class: str
    reference_class: str
    critic_class: str
    """'module:Class' of the trainable policy, the frozen reference and the PPO critic."""
    checkpoint_module: str
    """The module that reads its checkpoints: files_problem(folder, role, verify=) and export_hf(HfExport)."""
    lora = True
    """Trains LoRA adapters (policy.dtensor_cfg.lora_cfg)."""
    context_parallel = False
    """Splits sequences by policy.dtensor_cfg.context_parallel_size."""
    pipeline = False
    """Has pipeline stages (and interleaved ones): the planner may size them."""
    sequence_parallel_with_tp = False
    """The planner's layouts turn sequence parallelism on with tensor parallelism."""
    own_generation: str | None = None
    """The generation backend that samples with this backend's own model on its ranks."""
    async_in_process = True
    """A one-rank colocated run in the driver's process may run async GRPO (same trajectories as
    dedicated engines, nothing overlapping): built for DTensor and DeepSpeed, not Megatron."""
    reads_model_files = False
    """Its ranks read (convert) the model's files: a hub id is fetched before they start."""

    def enabled(self, cfg: NovaRLConfig) -> bool:
        return bool(getattr(cfg.policy, self.section).enabled)

    def missing(self, cfg: NovaRLConfig) -> tuple[list[str], list[str]]:
        """(what it needs that is not installed, what it needs of a GPU host that this one lacks)."""
        return [], []

    def parallel_sizes(self, cfg: NovaRLConfig) -> ParallelSizes:
        raise NotImplementedError

    def describe_split(self, cfg: NovaRLConfig, ranks: int, split: str) -> str:
        """The layout line's split of `ranks` ('dp 2 x tp 2 x cp 1' from the sizes, as `split`)."""
        return split

    def config_problems(self, cfg: NovaRLConfig) -> list[str]:
        """This backend's rules on the policy's config, each broken one a line."""
        return []

    def micro_batching_problems(self, section, name: str) -> list[str]:
        """Its rules on a policy-like section's micro-batching (the policy's or the critic's):
        DTensor's context parallelism applies only where `context_parallel`."""
        cp = section.dtensor_cfg.context_parallel_size
        if cp > 1 and not self.context_parallel:
            return [f"policy.dtensor_cfg.context_parallel_size={cp} splits sequences on the DTensor backend; "
                    f"this run trains on {name}."]
        return []

    def layout_overrides(self, layout: PlannedLayout) -> list[str]:
        """Its section's keys (dotted overrides) for the planner's layout, its enabled flag aside."""
        return []

    def resume_problem(self, saved: NovaRLConfig, cfg: NovaRLConfig) -> str | None:
        """Why a checkpoint this backend wrote under the config `saved` cannot resume under `cfg`
        (said before any rank starts), or None."""
        return None

    def checkpoint_problem(self, folder: Path, role: str, *, verify: bool = False) -> str | None:
        """What is wrong with the files it saved of one role (`folder`: step_N/policy or step_N/critic),
        or None. verify: also read, with a restriction, what loading would unpickle (after the
        manifest's checksums passed, before anything loads it)."""
        return importlib.import_module(self.checkpoint_module).files_problem(folder, role, verify=verify)

    def export_hf(self, export: HfExport) -> None:
        """Write one role of a checkpoint it saved as a Hugging Face folder, in this process."""
        importlib.import_module(self.checkpoint_module).export_hf(export)

    def role_arguments(self) -> dict:
        """Constructor arguments every role of it takes (policy, reference, critic) beyond the common ones."""
        return {}

    def trainer_arguments(self, *, accumulation_steps: int) -> dict:
        """Constructor arguments its trained roles (policy, critic) take beyond those."""
        return {}

    def emulated(self) -> bool:
        """Runs emulated on the CPU, which changes torch process-wide: its ranks never share the driver."""
        return False

    def host_options(self, cfg: NovaRLConfig) -> list[str]:
        """What the config asks of this backend that GPU hosts have and this one lacks."""
        return []

    def check_model(self, cfg: NovaRLConfig, model_path: str, *, shape_only: bool = False) -> None:
        """What its config asks of the model, checked before any rank starts (UserError). shape_only:
        what config.json alone decides (this host cannot run the backend: what it builds on this host
        would fail for that reason, already said)."""

    def classes(self) -> tuple[type, type]:
        return load(self.policy_class), load(self.reference_class)

    def critic(self) -> type:
        return load(self.critic_class)


class GenerationSpec:
    """A generation backend. Subclasses set the class attributes and override what differs."""

    name: str
    title: str
    """Its name in sentences ('vLLM')."""
    engine_class: str | None = None
    """'module:Class' of an Engine of its own (in a policy rank, an actor, or the driver)."""
    on_policy_ranks_class: str | None = None
    """'module:Class' of a GenerationBackend sampling with the policy's own model on its ranks."""
    takes_adapters = False
    """Takes LoRA adapters at each sync (policy.generation.lora_sync: adapter)."""
    fp8 = False
    """Runs policy.generation.vllm_cfg.precision 'fp8'."""
    vllm_cfg_read: frozenset[str] | None = frozenset()
    """The policy.generation.vllm_cfg keys it reads (None: all of them)."""
    vllm_cfg_note = ""
    """Why it reads no more of them, for the line that says which went unused."""
    continuous_batching = False
    """Its engine takes requests while it generates (protocols.ContinuousEngine), so that episodes play
    their turns each on its own (policy.generation.vllm_cfg.async_engine)."""
    on_training_weights = False
    """Samples with the training weights (no copy of its own, no weight transfer)."""
    tensor_parallel_key: str | None = None
    """The dotted key of its engines' tensor-parallel size."""
    refuses_long_sequences = False
    """Refuses a sequence length past the model's max_position_embeddings (others warn)."""

    def missing(self, cfg: NovaRLConfig) -> list[str]:
        """What it needs that is not installed."""
        return []

    def on_policy_ranks_arguments(self, cfg: NovaRLConfig) -> dict:
        """Its on_policy_ranks_class's constructor arguments beyond the policy, the tokenizer and
        max_seq_length."""
        return {}

    def engine_sizes(self, cfg: NovaRLConfig) -> tuple[int, int]:
        """(tensor-parallel, pipeline-parallel) size of one of its engines: the devices it spans."""
        return 1, 1

    def layout_overrides(self, tensor_parallel_size: int) -> list[str]:
        """Its keys (dotted overrides) for engines of the planner's tensor-parallel size."""
        return [f"{self.tensor_parallel_key}={tensor_parallel_size}"] if self.tensor_parallel_key else []

    def cannot_run(self, model_config: Mapping[str, Any], *, on_gpu: bool) -> str | None:
        """Why it cannot generate for the model (its config.json) on this host, or None."""
        return None

    def config_problems(self, cfg: NovaRLConfig, shape: ModelShape | None) -> list[str]:
        """Its rules on policy.generation, each broken one a line."""
        return []

    def implementation(self) -> type:
        return load(self.engine_class or self.on_policy_ranks_class or "")

    def standalone_engine(self, model_path: str, tokenizer, *, precision: str, max_seq_length: int,
                          batch_size: int | None = None, trust_remote_code: bool = False):
        """An engine of its own for a model that is not the policy's (an LLM judge's), in this process
        on its first GPU, else the CPU; a UserError where the backend has no engine of its own."""
        from novarl.errors import UserError

        if self.engine_class is None:
            raise UserError(f"{self.title} generation samples with the policy's own model: it runs no engine of "
                            "its own (give 'hf' or 'vllm')")
        return self._standalone(model_path, tokenizer, precision=precision, max_seq_length=max_seq_length,
                                batch_size=batch_size, trust_remote_code=trust_remote_code)

    def _standalone(self, model_path: str, tokenizer, **kwargs):
        return self.implementation()(model_path, tokenizer, **kwargs)
