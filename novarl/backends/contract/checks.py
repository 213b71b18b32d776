"""The checks of a config that need neither torch nor the model's weights.

`check_config` runs every one of them and keeps going after a failure, so that
`novarl validate` (and `novarl train`, before it starts anything) names every
reason a run cannot start in one message. It reads the model's config.json when
the model is bundled, a local folder or in the local Hugging Face cache, and never
touches the network: a hub id that is not cached is noted ("train downloads it"),
and the checks that need its files (tokenizer, data lengths, the reward's trial
call, Megatron's model constraints) run when it is there (trainer/setup.py).

Problems come in two kinds: those that stop the run anywhere, and those a GPU host
does not have (`gpu_only`: CUDA for Megatron, engines spanning several devices,
Transformer Engine's kernels). A config with only the second kind is valid for a
GPU host; `validate` says so in one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from novarl.config.schema import NovaRLConfig
from novarl.data.checks import data_problems
from novarl.errors import NotAvailableYet, UserError
from novarl.backends.registry import TRAINING_BACKENDS, training_spec
from novarl.backends.contract.resolve import BackendChoice, BatchPlan, check_available, plan_batches, resolve_backends


@dataclass
class ConfigReport:
    """What check_config found."""

    choice: BackendChoice | None = None
    batches: BatchPlan | None = None
    model_path: str | None = None
    """The model's local folder (bundled, a folder, or a complete cached snapshot); None when
    it must be downloaded (or cannot be found: see problems)."""
    model_config_dir: str | None = None
    """A folder holding the model's config.json (also a cached snapshot without weights)."""
    problems: list[UserError] = field(default_factory=list)
    """Each stops the run on any host."""
    gpu_only: list[str] = field(default_factory=list)
    """What this host lacks and a GPU host has: each stops the run here."""
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def attempt(self, check, *args, **kwargs):
        """check(*args, **kwargs), with a UserError kept in problems (and None returned)."""
        try:
            return check(*args, **kwargs)
        except UserError as err:
            self.problems.append(err)
            return None

    def needs_gpu(self) -> str | None:
        """One line: what only a GPU host has, or None."""
        if not self.gpu_only:
            return None
        return ("valid for a GPU host; this host has no CUDA GPU, so `novarl train` would stop here. It needs: "
                + "; ".join(self.gpu_only))


def check_config(cfg: NovaRLConfig) -> ConfigReport:
    """Every check of `cfg` that needs no torch and no weights (see the module docstring)."""
    report = ConfigReport(warnings=list(cfg.load_warnings), notes=list(cfg.load_notes))
    report.attempt(locate, cfg, report)
    report.choice = report.attempt(resolve_backends, cfg)
    if report.choice is not None:
        report.notes.extend(report.choice.notes)
        availability = check_available(cfg, report.choice)
        report.warnings.extend(availability.warnings)
        report.gpu_only.extend(availability.gpu_only)
        report.problems.extend(NotAvailableYet(f"this config needs what novarl does not have yet: {m}")
                               for m in availability.missing if m not in availability.gpu_only)
        if report.choice.training in TRAINING_BACKENDS:
            report.gpu_only.extend(training_spec(report.choice.training).host_options(cfg))
    report.batches = report.attempt(plan_batches, cfg)
    report.attempt(check_output_dirs, cfg)
    report.attempt(check_reward_packages, cfg)
    devices, nodes = cfg.reward.held_devices()
    if nodes:
        held = f"{devices} of the node's {cfg.cluster.gpus_per_node} device(s)" if cfg.cluster.num_nodes == 1 else \
            f"{nodes} of the cluster's {cfg.cluster.num_nodes} node(s)"
        report.notes.append(f"the model-based rewards hold {held} of their own (reward.reward_model / reward.judge "
                            "resources): the policy and generation get the rest")
    from novarl.logging.trackers import missing_packages

    report.problems.extend(UserError(line + ".") for line in missing_packages(cfg.logger))
    problems, notes = data_problems(cfg.data)
    report.problems.extend(problems)
    report.notes.extend(notes)
    return report


def check_reward_packages(cfg: NovaRLConfig) -> None:
    """A registered reward that needs a package (math_verify: math-verify) finds it. (A reward
    from the user's own module is imported, and tried once, by `novarl train`'s pre-flight.)"""
    from novarl.rewards.registry import NEEDS, import_reward_fn

    functions = cfg.reward.function if isinstance(cfg.reward.function, list) else [cfg.reward.function]
    for name in functions:
        if name in NEEDS:
            import_reward_fn(name)


def locate(cfg: NovaRLConfig, report: ConfigReport) -> None:
    """The model's local folder, without the network: sets report.model_path (weights here)
    and report.model_config_dir (config.json here), or notes that train downloads it."""
    from novarl.models.locate import _has_safetensors_weights, hub_offline, resolve_model_path

    name = cfg.policy.model_name
    found = resolve_model_path(name, download=False)
    folder = Path(found)
    if not (folder / "config.json").is_file():
        if hub_offline():  # train cannot download it: the error train gives, listed with the data's
            resolve_model_path(name)
        report.notes.append(f"policy.model_name='{name}' is not in the local Hugging Face cache: `novarl train` "
                            "downloads it, and checks its tokenizer, the data's lengths and the reward then")
        return
    report.model_config_dir = found
    if found != name and not _has_safetensors_weights(folder):  # a cached snapshot with config.json only
        report.notes.append(f"policy.model_name='{name}': only config.json is in the local cache; `novarl train` "
                            "downloads the weights")
        return
    report.model_path = found


def check_output_dirs(cfg: NovaRLConfig) -> None:
    """logger.log_dir, and checkpointing.checkpoint_dir when checkpointing, can be made: no file
    where a folder must go, the nearest existing folder writable, no name the file system
    refuses. Creates nothing (validate writes nothing)."""
    folders = [("logger.log_dir", cfg.logger.log_dir)]
    if cfg.checkpointing.enabled:
        folders.append(("checkpointing.checkpoint_dir", cfg.checkpointing.checkpoint_dir))
    for key, folder in folders:
        try:
            existing = Path(folder).expanduser().absolute()
            while not existing.exists():
                existing = existing.parent
            if not existing.is_dir():
                raise UserError(f"{key}='{folder}': {existing} is a file, so the folder cannot be made there.")
            if not os.access(existing, os.W_OK | os.X_OK):
                raise UserError(f"{key}='{folder}': {existing} is not writable by this user.")
        except (OSError, ValueError) as err:
            raise UserError(f"{key}='{folder}': the folder cannot be made "
                            f"({getattr(err, 'strerror', None) or err}).") from None


def one_error(problems: list[UserError]) -> UserError | None:
    """The problems as one error: the only one as it is, several listed (the first's class,
    so that the exit code stays that of the first); one found by two checks is said once."""
    unique: dict[str, UserError] = {}
    for problem in problems:
        unique.setdefault(str(problem), problem)
    problems = list(unique.values())
    if not problems:
        return None
    if len(problems) == 1:
        return problems[0]
    lines = "\n".join(f"  - {p}".replace("\n", "\n    ") for p in problems)
    return type(problems[0])(f"{len(problems)} problems stop this run:\n{lines}")


__all__ = ["ConfigReport", "check_config", "check_output_dirs", "one_error"]
