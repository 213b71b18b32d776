"""The host's time in a training step of novarl's DTensor policy on one device: FSDP2's unit layouts, the
plain module novarl runs there (one_device.py), and a plain PyTorch loop; and of its Megatron-core policy.

    python benchmarks/bench_host_overhead.py [--steps 20] [--rounds 3] [--sections float32 bfloat16 megatron]
                                             [--out FILE]

On a GPU the host queues a step's kernels ahead of the device; where its own time per layer (Python, autograd,
FSDP2's hooks) comes near the kernels' time, the GPU waits for it (issue 35: 26 % of the profiled H100 step of
`fixed-compile` had no kernel running). This measures that host time where it can be seen alone: on the CPU,
with a model of Qwen2.5-1.5B's depth (28 decoder layers) and a width so small that its arithmetic is a few
percent of the step. One step = a logprob pass + forward/backward over 2 micro-batches + the optimizer step, as
in bench_train_gpu.py, on one rank; in float32 (the host's work alone) and in bfloat16 (a GPU's path: bf16
copies of the float32 weights; its CPU kernels are slower, so its step is more arithmetic).

Layouts, side by side in one process (rounds interleaved, each layout's median step of each round):
- `per-layer units`: each decoder layer its own FSDP2 unit (one gather, one gradient reduction and one set of
  hooks a layer), as novarl sharded before;
- `kept runs`: consecutive layers in one unit up to KEPT_UNIT_PARAMETERS (parallelize.py fsdp_units; here all 28,
  the layers being tiny): novarl's FSDP2 layout where the gathered weights are kept (a data-parallel shard of one
  in a tensor- or context-parallel mesh);
- `one device`: no FSDP2 (one_device.py: bf16 copies made for each pass, their gradients added to the float32
  parameters' by a hook each), what novarl runs on one device;
- `plain loop`: bf16 weights, full log-softmax, fused AdamW, no novarl (bench_train_gpu.py's reference);
each eager and with compiled decoder layers. (With a torch whose FSDP2 does not group modules fully, before 2.13,
both FSDP2 layouts are a unit a layer: the table's unit counts say so.) The `megatron` section puts the Megatron
backend's step (eager, compiled) beside one device's, in processes of their own (measure_megatron); the
`deepspeed` section DeepSpeed ZeRO-2's (eager, compiled layers) beside one device's (measure_deepspeed); the
`tensor-parallel` section the step on 2 ranks with tp 2, torch's DTensor styles beside local tensors
(measure_tensor_parallel). Each section replaces its own in benchmarks/results/host_overhead_cpu.md (or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=28, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
LAYOUTS = ("per-layer units", "kept runs", "one device", "plain loop")


def save_model(folder: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                                 pad_token_id=0)).save_pretrained(folder)


def build(folder: Path, layout: str, compiled: bool, precision: str):
    from novarl.backends.training import dtensor, parallelize

    kept_runs, one_device = parallelize.fsdp_units, dtensor.one_device
    parallelize.fsdp_units = kept_runs if layout == "kept runs" else lambda layers, keep: [[x] for x in layers]
    dtensor.one_device = one_device if layout == "one device" else lambda *args: False
    try:
        from novarl.config import load_config

        cfg = load_config(None, overrides=[
            f"policy.model_name={folder}", "policy.max_seq_length=64", "policy.train_micro_batch_size=4",
            "policy.logprob_batch_size=4", "policy.scheduler=[]", "policy.optimizer.kwargs.lr=1e-6",
            f"policy.precision={precision}", f"policy.dtensor_cfg.torch_compile={str(compiled).lower()}"])
        return dtensor.DTensorPolicy(cfg.policy, str(folder), total_steps=1_000)
    finally:
        parallelize.fsdp_units, dtensor.one_device = kept_runs, one_device


def plain_step(folder: Path, compiled: bool, precision: str):
    """bench_train_gpu.py's plain loop on make_step's batch: weights in `precision`, each decoder layer compiled
    if `compiled`, full log-softmax, fused AdamW."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_train_gpu import plain_step as one_step

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, precision), attn_implementation="sdpa")
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids = torch.randint(3, SHAPE["vocab_size"], (8, 48), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    return lambda: one_step(model, optimizer, ids, mask, 4, [None])


def make_step(policy):
    import torch

    from novarl.algorithms.losses import make_loss
    from novarl.config.schema import LossConfig
    from novarl.models.scores import Logprobs
    from novarl.types import TrainBatch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, SHAPE["vocab_size"], (8, 48), generator=generator)
    mask = torch.ones_like(ids, dtype=torch.bool)
    batch = TrainBatch.from_rows(ids, mask, mask & (torch.arange(48) >= 8), torch.randn(8, generator=generator))
    loss, head = make_loss(LossConfig()), Logprobs(1.0)

    def step() -> None:
        batch.old_logprobs = policy.forward(batch, head)
        policy.forward_backward(batch, loss, head)
        policy.optim_step()

    return step


def measure(steps: int, rounds: int, precision: str) -> dict:
    """{"times": {f"{layout}, {eager|compiled}": [median seconds of each round]}, "modules": {the same: the FSDP2
    units (gathered together) its model has, the root's included}}."""
    from torch.distributed.fsdp import FSDPModule

    set_up()
    units: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp))
        cases = {}
        for compiled in (False, True):
            for layout in LAYOUTS:
                name = f"{layout}, {'compiled' if compiled else 'eager'}"
                if layout == "plain loop":
                    cases[name], units[name] = plain_step(Path(tmp), compiled, precision), 0
                else:
                    policy = build(Path(tmp), layout, compiled, precision)
                    units[name] = len({id(m._get_fsdp_state()) for m in policy.model.modules()
                                       if isinstance(m, FSDPModule)})
                    cases[name] = make_step(policy)
                warm_up(cases[name], compiled)
        return {"times": timed_rounds(cases, steps, rounds), "modules": units}


def set_up() -> None:
    import torch

    from novarl.distributed.local import ensure_single_process_group

    torch.set_num_threads(1)
    # every layout's compiled layers share the decoder layer's code: its graphs (grad and no-grad, float32 and
    # bfloat16, four layouts) over dynamo's default of 8 would run the later cases eager
    torch._dynamo.config.recompile_limit = 64
    ensure_single_process_group()


def warm_up(step, compiled: bool) -> None:
    for _ in range(3 if compiled else 1):  # (compiling)
        step()


def timed_rounds(cases: dict, steps: int, rounds: int) -> dict[str, list[float]]:
    """{case: the median seconds of its steps in each round}, rounds interleaved across the cases."""
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, step in cases.items():
            seconds = []
            for _ in range(steps):
                tic = time.perf_counter()
                step()
                seconds.append(time.perf_counter() - tic)
            times.setdefault(name, []).append(statistics.median(seconds))
    return times


MEGATRON_CASES = ("one device, eager", "one device, compiled", "megatron, eager", "megatron, compiled")


def measure_megatron(steps: int, rounds: int) -> dict:
    """Megatron-core's step beside the DTensor one-device step, float32, in processes of their own (megatron-core
    runs on the CPU by an emulation of CUDA that intercepts every torch call of its process, the one-device
    cases' too: their times carry the same tax). Two processes: `whole` (novarl's compiled Megatron layer, one
    graph) and `pieces` (the layer as it compiled before: graph breaks at megatron-core's warning, the rest of
    its attention eager). {variant: {case: [median seconds of each round]}}."""
    found = {}
    for variant in ("whole", "pieces"):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, __file__, "--megatron-child", variant, "--steps", str(steps),
                            "--rounds", str(rounds), "--out", out.name], check=True)
            found[variant] = json.loads(Path(out.name).read_text())
    return found


def megatron_child(variant: str, steps: int, rounds: int) -> dict[str, list[float]]:
    import os

    from novarl.backends.megatron import model
    from novarl.backends.training.megatron import MegatronPolicy
    from novarl.config import load_config

    set_up()
    if variant == "pieces":
        model._trace_group_lookup = lambda: None
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp) / "model")
        os.environ["NOVARL_MEGATRON_CHECKPOINT_DIR"] = str(Path(tmp) / "megatron")
        cases = {}
        for compiled in (False, True):  # Megatron first: its policy installs the emulation
            cfg = load_config(None, overrides=[
                f"policy.model_name={tmp}/model", "policy.max_seq_length=64", "policy.train_micro_batch_size=4",
                "policy.logprob_batch_size=4", "policy.precision=float32", "policy.megatron_cfg.enabled=true",
                "policy.megatron_cfg.optimizer.lr=1e-6", "policy.megatron_cfg.optimizer.clip_grad=1.0",
                f"policy.megatron_cfg.torch_compile={str(compiled).lower()}"])
            name = f"megatron, {'compiled' if compiled else 'eager'}"
            cases[name] = make_step(MegatronPolicy(cfg.policy, f"{tmp}/model", total_steps=1_000, emulate_cuda=True))
            warm_up(cases[name], compiled)
        for compiled in (False, True):
            name = f"one device, {'compiled' if compiled else 'eager'}"
            cases[name] = make_step(build(Path(tmp) / "model", "one device", compiled, "float32"))
            warm_up(cases[name], compiled)
        return timed_rounds({name: cases[name] for name in MEGATRON_CASES}, steps, rounds)


DEEPSPEED_CASES = ("one device, eager", "one device, compiled", "ZeRO-2, eager", "ZeRO-2, compiled")


def measure_deepspeed(steps: int, rounds: int) -> dict[str, list[float]]:
    """DeepSpeed ZeRO-2's step (one rank, eager and with its decoder layers compiled: deepspeed_cfg.torch_compile)
    beside the DTensor backend's one device, float32, in this process: {case: [median seconds of each round]}."""
    from novarl.backends.training.deepspeed import DeepSpeedPolicy
    from novarl.config import load_config

    set_up()
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp))
        cases = {}
        for compiled in (False, True):
            cfg = load_config(None, overrides=[
                f"policy.model_name={tmp}", "policy.max_seq_length=64", "policy.train_micro_batch_size=4",
                "policy.logprob_batch_size=4", "policy.scheduler=[]", "policy.optimizer.kwargs.lr=1e-6",
                "policy.precision=float32", "policy.deepspeed_cfg.enabled=true", "policy.deepspeed_cfg.zero_stage=2",
                f"policy.deepspeed_cfg.torch_compile={str(compiled).lower()}"])
            how = "compiled" if compiled else "eager"
            cases[f"ZeRO-2, {how}"] = make_step(DeepSpeedPolicy(cfg.policy, tmp, total_steps=1_000))
            cases[f"one device, {how}"] = make_step(build(Path(tmp), "one device", compiled, "float32"))
        for name, step in cases.items():
            warm_up(step, name.endswith("compiled"))
        return timed_rounds({name: cases[name] for name in DEEPSPEED_CASES}, steps, rounds)


TENSOR_PARALLEL_CASES = ("torch's styles, eager", "local tensors, eager", "local tensors, compiled",
                         "torch's styles, LoRA, eager", "local tensors, LoRA, eager", "local tensors, LoRA, compiled")
TP_LORA = ["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.dim=8",
           "policy.dtensor_cfg.lora_cfg.use_triton=false"]
"""LoRA on every linear layer of the decoder (the adapters split with their layers)."""


def measure_tensor_parallel(steps: int, rounds: int) -> dict[str, list[float]]:
    """The DTensor policy's step on 2 gloo ranks with tensor_parallel_size=2 (the default plan, float32): on
    torch's ColwiseParallel/RowwiseParallel (as novarl ran it before local_tp.py) and on local tensors, eager and
    compiled; the same with LoRA adapters; each rank one thread, in processes of their own. {case: [rank 0's
    median seconds of each round]}."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp) / "model")
        mp.spawn(tensor_parallel_rank, args=(steps, rounds, tmp), nprocs=2)
        return json.loads((Path(tmp) / "times.json").read_text())


def tensor_parallel_rank(rank: int, steps: int, rounds: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    from novarl.backends.training import dtensor, local_tp, parallelize
    from novarl.config import load_config

    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    cases, local_plan = {}, local_tp.LOCAL_LAYER_PLAN
    for name in TENSOR_PARALLEL_CASES:
        local_tp.LOCAL_LAYER_PLAN = parallelize.LLAMA_LAYER_PLAN if name.startswith("torch") else local_plan
        compiled = name.endswith("compiled")
        cfg = load_config(None, overrides=[
            f"policy.model_name={tmp}/model", "policy.max_seq_length=64", "policy.train_micro_batch_size=4",
            "policy.logprob_batch_size=4", "policy.scheduler=[]", "policy.optimizer.kwargs.lr=1e-6",
            "policy.precision=float32", "cluster.gpus_per_node=2", "policy.dtensor_cfg.tensor_parallel_size=2",
            f"policy.dtensor_cfg.torch_compile={str(compiled).lower()}", *(TP_LORA if "LoRA" in name else [])])
        cases[name] = make_step(dtensor.DTensorPolicy(cfg.policy, f"{tmp}/model", total_steps=1_000))
        warm_up(cases[name], compiled)
    local_tp.LOCAL_LAYER_PLAN = local_plan
    times = timed_rounds(cases, steps, rounds)
    if rank == 0:
        (Path(tmp) / "times.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def tensor_parallel_report(times: dict[str, list[float]], steps: int, rounds: int) -> str:
    from benchmarks.models import cpu_name

    lines = [f"## Tensor parallelism on 2 ranks (float32, {cpu_name()}, one thread a rank)", "",
             f"{date.today()}, commit {commit_name()}: `python benchmarks/bench_host_overhead.py --steps {steps} "
             f"--rounds {rounds} --sections tensor-parallel`. The same model and step on the DTensor backend with "
             "tensor_parallel_size=2 over gloo (2 processes, rank 0's times): the default plan on torch's DTensor "
             "styles (each linear's input and output through DTensor; an all-reduce of the input gradient at each "
             "of q, k, v, gate and up) and on local tensors (backends/training/local_tp.py: one all-reduce each way "
             "per attention and per MLP); then the same with LoRA adapters (rank 8) on every linear layer, against "
             "torch's styles with them. The times hold gloo's collectives on this host's loopback; a GPU's NCCL "
             "ones differ.", "",
             "| case | step (ms) | rounds (ms) | vs torch's styles |", "|---|---|---|---|"]
    base = {lora: statistics.median(times[f"torch's styles, {lora}eager"]) for lora in ("", "LoRA, ")}
    lines += [f"| {name} | {statistics.median(r) * 1e3:.1f} | {', '.join(f'{x * 1e3:.1f}' for x in r)} | "
              f"{statistics.median(r) / base['LoRA, ' if 'LoRA' in name else '']:.2f}x |" for name, r in times.items()]
    return "\n".join(lines) + "\n"


def commit_name() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or "?"
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                      cwd=ROOT).stdout.strip():
        commit += " + uncommitted changes"
    return commit


def report(result: dict, steps: int, rounds: int, precision: str) -> str:
    from benchmarks.models import cpu_name

    lines = [f"## {precision} ({cpu_name()}, one thread)", "",
             f"{date.today()}, commit {commit_name()}: `python benchmarks/bench_host_overhead.py --steps {steps} "
             f"--rounds {rounds} --sections {precision}`. Qwen2-shaped model of 28 layers of width "
             f"{SHAPE['hidden_size']} (in float32 its arithmetic is a few percent of the step: what is measured is the "
             "host's work), one rank; a step = a logprob pass + forward/backward over 2 micro-batches of 4 x 48 "
             "tokens + AdamW (fused). Median step of each round (rounds interleaved across the layouts, on a shared "
             "machine), then the median of the rounds.", "",
             "| layout | FSDP2 units | step (ms) | rounds (ms) | vs per-layer units |", "|---|---|---|---|---|"]
    times = result["times"]
    for name, rounds_s in times.items():
        base = times[f"per-layer units, {name.split(', ')[-1]}"]
        lines.append(f"| {name} | {result['modules'][name]} | {statistics.median(rounds_s) * 1e3:.1f} | "
                     f"{', '.join(f'{s * 1e3:.1f}' for s in rounds_s)} | "
                     f"{statistics.median(rounds_s) / statistics.median(base):.2f}x |")
    return "\n".join(lines) + "\n"


MEGATRON_HEADING = "Megatron-core beside one device"


def megatron_report(found: dict, steps: int, rounds: int) -> str:
    from benchmarks.models import cpu_name

    lines = [f"## {MEGATRON_HEADING} (float32, {cpu_name()}, one thread)", "",
             f"{date.today()}, commit {commit_name()}: `python benchmarks/bench_host_overhead.py --steps {steps} "
             f"--rounds {rounds} --sections megatron`. The same model and step on megatron-core (local spec, one "
             "rank; novarl's core attention) and on the DTensor backend's one device, float32, in one process per "
             "variant: megatron-core runs on the CPU through an emulation of CUDA that intercepts every torch call "
             "of its process, so every case here carries that tax and only the ratios within a variant compare. "
             "`whole`: novarl's compiled Megatron layer, one graph; `pieces`: as it compiled before (a graph break "
             "at megatron-core's tp_group warning in each row-parallel linear, after which dynamo ran the rest of "
             "the attention eager).", "",
             "| variant | case | step (ms) | rounds (ms) | vs one device, compiled |", "|---|---|---|---|---|"]
    for variant, times in found.items():
        lines += beside_one_device(times, f"{variant} | ")
    return "\n".join(lines) + "\n"


def beside_one_device(times: dict[str, list[float]], prefix: str = "") -> list[str]:
    """A table row per case: its median step, its rounds, and its ratio to one device's compiled step."""
    base = statistics.median(times["one device, compiled"])
    return [f"| {prefix}{name} | {statistics.median(rounds_s) * 1e3:.1f} | "
            f"{', '.join(f'{x * 1e3:.1f}' for x in rounds_s)} | {statistics.median(rounds_s) / base:.2f}x |"
            for name, rounds_s in times.items()]


def deepspeed_report(times: dict[str, list[float]], steps: int, rounds: int) -> str:
    from benchmarks.models import cpu_name

    lines = [f"## DeepSpeed ZeRO-2 beside one device (float32, {cpu_name()}, one thread)", "",
             f"{date.today()}, commit {commit_name()}: `python benchmarks/bench_host_overhead.py --steps {steps} "
             f"--rounds {rounds} --sections deepspeed`. The same model and step on DeepSpeed ZeRO-2 (one rank, its "
             "engine's gradient hooks and bucketed reduction; `compiled`: policy.deepspeed_cfg.torch_compile, the "
             "decoder layers DTensor compiles) and on the DTensor backend's one device, float32, in one process, "
             "rounds interleaved.", "",
             "| case | step (ms) | rounds (ms) | vs one device, compiled |", "|---|---|---|---|"]
    return "\n".join(lines + beside_one_device(times)) + "\n"


def merged(text: str, section: str) -> str:
    """The results file's text with `section` in place of the one under the same heading (up to " ("), or
    added."""
    heading = section.split("\n", 1)[0].split(" (")[0]
    parts = text.split("\n## ")
    for i, part in enumerate(parts[1:], 1):
        if ("## " + part).split("\n", 1)[0].split(" (")[0] == heading:
            parts[i] = section.removeprefix("## ").rstrip("\n") + "\n"
            return "\n## ".join(parts)
    return text.rstrip("\n") + "\n\n" + section


SECTIONS = ("float32", "bfloat16", "megatron", "deepspeed", "tensor-parallel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="float32: the host's work alone; bfloat16: a GPU's path (copies, casts), whose CPU "
                             "kernels are slower; megatron, deepspeed: Megatron-core's and DeepSpeed ZeRO-2's step "
                             "beside one device's (float32); tensor-parallel: 2 ranks, torch's styles beside local "
                             "tensors. Each replaces its own section of --out, the others kept")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "host_overhead_cpu.md")
    parser.add_argument("--megatron-child", choices=("whole", "pieces"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.megatron_child:
        args.out.write_text(json.dumps(megatron_child(args.megatron_child, args.steps, args.rounds)))
        return
    text = args.out.read_text() if args.out.exists() else "# Host time of a training step on one device\n"
    for section in args.sections:
        if section == "megatron":
            result = measure_megatron(args.steps, args.rounds)
            text = merged(text, megatron_report(result, args.steps, args.rounds))
        elif section == "deepspeed":
            result = measure_deepspeed(args.steps, args.rounds)
            text = merged(text, deepspeed_report(result, args.steps, args.rounds))
        elif section == "tensor-parallel":
            result = measure_tensor_parallel(args.steps, args.rounds)
            text = merged(text, tensor_parallel_report(result, args.steps, args.rounds))
        else:
            result = measure(args.steps, args.rounds, section)
            text = merged(text, report(result, args.steps, args.rounds, section))
        print(json.dumps(result))
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
