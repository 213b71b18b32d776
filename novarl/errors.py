"""Errors meant for users: one paragraph, no traceback, exit code 2.

Anything raised as a `UserError` is caught by the command line (and by
`novarl.train`'s callers if they wish) and printed as its message alone. Raise it
for bad input -- config, data, model path, reward function -- never for bugs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class UserError(Exception):
    """Bad input that the user can fix. The message names what and where."""

    exit_code = 2


class ConfigError(UserError):
    """A configuration value or key is invalid."""


class NotAvailableYet(UserError):
    """The config asks for a capability novarl does not have yet."""


class RunFailed(Exception):
    """The run stopped for a reason that is not bad input (a worker died, ...).
    The command line prints the message without a traceback and exits 1."""

    exit_code = 1


OUT_OF_MEMORY_ADVICE = (
    "lower policy.train_micro_batch_size or policy.logprob_batch_size (with sequence packing or dynamic batching, "
    "their train_mb_tokens or logprob_mb_tokens), turn on activation checkpointing "
    "(policy.dtensor_cfg, megatron_cfg or deepspeed_cfg.activation_checkpointing), give colocated vLLM a smaller "
    "share (policy.generation.vllm_cfg.gpu_memory_utilization) or Megatron generation a smaller KV buffer "
    "(policy.generation.mcore_generation_config.buffer_size_gb), or ask `novarl plan` for a layout that fits")
"""What a user can change when a run's step does not fit its GPU's memory."""


def out_of_memory_error(error: BaseException) -> BaseException | None:
    """The GPU out-of-memory error in `error`, however it came: torch's OutOfMemoryError, a CUDA or NCCL runtime
    error saying "out of memory", or one of these behind a wrapper (a raise-from, Ray's RayTaskError `.cause`,
    torch.distributed.checkpoint's CheckpointException `.failures`, a rank's WorkerDied marked `out_of_memory`);
    None if there is none. Told apart without importing torch."""
    seen: set[int] = set()
    todo: list[object] = [error]
    while todo:
        item = todo.pop()
        if isinstance(item, tuple):  # CheckpointException.failures: (the exception, its traceback)
            todo += list(item)
            continue
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        text = str(item).lower()
        if (getattr(item, "out_of_memory", False) is True
                or any(kind.__name__ == "OutOfMemoryError" and kind.__module__.startswith("torch")
                       for kind in type(item).__mro__)
                or isinstance(item, RuntimeError) and "out of memory" in text and ("cuda" in text or "nccl" in text)):
            return item
        todo += [item.__cause__, item.__context__, getattr(item, "cause", None)]
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            todo += list(failures.values())
    return None


def is_out_of_memory(error: BaseException) -> bool:
    return out_of_memory_error(error) is not None


def out_of_memory_message(error: BaseException, limit: int = 300) -> str:
    """One paragraph for a run out of GPU memory: torch's figures (its message's first sentences, up to about
    `limit` characters) and what to change."""
    found = out_of_memory_error(error) or error
    lines = [line.strip() for line in str(found).splitlines() if line.strip()]
    said = ""
    for sentence in (lines[0] if lines else type(found).__name__).split(". "):
        if said and len(said) + len(sentence) > limit:
            break
        said = f"{said}. {sentence}" if said else sentence
    return (f"out of GPU memory ({said.rstrip('.')}). To fit: {OUT_OF_MEMORY_ADVICE}. Files already written "
            "(checkpoints, logs) are kept.")


class CheckpointLoadFailed(RunFailed):
    """A checkpoint that passed its checks could not be loaded into the roles (torch, the
    backend or the data position refused it). The trainer falls back to an older one."""

    def __init__(self, path, cause: BaseException) -> None:
        lines = [line for line in str(cause).strip().splitlines() if line.strip()]
        self.path, self.cause = path, cause
        self.reason = f"{type(cause).__name__}: {lines[-1].strip()}" if lines else type(cause).__name__
        """`Type: last line of the message` (a CheckpointException's message holds whole tracebacks)."""
        super().__init__(f"Checkpoint {path} could not be loaded ({self.reason}).")


@contextmanager
def loading_checkpoint(checkpoint) -> Iterator[None]:
    """Turn a failure to read `checkpoint` (it passed the checks, yet torch or the backend refused it)
    into a UserError naming it."""
    try:
        yield
    except BaseException as err:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit, UserError)):
            raise
        reason = CheckpointLoadFailed(checkpoint, err).reason
        raise UserError(f"'{checkpoint}' could not be loaded ({reason}); it passed the manifest's "
                        "checks, so it was written so or this environment cannot read it (another torch "
                        "or backend version?).") from err
