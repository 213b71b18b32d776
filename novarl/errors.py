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
    "lower policy.train_micro_batch_size or policy.logprob_batch_size (with sequence packing, "
    "policy.sequence_packing.train_mb_tokens or logprob_mb_tokens), turn on "
    "policy.dtensor_cfg.activation_checkpointing, give colocated vLLM a smaller share "
    "(policy.generation.vllm_cfg.gpu_memory_utilization), or ask `novarl plan` for a layout that fits")
"""What a user can change when a run's step does not fit its GPU's memory."""


def is_out_of_memory(error: BaseException) -> bool:
    """torch's CUDA out-of-memory error (torch.OutOfMemoryError), told apart without importing torch."""
    return any(kind.__name__ == "OutOfMemoryError" and kind.__module__.startswith("torch")
               for kind in type(error).__mro__)


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
