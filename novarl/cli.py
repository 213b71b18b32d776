"""The `novarl` command: train | validate | plan | eval | convert.

    novarl train                                   # the bundled default (tiny model, arithmetic)
    novarl train -c recipe.yaml policy.precision=bfloat16 grpo.max_num_steps=100
    novarl validate recipe.yaml                    # check a config, start nothing (-c recipe.yaml is the same)
    novarl plan recipe.yaml                        # which backends would run, and the batch arithmetic
    novarl plan --model 7.5B cluster.gpus_per_node=8 [--json]   # which layouts fit, ranked, and why
    novarl eval runs/tiny_arith/exp_001/policy     # held-out greedy accuracy of a model folder (the run's config)
    novarl convert results/grpo out/hf_model       # the newest checkpoint (or a step_N folder) as a HF folder
    python -m novarl ...                           # the same; novarl --version

Bad input ends with a one-paragraph message on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from novarl.config.loading import BUNDLED_RECIPE
from novarl.errors import RunFailed, UserError, is_out_of_memory, out_of_memory_message
from novarl.logging.quiet import quiet_third_party



def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        quiet_third_party()
        take_positional_config(args)
        return args.run(args)
    except (UserError, RunFailed) as err:
        print(f"novarl: error: {err}", file=sys.stderr)
        return err.exit_code
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        print(f"novarl: error: {out_of_memory_message(err)}", file=sys.stderr)
        return RunFailed.exit_code
    except KeyboardInterrupt:
        print("novarl: interrupted", file=sys.stderr)
        return 130


class _Parser(argparse.ArgumentParser):
    """argparse, with its refusals (a missing argument, a bad number) raised as UserError, so
    they end like every other bad input: `novarl: error: ...`, exit code 2."""

    def error(self, message: str):
        raise UserError(f"{message[:1].upper()}{message[1:]} (`{self.prog} --help` lists the arguments).")


def positive_finite(text: str) -> float:
    """An argparse type: a finite number above 0 (float() also takes 'nan', 'inf', '-1')."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from novarl import __version__

    parser = _Parser(prog="novarl", description="RL post-training of language models.")
    parser.add_argument("--version", action="version", version=f"novarl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, run, helptext in (("train", cmd_train, "run GRPO"),
                                ("validate", cmd_validate, "check a config and print it resolved"),
                                ("plan", cmd_plan, "which backends a config runs on, and its batch arithmetic")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("-c", "--config", type=Path, default=None,
                       help=f"YAML config (default: the bundled {BUNDLED_RECIPE.name} for a bundled model, "
                            "NeMo RL's grpo_math_1B sizes for policy.model_name=<any other>)")
        p.add_argument("--preset", default=None, metavar="NAME",
                       help="a training-strategy preset merged over the config, under the overrides: "
                            "fsdp, zero2, zero3, zero3-offload (see novarl/core/distributed.py)")
        p.add_argument("overrides", nargs="*", metavar="key.path=value",
                       help="dotted overrides; the first may be the YAML config instead of -c (CONFIG.yaml)")
        p.set_defaults(run=run)
        if name == "plan":
            p.add_argument("--model", default=None, metavar="NAME_OR_PATH_OR_COUNT",
                           help="plan layouts for this model: a local Hugging Face folder, a bundled name "
                                "(tiny-arith), a hub id with config.json cached, or a count such as 7.5B "
                                "(default: the config's policy.model_name)")
            p.add_argument("--gpu-memory-gb", type=positive_finite, default=80.0,
                           help="memory of one GPU in GB (1e9 bytes; default 80)")
            p.add_argument("--json", action="store_true", help="print the layout advice as JSON only")
        if name == "train":
            resume = p.add_mutually_exclusive_group()
            resume.add_argument("--resume", dest="resume", action="store_true", default=None,
                                help="continue from the newest checkpoint (default: if there is one)")
            resume.add_argument("--no-resume", dest="resume", action="store_false",
                                help="refuse to start if checkpoint_dir already holds checkpoints")
    p = sub.add_parser("convert", help="export a checkpoint (checkpoint_dir/step_N) as a Hugging Face folder")
    p.add_argument("checkpoint", type=Path,
                   help="a step_N folder written by checkpointing, or checkpoint_dir itself (its newest complete step)")
    p.add_argument("output", type=Path, help="the Hugging Face folder to write")
    p.add_argument("--critic", action="store_true",
                   help="export PPO's critic (a token-classification folder with one label) instead of the policy")
    p.set_defaults(run=cmd_convert)
    p = sub.add_parser("eval", help="held-out accuracy of a model folder (greedy, or the config's "
                                   "grpo.val_num_generations_per_prompt samples a prompt)")
    p.add_argument("model", help="model folder, hub id, or bundled name")
    p.add_argument("-c", "--config", type=Path, default=None,
                   help="config giving data and reward (default: RUN/config.yaml for a RUN/policy folder, "
                        "else the bundled recipe)")
    p.add_argument("overrides", nargs="*", metavar="key.path=value")
    p.set_defaults(run=cmd_eval)
    return parser


def take_positional_config(args: argparse.Namespace) -> None:
    """`novarl plan CONFIG.yaml` is `novarl plan -c CONFIG.yaml`: a first positional argument
    that ends in .yaml or .yml and has no '=' is the config, not an override."""
    overrides = getattr(args, "overrides", None)
    if not overrides or "=" in overrides[0] or not overrides[0].endswith((".yaml", ".yml")):
        return
    if args.config is not None:
        raise UserError(f"Two configs given: -c {args.config} and '{overrides[0]}'. Give one, either as "
                        "the first argument after the command or with -c, not both.")
    args.config, args.overrides = Path(overrides[0]), overrides[1:]


def _config(args: argparse.Namespace):
    from novarl.config import load_config
    from novarl.core.distributed import get_preset

    preset = get_preset(args.preset) if getattr(args, "preset", None) else {}
    if args.config is None:  # the recipe for the model named (bundled: the tiny one), fitted to this host
        from novarl.trainer.starting import load_starting_config

        return load_starting_config(preset, args.overrides)
    return load_config(args.config, overrides=args.overrides, **preset)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = _config(args)  # first: a config's errors are said before torch loads (~1-2 s)
    from novarl.trainer.api import GRPOTrainer
    from novarl.trainer.evaluate import evaluation_sampling

    result = GRPOTrainer(cfg).train(resume=args.resume)
    before, after = result.initial_accuracy, result.final_accuracy
    steps = f"{result.steps} steps" if not result.stopped_early else \
        f"{result.steps} of {cfg.grpo.max_num_steps} steps: stopped on {result.stopped_by}"
    accuracy = evaluation_sampling(cfg).accuracy_name
    print(f"{result.accuracy_source} {accuracy}: before {_pct(before)} -> after {_pct(after)} ({steps})")
    print(f"output folder: {result.output_dir}")
    print(f"policy (Hugging Face folder): {result.model_dir}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """The checks `novarl train` makes before it starts anything (the same functions:
    backends/contract/checks.py, then trainer.setup.inspect_inputs when the model's files are here), all of
    them, then the resolved config. Starts no worker, loads no weights; imports no torch when
    the model is not local. Exit 2 naming every problem; exit 0 with one line when only a GPU
    host can run it."""
    from novarl.config import dump_config
    from novarl.plan.auto import apply_auto
    from novarl.backends.contract.checks import check_config, one_error

    cfg, why = apply_auto(_config(args))
    report = check_config(cfg)
    inputs = None
    if report.model_path is not None:  # (what a GPU host has is not needed to read the data and reward)
        from novarl.trainer.setup import inspect_inputs

        inputs = inspect_inputs(cfg, report, report.model_path)
    error = one_error(report.problems)
    if error is not None:
        raise error
    print(dump_config(cfg), end="")
    for line in why:
        print(f"# {line}")
    print(f"# valid. {report.choice.describe()}; {report.batches.describe()}")
    notes, warnings = (inputs.notes, inputs.warnings) if inputs else (report.notes, report.warnings)
    for line in (*(f"note: {n}" for n in notes), *(f"warning: {w}" for w in warnings)):
        print(f"# {line}")
    if report.needs_gpu():
        print(f"# {report.needs_gpu()}")
    if inputs is not None:
        print(f"# {inputs.summary}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Backends and batch arithmetic of the config (unless only --model is given),
    then the layout advice for its model, cluster and workload, and the model-based rewards'
    sizes. Exit 2 when the config needs what is not built yet, or a reward model does not fit."""
    import dataclasses
    import json

    from novarl.config import load_config
    from novarl.plan.table import format_advice
    from novarl.plan.auto import apply_auto
    from novarl.plan.rewards import reward_model_fits
    from novarl.backends.contract.resolve import check_available, describe_layout, plan_batches, resolve_backends

    model_only = args.model is not None and args.config is None
    # With only --model, the workload comes from the schema defaults (and the overrides,
    # e.g. cluster.gpus_per_node=8), not from the bundled tiny recipe.
    cfg = load_config(None, overrides=args.overrides) if model_only else _config(args)
    exit_code = 0
    if not model_only:
        cfg, why = apply_auto(cfg)
        choice = resolve_backends(cfg)
        availability = check_available(cfg, choice)
        exit_code = 0 if set(availability.missing) <= set(availability.gpu_only) else 2
        if not args.json:
            for line in why:
                print(line)
            print(choice.describe())
            for note in (*cfg.load_notes, *choice.notes):
                print(f"note: {note}")
            print(plan_batches(cfg).describe())
            print(describe_layout(cfg, choice.training))
            for item in availability.missing:
                print(f"{'needs a GPU host' if item in availability.gpu_only else 'not available yet'}: {item}")
            length_warnings, refused = _sequence_length_check(cfg, choice)
            if refused:
                print(f"not runnable: {refused}")
                exit_code = 2
            for item in (*cfg.load_warnings, *availability.warnings, *length_warnings):
                print(f"warning: {item}")
    advice, skipped = _layout_advice(args, cfg)
    rewards = [] if model_only or cfg.cluster.gpus_per_node < 1 else reward_model_fits(cfg, args.gpu_memory_gb)
    if args.json:
        print(json.dumps({**(advice.to_dict() if advice else {"skipped": skipped}),
                          **({"rewards": [dataclasses.asdict(fit) for fit in rewards]} if rewards else {})}, indent=2))
    else:
        print(f"\n{format_advice(advice)}" if advice else f"layout advice skipped: {skipped}")
        for fit in rewards:
            print(fit.describe(args.gpu_memory_gb))
    return exit_code if all(fit.fits is not False for fit in rewards) else max(exit_code, 2)


def _sequence_length_check(cfg, choice) -> tuple[list[str], str | None]:
    """validate's check of the sequence length against the model's positions, where its config.json
    is here without downloading: (warnings, the refusal or None)."""
    from novarl.models.loading import resolve_model_path
    from novarl.trainer.setup import check_sequence_length

    try:
        path = resolve_model_path(cfg.policy.model_name, download=False)
    except UserError:
        return [], None  # not here: the advice below says so
    warnings: list[str] = []
    try:
        check_sequence_length(cfg, path, choice, warnings)
    except UserError as err:
        return warnings, str(err)
    return warnings, None


def _layout_advice(args: argparse.Namespace, cfg):
    """(the advisor's layouts for the model over the devices the policy gets, None), or (None, why it
    was skipped)."""
    from novarl.models.loading import resolve_model_path
    from novarl.models.scores import training_precision
    from novarl.plan.advisor import advise
    from novarl.plan.rewards import policy_cluster
    from novarl.backends.contract.model_shape import ModelShape, parse_parameter_count
    from novarl.backends.contract.resolve import micro_batch_shape, separate_reference

    name = args.model or cfg.policy.model_name
    try:
        try:
            shape = ModelShape.from_parameter_count(parse_parameter_count(name))
        except UserError:  # not a count: a bundled name, a folder or a cached hub id
            shape = ModelShape.from_name(resolve_model_path(name, download=False),
                                         overrides=None if args.model else cfg.policy.hf_config_overrides)
    except UserError as err:
        if args.model is not None:
            raise
        return None, f"the shape of policy.model_name='{name}' is not known without downloading ({err})"
    if cfg.cluster.gpus_per_node < 1:
        return None, "cluster.gpus_per_node=0 (CPU ranks): the advisor plans GPU memory"
    per_node, nodes = policy_cluster(cfg)  # less the model-based rewards' own devices
    return advise(shape, gpus_per_node=per_node, num_nodes=nodes, gpu_memory_gb=args.gpu_memory_gb,
                  **micro_batch_shape(cfg.policy), precision=training_precision(cfg.policy.precision, on_gpu=True),
                  with_reference=separate_reference(cfg), with_critic=cfg.value is not None), None


def cmd_convert(args: argparse.Namespace) -> int:
    from novarl.trainer.export import export_checkpoint, find_checkpoint

    step = find_checkpoint(args.checkpoint)
    if step != args.checkpoint:
        print(f"converting {step}: the newest complete checkpoint in {args.checkpoint}")
    export_checkpoint(step, args.output, critic=args.critic)
    print(f"wrote {args.output}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from novarl.distributed.local import default_device
    from novarl.trainer.evaluate import evaluate, evaluation_sampling
    from novarl.trainer.setup import prepare_eval

    refuse_checkpoint_as_model(args.model)
    cfg = eval_config(args)
    inputs = prepare_eval(cfg, args.model, default_device())
    how = evaluation_sampling(cfg)  # the config's grpo.val_num_generations_per_prompt: greedy for 1
    result = evaluate(inputs.generator, inputs.prompts, inputs.scorer, how, batch_size=cfg.grpo.val_batch_size,
                      episodes=inputs.episodes)
    k = how.num_generations_per_prompt
    which = f"held-out {how.accuracy_name}" if inputs.val_source == "held-out" else \
        f"{how.accuracy_name} (on training prompts: the data has no held-out split)"
    pass_k = f", pass@{k} {_pct(result['pass_k'])}" if k > 1 else ""
    episodes = f", {result['episode_turns_mean']:.1f} turns an episode" if inputs.episodes is not None else ""
    print(f"{which} of {args.model}: {_pct(result['accuracy'])}{pass_k} on {len(inputs.prompts)} prompts{episodes}")
    return 0


def eval_config(args: argparse.Namespace):
    """The config `novarl eval MODEL` runs on: -c CONFIG with the overrides; else the run's own
    config.yaml when MODEL is a run's policy folder; else the recipe for MODEL itself, as `novarl
    train policy.model_name=MODEL` starts from (the bundled one for a bundled model, NeMo RL's
    grpo_math_1B sizes for any other, fitted to this host: trainer/starting.py), the overrides on top."""
    from novarl.config import load_config
    from novarl.trainer.starting import load_starting_config
    from novarl.logging.console import info

    if args.config is not None:
        return _config(args)
    run_config = run_config_of(args.model)
    if run_config is None:
        return load_starting_config({"model_name": args.model}, args.overrides)
    info(f"using the run's own config {run_config} (data, reward, generation); -c CONFIG uses another")
    return load_config(run_config, overrides=args.overrides)


def run_config_of(model: str) -> Path | None:
    """The config.yaml of the run whose final policy `model` is (RUN/policy), or None."""
    folder = Path(model).expanduser()
    config = folder.parent / "config.yaml"
    return config if folder.name == "policy" and folder.is_dir() and config.is_file() else None


def refuse_checkpoint_as_model(model: str) -> None:
    """A checkpoint (step_N, or its policy/ shards) is not a Hugging Face folder: say how to make one."""
    from novarl.trainer.checkpoint import POLICY_DIR, STATE_FILE

    folder = Path(model).expanduser()
    if (folder / STATE_FILE).is_file():
        step = folder
    elif folder.name == POLICY_DIR and (folder.parent / STATE_FILE).is_file():
        step = folder.parent
    else:
        return
    raise UserError(f"'{model}' is a training checkpoint, not a Hugging Face model folder. Convert it "
                    f"first: `novarl convert {step} OUT`, then `novarl eval OUT`.")


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


if __name__ == "__main__":
    sys.exit(main())
