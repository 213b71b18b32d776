"""Training speed on one GPU: novarl's DTensor policy against a plain PyTorch loop, in MFU.

    python benchmarks/bench_train_gpu.py [--cases plain,fixed,packed,...] [--steps 3] [--out FILE]
    python benchmarks/bench_train_gpu.py --tiny     # the same code on a tiny model (CPU or GPU)

Model: random-initialised, of Qwen2.5-1.5B's shape (28 layers, hidden 1536, MLP 8960, 12 heads,
2 KV heads, vocabulary 151,936, tied embeddings: 1.54 B parameters), saved once as safetensors.
One training step = one logprob pass over the batch (no grad) + forward/backward in
micro-batches + the optimizer step, bf16 compute. Cases: the plain loop; novarl's DTensor policy
(fixed rows or packed, with or without torch.compile); novarl's Megatron-core policy (its layer
spec without Transformer Engine); novarl's DeepSpeed ZeRO-2 policy (`zero2`, `zero2-compile`: its
decoder layers compiled as DTensor's); `<case>+<variant>` switches one fast path back off (VARIANTS).
Each case runs in a process of its own (a fresh CUDA context, its own peak memory): a warm-up
step (two with torch.compile), then --steps timed steps, the median reported.

MFU = 4 x forward FLOPs / (seconds x the device's dense bf16 peak: 989 TFLOP/s on an H100 SXM or an H200,
PEAKS), with the
forward FLOPs of a sequence of L tokens = L x 2 x parameters + 2 x layers x hidden x L^2
(causal attention); only real tokens count (padding is waste). Equal lengths: 16 sequences
x 2,048 tokens (a 256-token prompt), micro-batches of 4 sequences (8,192 tokens when packed).
Variable lengths: 64 sequences of a 256-token prompt and a completion of 124-3,840 tokens
(log-normal, seeded), packed in micro-batches of at most 8,192 tokens. The attention kernels
that ran are read from the profiler (one profiled step per case), not assumed, and so is where
that step's GPU time goes: kernels by category (matmul, attention, compiled, eager elementwise,
optimizer, copies) and the time no kernel ran.

Needs torch, transformers and pydantic (and megatron-core or deepspeed for their cases; novarl from
this checkout); no network.
Writes benchmarks/results/train_gpu_<device>.md (or --out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEAKS = (  # (words in torch's device name, dense bf16 TFLOP/s by the vendor's datasheet), the first that matches
    ("h100 pcie", 756.0), ("h100 nvl", 835.0), ("h100", 989.0), ("h200", 989.0), ("h800", 989.0), ("h20", 148.0),
    ("a100", 312.0), ("a800", 312.0), ("l40s", 362.0))
DEFAULT_PEAK = 989.0
"""Issue 35's basis (the H100 SXM's), where the device is none of PEAKS (the report says so)."""
DEVICE_NOTES = {  # words in the device name: what to keep in mind when comparing its runs with the H100's
    "h200": "an H200 has the H100's matrix and arithmetic rates (the MFU basis is the same) with 141 GB of memory at "
            "4.8 TB/s (the H100 80 GB: 3.35 TB/s): memory-bound kernels (elementwise, the optimizer, copies) run up to "
            "1.4x faster, so its MFU flatters an H100's somewhat; issue 35's targets are the H100's",
}
SHAPES = {
    "qwen2.5-1.5b": dict(vocab_size=151_936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32_768),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
}
CASES = {
    # name: (batch, layout, torch_compile, implementation)
    "plain": ("equal", "fixed", False, "plain"),
    "fixed": ("equal", "fixed", False, "novarl"),
    "packed": ("equal", "packed", False, "novarl"),
    "fixed-compile": ("equal", "fixed", True, "novarl"),
    "packed-compile": ("equal", "packed", True, "novarl"),
    "var-packed": ("variable", "packed", False, "novarl"),
    "var-packed-compile": ("variable", "packed", True, "novarl"),
    "var-fixed": ("variable", "fixed", False, "novarl"),
    "var-plain": ("variable", "fixed", False, "plain"),
    "megatron": ("equal", "fixed", False, "megatron"),
    "megatron-compile": ("equal", "fixed", True, "megatron"),
    "megatron-packed": ("equal", "packed", False, "megatron"),
    "megatron-packed-compile": ("equal", "packed", True, "megatron"),
    "var-megatron-packed": ("variable", "packed", False, "megatron"),
    "zero2": ("equal", "fixed", False, "deepspeed"),
    "zero2-compile": ("equal", "fixed", True, "deepspeed"),
}
VARIANTS = {  # "<case>+<variant>": the case with one path switched, to measure what it gives
    "eager-head": "the logprob head's chunk steps eager (not fused by torch.compile)",
    "padded-attention": "packed rows' attention as SDPA over each sequence's padded row (no varlen kernel)",
    "varlen": "packed rows' attention through the varlen kernel even where the row's pieces are all alike (as "
              "NOVARL_PACKED_ATTENTION=flash_varlen: not as padded rows side by side)",
    "fsdp2": "the model FSDP2's on the one GPU, as before novarl ran it as the plain module there "
             "(one_device.py: no FSDP2 hooks or DTensor parameters; 0.62-0.73x the host's time of a compiled step on "
             "a CPU, benchmarks/results/host_overhead_cpu.md), its layers in kept runs (parallelize.py fsdp_units)",
    "reshard": "FSDP2 (as +fsdp2), each layer's gathered weights freed after its forward and backward, as before "
               "novarl kept them through a step's micro-batches on one data-parallel shard (parallelize.py "
               "keeps_gathered)",
    "layer-units": "FSDP2 (as +fsdp2), each decoder layer its own unit where the gathered weights are kept, as "
                   "before novarl sharded kept layers in runs (parallelize.py fsdp_units; only with a torch whose "
                   "FSDP2 groups modules fully, 2.13: on an older one +fsdp2 itself)",
    "unfused-swiglu": "Megatron's SwiGLU as eager kernels (megatron_cfg.bias_activation_fusion=false), as novarl "
                      "ran it by default before it followed NeMo RL's recipes (on with CUDA)",
}
DEFAULT_CASES = (  # most wanted first: issue 35's targets and the latest change, then the experiments
    "plain,fixed-compile,fixed-compile+fsdp2,packed-compile,var-packed-compile,megatron-packed-compile,"
    "megatron-packed,zero2-compile,zero2,megatron-packed+unfused-swiglu,packed-compile+varlen,megatron-compile,"
    "fixed-compile+reshard,megatron,fixed-compile+eager-head,var-megatron-packed,packed-compile+padded-attention")
BEFORE_GB = {"fixed": 69.0, "packed": 69.7}
"""Peak memory at micro-batch 4, equal lengths, before issue 35 (its table): the bound it sets."""
ATTENTION_KERNELS = ("flash", "fmha", "attention", "cudnn", "efficient", "sdpa", "bmm")
CATEGORIES = (  # (category, words in the kernel's name), the first that matches
    ("attention", ATTENTION_KERNELS),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "splitk", "triton_tem")),
    ("compiled", ("triton",)),  # inductor's fused kernels (the compiled layers and the fused head)
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("communication", ("nccl",)),
    ("copies", ("memcpy", "memset", "copy")),
    ("eager elementwise", ()),
)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def peak_tflops(device: str) -> tuple[float, str]:
    """(dense bf16 TFLOP/s, where the figure comes from) of the device torch names `device`."""
    lowered = device.lower()
    for words, peak in PEAKS:
        if words in lowered:
            return peak, f"the {device}'s dense bf16 peak by its datasheet"
    return DEFAULT_PEAK, f"issue 35's H100 SXM figure: {device} is not in PEAKS"


def batch_lengths(kind: str, tiny: bool) -> tuple[list[int], int]:
    """(sequence lengths, prompt length) of the batch."""
    import random

    scale = 16 if tiny else 1
    if kind == "equal":
        return [2048 // scale] * 16, 256 // scale
    rng = random.Random(0)
    completions = [min(3840, max(124, round(rng.lognormvariate(math.log(700), 0.9)))) // scale for _ in range(64)]
    return [256 // scale + c for c in completions], 256 // scale


def make_batch(lengths: list[int], prompt: int, vocab: int):
    import torch

    from novarl.types import TrainBatch

    generator = torch.Generator().manual_seed(0)
    longest = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), longest), generator=generator)
    mask = torch.arange(longest) < torch.tensor(lengths)[:, None]
    loss_mask = mask & (torch.arange(longest) >= prompt)
    batch = TrainBatch.from_rows(ids, mask, loss_mask, torch.randn(len(lengths), generator=generator))
    batch.prompt_lengths = torch.full((len(lengths),), prompt)
    batch.group_ids = torch.arange(len(lengths))
    return batch


def save_model(folder: Path, shape: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, rope_theta=1_000_000.0, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return model.num_parameters()


def forward_flops(lengths: list[int], params: int, layers: int, hidden: int) -> float:
    return sum(L * 2 * params + 2 * layers * hidden * L * L for L in lengths)


def attention_work(batch, batching) -> float:
    """Attention score work the layout computes over the real tokens' (sum of L^2): a packed
    micro-batch costs its sequences' own under the varlen kernel, each padded to its longest otherwise."""
    from novarl.backends.training.batching import plan_for
    from novarl.models import attention

    lengths = batch.lengths.tolist()
    real = sum(L * L for L in lengths)
    done = 0
    for sequences in plan_for(batch, 1, batching).ranks[0]:
        chosen = [lengths[i] for i in sequences]
        if batching.layout == "packed" and attention.packed_kernel == "flash_varlen":
            done += sum(L * L for L in chosen)
        else:
            done += len(chosen) * max(chosen) ** 2
    return done / real


def novarl_policy(folder: str, layout: str, compile_layers: bool, micro: int, longest: int):
    from novarl.backends.training.dtensor import DTensorPolicy
    from novarl.config import load_config
    from novarl.distributed.local import ensure_single_process_group

    ensure_single_process_group()
    overrides = [f"policy.model_name={folder}", f"policy.max_seq_length={longest}",
                 f"policy.train_micro_batch_size={micro}", f"policy.logprob_batch_size={micro}",
                 "policy.scheduler=[]", f"policy.dtensor_cfg.torch_compile={str(compile_layers).lower()}",
                 "policy.optimizer.kwargs.lr=1e-6", "policy.max_grad_norm=1.0",
                 *packing_overrides(layout, micro, longest)]
    cfg = load_config(None, overrides=overrides)
    policy = DTensorPolicy(cfg.policy, folder, total_steps=1_000)
    return policy


def megatron_policy(folder: str, layout: str, compile_layers: bool, micro: int, longest: int):
    """novarl's Megatron-core policy on the same weights (converted once into the case's cache), bf16,
    its layer spec without Transformer Engine (SDPAttention: torch's SDPA and varlen kernels), its layers
    compiled or not (megatron_cfg.torch_compile)."""
    import torch

    from novarl.backends.training.megatron import MegatronPolicy
    from novarl.config import load_config
    from novarl.distributed.local import ensure_single_process_group

    ensure_single_process_group()
    os.environ.setdefault("NOVARL_MEGATRON_CHECKPOINT_DIR", str(Path(folder).parent / "megatron"))
    cuda = torch.cuda.is_available()
    overrides = [f"policy.model_name={folder}", f"policy.max_seq_length={longest}",
                 f"policy.train_micro_batch_size={micro}", f"policy.logprob_batch_size={micro}",
                 "policy.megatron_cfg.enabled=true", f"policy.precision={'bfloat16' if cuda else 'float32'}",
                 "policy.megatron_cfg.optimizer.lr=1e-6", "policy.megatron_cfg.optimizer.clip_grad=1.0",
                 f"policy.megatron_cfg.torch_compile={str(compile_layers).lower()}",
                 *packing_overrides(layout, micro, longest)]
    cfg = load_config(None, overrides=overrides)
    return MegatronPolicy(cfg.policy, folder, total_steps=1_000, emulate_cuda=not cuda)


def deepspeed_policy(folder: str, layout: str, compile_layers: bool, micro: int, longest: int):
    """novarl's DeepSpeed ZeRO-2 policy on one rank, bf16 on CUDA (DeepSpeed's bf16 weights, float32
    master weights in its optimizer), its decoder layers compiled or not (deepspeed_cfg.torch_compile)."""
    import torch

    from novarl.backends.training.deepspeed import DeepSpeedPolicy
    from novarl.config import load_config
    from novarl.distributed.local import ensure_single_process_group

    ensure_single_process_group()
    overrides = [f"policy.model_name={folder}", f"policy.max_seq_length={longest}",
                 f"policy.train_micro_batch_size={micro}", f"policy.logprob_batch_size={micro}",
                 "policy.scheduler=[]", "policy.deepspeed_cfg.enabled=true", "policy.deepspeed_cfg.zero_stage=2",
                 f"policy.precision={'bfloat16' if torch.cuda.is_available() else 'float32'}",
                 f"policy.deepspeed_cfg.torch_compile={str(compile_layers).lower()}",
                 "policy.optimizer.kwargs.lr=1e-6", "policy.max_grad_norm=1.0",
                 *packing_overrides(layout, micro, longest)]
    cfg = load_config(None, overrides=overrides)
    return DeepSpeedPolicy(cfg.policy, folder, total_steps=1_000)


def packing_overrides(layout: str, micro: int, longest: int) -> list[str]:
    if layout != "packed":
        return []
    tokens = max(micro * 2048 if longest <= 2048 else 8192, longest)
    return ["policy.sequence_packing.enabled=true", f"policy.sequence_packing.train_mb_tokens={tokens}",
            f"policy.sequence_packing.logprob_mb_tokens={tokens}"]


def novarl_step(policy, batch, first: list):
    """One training step of a novarl policy on the batch: logprobs, forward/backward, optimizer step
    (the first step's logprobs, of the tokens the loss reads, appended to `first`)."""
    from novarl.algorithms.losses import make_loss
    from novarl.config.schema import LossConfig
    from novarl.models.scores import Logprobs

    loss = make_loss(LossConfig())

    def step() -> None:
        batch.old_logprobs = policy.forward(batch, Logprobs())
        if not first:
            first.append(batch.old_logprobs.float().cpu()[batch.loss_mask.cpu()])
        policy.forward_backward(batch, loss, Logprobs())
        policy.optim_step()

    return step


def plain_model(folder: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.to("cuda" if torch.cuda.is_available() else "cpu").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=torch.cuda.is_available())
    return model, optimizer


def plain_step(model, optimizer, rows, masks, micro: int, first: list) -> None:
    """A plain loop on padded rows: logprobs (no grad), then forward/backward, then AdamW (the first
    step's logprobs [rows, L - 1] appended to `first`)."""
    import torch

    def logprobs(ids, mask):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    with torch.no_grad():
        old = [logprobs(rows[i:i + micro], masks[i:i + micro]) for i in range(0, len(rows), micro)]
    if not first:
        first.append(torch.cat(old).float().cpu())
    for j, i in enumerate(range(0, len(rows), micro)):
        new = logprobs(rows[i:i + micro], masks[i:i + micro])
        weight = masks[i:i + micro, 1:].float()
        loss = -((new - old[j]).exp() * weight).sum() / weight.sum()
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_case(name: str, folder: str, steps: int, tiny: bool, trace: Path | None = None) -> dict:
    """One case in this process: timings, peak memory, kernels."""
    import torch

    base, *variants = name.split("+")
    kind, layout, compile_layers, implementation = CASES[base]
    for variant in variants:
        apply_variant(variant)
    config = json.loads((Path(folder) / "config.json").read_text())
    lengths, prompt = batch_lengths(kind, tiny)
    batch = make_batch(lengths, prompt, config["vocab_size"])
    micro = 4 if kind == "equal" else 2
    first: list = []
    if implementation == "plain":
        step, work, picked = plain_case(folder, batch, lengths, micro, first, variable=kind == "variable")
    else:
        picked = lambda: first[0]  # noqa: E731
        build = {"megatron": megatron_policy, "deepspeed": deepspeed_policy}.get(implementation, novarl_policy)
        policy = build(folder, layout, compile_layers, micro, max(lengths))
        step = novarl_step(policy, batch, first)
    times = timed_steps(step, 2 if compile_layers else 1, steps)
    graphs = compiled_graphs()
    if implementation != "plain":
        work = attention_work(batch, policy.train_batching)
    kernels = profile_kernels(step, trace)
    seconds = statistics.median(times[-steps:])
    params = json.loads((Path(folder).parent / "params.json").read_text())
    flops = 4 * forward_flops(lengths, params, config["num_hidden_layers"], config["hidden_size"])
    peak = peak_tflops(device_name())[0] * 1e12
    return {"case": name, "kind": kind, "layout": layout, "compile": compile_layers, "implementation": implementation,
            "s_per_step": seconds, "all_s": times, "tokens": sum(lengths), "tokens_per_s": sum(lengths) / seconds,
            "mfu": flops / seconds / peak, "peak_gb": torch.cuda.max_memory_allocated() / 1e9
            if torch.cuda.is_available() else float("nan"), "attention_work": work, "kernels": kernels,
            "logprobs": picked(), "graphs": graphs}


def compiled_graphs() -> dict[str, int]:
    """What torch.compile made of this process's compiled code so far: {"graphs": distinct graphs traced
    (recompiles included), "breaks": graph breaks}. A compiled layer that breaks runs eager between its
    pieces (and the rest of its function, where dynamo cannot resume)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}


def plain_case(folder: str, batch, lengths: list[int], micro: int, first: list, *, variable: bool):
    """(one step of the plain loop on the batch as padded rows, of similar lengths together; its attention
    work; a function giving its first step's logprobs of the tokens the loss reads, in the batch's order)."""
    import torch

    model, optimizer = plain_model(folder)
    device = next(model.parameters()).device
    rows = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    masks = torch.zeros_like(rows)
    for i, (start, end) in enumerate(zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist())):
        rows[i, :end - start], masks[i, :end - start] = batch.input_ids[start:end], 1
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows, masks = rows[order].to(device), masks[order].to(device)
    work = sum(len(lengths[i:i + micro]) * max(lengths[i:i + micro]) ** 2
               for i in range(0, len(lengths), micro)) / sum(L * L for L in lengths) if variable else 1.0

    def picked() -> torch.Tensor:
        flat = torch.zeros(len(batch.input_ids))
        starts = batch.cu_seqlens.tolist()
        for row, i in enumerate(order):
            flat[starts[i] + 1:starts[i + 1]] = first[0][row, :lengths[i] - 1]
        return flat[batch.loss_mask]

    return (lambda: plain_step(model, optimizer, rows, masks, micro, first)), work, picked


def timed_steps(step, warmups: int, steps: int) -> list[float]:
    """Seconds of each of warmups + steps calls of step (peak memory counted from the first timed one)."""
    import torch

    cuda, times = torch.cuda.is_available(), []
    for i in range(warmups + steps):
        if cuda:
            torch.cuda.synchronize()
            if i == warmups:
                torch.cuda.reset_peak_memory_stats()
        tic = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - tic)
    return times


def apply_variant(variant: str) -> None:
    """In this case's process, before the policy is built: the path VARIANTS names, switched."""
    from novarl.models import attention, logprob_head

    if variant == "eager-head":
        logprob_head._fused = lambda: (logprob_head._chunk_forward, logprob_head._chunk_grad_logits)
    elif variant == "padded-attention":
        attention.ASKED = "padded_sdpa"  # as NOVARL_PACKED_ATTENTION=padded_sdpa would
    elif variant == "varlen":
        attention.ASKED = "flash_varlen"
    elif variant in ("fsdp2", "reshard", "layer-units"):
        from novarl.backends.training import dtensor, parallelize

        dtensor.one_device = lambda *args: False
        if variant == "reshard":
            dtensor.keeps_gathered = lambda *args: False
        if variant == "layer-units":
            parallelize.fsdp_units = lambda layers, keep_gathered: [[layer] for layer in layers]
    elif variant == "unfused-swiglu":
        from novarl.backends.megatron import model

        model.fuses_activation = lambda mc: False
    else:
        raise SystemExit(f"unknown variant {variant!r}: {', '.join(VARIANTS)}")


def profile_kernels(step, trace: Path | None = None) -> dict:
    """One profiled step's GPU time (ms): {"attention": {kernel name: ms} of the 6 largest attention
    kernels, "categories": {category: ms} of every kernel (CATEGORIES, by name), "busy_ms": the time
    some kernel ran, "span_ms": first kernel's start to last kernel's end, "gaps": the idle stretches
    between kernels, by length}. With `trace`, the host's operators too (from a second profiled step): "waits"
    (host_waits), "idle_host" (idle_host: what the host ran while the GPU idled; with BENCH_TRACE_STACKS=1
    located by Python frames, at the price of a host slowed by the tracing) and the step's Chrome trace
    written there, gzipped. {} without CUDA; a failure here is reported and keeps the case's timings."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return {}
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == DeviceType.CUDA]
        extra = {}
        if trace:  # a step of its own: the host's operators recorded slow it, the figures above stay comparable
            stacks = os.environ.get("BENCH_TRACE_STACKS", "") not in ("", "0")  # Python frames: slower, and the host
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], with_stack=stacks) as prof:
                step()
                torch.cuda.synchronize()
            events = prof.events()
            extra["waits"] = host_waits(events, DeviceType.CPU)
            gpu = [(e.name, e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
            extra["idle_host"] = idle_host(gpu, [e for e in events if e.device_type == DeviceType.CPU
                                                 and not e.cpu_children])
            save_trace(prof, trace)
    except Exception as error:  # noqa: BLE001 (the timings stand without the profile)
        return {"error": f"{type(error).__name__}: {error}"[:200]}
    attention: dict[str, float] = {}
    categories: dict[str, float] = {}
    for name, start, end in spans:
        category = kernel_category(name)
        categories[category] = categories.get(category, 0.0) + (end - start) / 1e3
        if category == "attention":
            attention[name[:90]] = attention.get(name[:90], 0.0) + (end - start) / 1e3
    busy, reach = 0.0, float("-inf")
    for _, start, end in sorted(spans, key=lambda span: span[1]):  # the union of the kernels' intervals
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    span = (max(e for _, _, e in spans) - min(s for _, s, _ in spans)) / 1e3 if spans else 0.0
    return {"attention": dict(sorted(attention.items(), key=lambda kv: -kv[1])[:6]),
            "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1])), "busy_ms": busy / 1e3,
            "span_ms": span, "gaps": idle_gaps(spans), **extra}


GAP_BINS_MS = (0.05, 1.0, 10.0)
"""Idle stretches between kernels, binned by length: many short ones are launch-bound (the host
launches slower than the kernels run), a few long ones are waits."""


def idle_gaps(spans: list[tuple[str, float, float]]) -> dict[str, list[float]]:
    """{"> 0.05 ms": [count, total ms], "> 1 ms": ..., "> 10 ms": ...} of the stretches (us in, as
    the profiler's times) where no kernel ran; each stretch counted in the largest bin it passes."""
    bins = {f"> {edge:g} ms": [0, 0.0] for edge in GAP_BINS_MS}
    reach = None
    for _, start, end in sorted(spans, key=lambda span: span[1]):
        if reach is not None and start > reach:
            gap = (start - reach) / 1e3
            edges = [edge for edge in GAP_BINS_MS if gap > edge]
            if edges:
                slot = bins[f"> {edges[-1]:g} ms"]
                slot[0] += 1
                slot[1] += gap
        reach = end if reach is None else max(reach, end)
    return bins


HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls in which the host waits for the GPU (torch's blocking copies are an asynchronous copy
and a stream synchronisation: counted by the latter)."""


def host_waits(events, cpu) -> dict:
    """The host's time in HOST_WAITS calls: {"n": calls, "ms": their time, "under": {the outermost
    operator they ran in (module paths dropped): ms} of the 6 longest}."""
    under: dict[str, float] = {}
    count, total = 0, 0.0
    for event in events:
        if event.device_type != cpu or event.name not in HOST_WAITS:
            continue
        ms = (event.time_range.end - event.time_range.start) / 1e3
        outer = event
        while outer.cpu_parent is not None:
            outer = outer.cpu_parent
        name = outer.name.split(" (")[0]  # FSDP's labels end with the module's path
        under[name] = under.get(name, 0.0) + ms
        count, total = count + 1, total + ms
    return {"n": count, "ms": total, "under": dict(sorted(under.items(), key=lambda kv: -kv[1])[:6])}


def idle_host(spans: list[tuple[str, float, float]], leaves: list, top: int = 12) -> dict[str, list[float]]:
    """Where the host was while the GPU idled: each stretch of over 0.05 ms with no kernel running is charged to
    the host operator running at its middle (the innermost one: leaves, operators without children, on any
    thread, the Python interpreter's calls included), else to the next one the host started (the Python before it
    kept the GPU waiting), named by _where. {"<operator> @ <frame>": [stretches, ms]}, the `top` longest."""
    import bisect

    leaves = sorted(leaves, key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in leaves]
    charged: dict[str, list[float]] = {}
    reach = None
    for _, start, end in sorted(spans, key=lambda span: span[1]):
        if reach is not None and start - reach > 50:  # us
            middle = (reach + start) / 2
            i = bisect.bisect_right(starts, middle)
            inside = [e for e in leaves[max(0, i - 64):i] if e.time_range.end >= middle]
            event = min(inside, key=lambda e: e.time_range.end - e.time_range.start) if inside else (
                leaves[i] if i < len(leaves) else None)
            slot = charged.setdefault(_where(event), [0, 0.0])
            slot[0] += 1
            slot[1] += (start - reach) / 1e3
        reach = end if reach is None else max(reach, end)
    return dict(sorted(charged.items(), key=lambda kv: -kv[1][1])[:top])


OWN_FRAMES = ("novarl/", "benchmarks/", "transformers/", "megatron/", "torch/distributed/", "torch/_dynamo/",
              "torch/_inductor/", "torch/optim/", "torch/autograd/")
"""Where a stack's telling frame is looked for, in this order (the first kind found, innermost frame)."""


def _where(event) -> str:
    """The innermost operator at or around `event` and what it ran in: the innermost Python frame of the first of
    OWN_FRAMES's kinds among its callers where the profile has Python function events (`path(line): function`,
    with_stack=True), else the innermost of the labelled ranges around it (FSDP's, compiled regions', autograd's
    functions, the optimizer's step)."""
    if event is None:
        return "(no operator after it)"
    chain = [event]
    while chain[-1].cpu_parent is not None:
        chain.append(chain[-1].cpu_parent)
    python = [e.name for e in chain if "): " in e.name or e.name.startswith("<built-in")]
    operators = [e.name.split(" (")[0] for e in chain if e.name not in python]
    operator = operators[0] if operators else "python"
    frame = next((f for own in OWN_FRAMES for f in python if own in f), "")
    for own in OWN_FRAMES:
        if own in frame:
            frame = own + frame.split(own, 1)[1]
            break
    label = next((name for name in operators[1:] if not name.startswith("aten::")), "")
    within = frame or label
    return f"{operator[:48]} @ {within[:90]}" if within else operator[:48]


def save_trace(prof, path: Path) -> None:
    """The profile as a gzipped Chrome trace (chrome://tracing, Perfetto) at `path`, without Python functions'
    events and stacks where it has them (they multiply its size)."""
    import gzip

    raw = path.with_suffix("")
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    trace["traceEvents"] = [e for e in trace.get("traceEvents", []) if e.get("cat") != "python_function"]
    for event in trace["traceEvents"]:
        event.get("args", {}).pop("Call stack", None)
    with gzip.open(path, "wt") as target:
        json.dump(trace, target)
    raw.unlink()


def kernel_category(name: str) -> str:
    lowered = name.lower()
    return next(category for category, words in CATEGORIES if not words or any(w in lowered for w in words))


def report(results: list[dict], device: str, commit: str, shape: str, params: int, steps: int) -> str:
    peak, basis = peak_tflops(device)
    lines = [f"# Training speed on one {device}", "",
             f"- date: {date.today()}; commit {commit}; `python benchmarks/bench_train_gpu.py` "
             f"(torch {_version('torch')}, transformers {_version('transformers')})",
             f"- model: random {shape} shape, {params / 1e9:.2f} B parameters, bf16 compute (novarl: fp32 master "
             "weights, bf16 copies for each pass as FSDP2's mixed precision makes them, without FSDP2 on the one "
             "device unless `+fsdp2`; Megatron: its bf16 parameters and fp32 main weights; plain: bf16 weights, "
             "fused AdamW)",
             "- step = logprob pass (no grad) + forward/backward in micro-batches + optimizer step; "
             f"median of {steps} timed steps after warm-up; each case in a fresh process",
             f"- MFU = 4 x forward FLOPs of the real tokens / (s x {peak:.0f} TFLOP/s, {basis}); attention work = "
             "score work computed / the real tokens' (sum of L^2)",
             *(f"- {note}" for words, note in DEVICE_NOTES.items() if words in device.lower()),
             "- logprobs |diff|: the first step's logprobs of the tokens the loss reads (the same weights and batch) "
             "against the plain loop's on the same batch (else the batch's first case), mean and max; spread = the "
             "reference's standard deviation, the scale a wrong result would show at",
             *(f"- `+{v}`: {text}" for v, text in VARIANTS.items() if any(f"+{v}" in r["case"] for r in results)),
             "",
             "| case | batch | layout | compile | s/step | tokens/s | MFU | peak GB | attention work | "
             "logprobs \\|diff\\| mean / max (spread) | attention kernels (ms in one step) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | | | | {r['error'][:200]} | | | | | | |")
            continue
        kernels = "; ".join(f"{k} {v:.0f}" for k, v in r["kernels"].get("attention", {}).items()) or "-"
        label = {"plain": "plain PyTorch loop", "megatron": "novarl Megatron-core",
                 "deepspeed": "novarl DeepSpeed ZeRO-2"}.get(r["implementation"], "novarl DTensor")
        graphs = r.get("graphs", {})
        compiled = f"yes ({graphs['graphs']} graphs, {graphs['breaks']} breaks)" if r["compile"] and graphs else \
            "yes" if r["compile"] else "no"
        lines.append(f"| {r['case']} ({label}) | {r['kind']} | {r['layout']} | {compiled} "
                     f"| {r['s_per_step']:.3f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['peak_gb']:.1f} "
                     f"| {r['attention_work']:.2f} | {agreement(r)} | {kernels} |")
    return "\n".join(lines + targets(results) + time_breakdown(results)) + "\n"


def agreement(result: dict) -> str:
    found = result.get("logprobs")
    if not found:
        return "-"
    if found["against"] == result["case"]:
        return f"reference (spread {found['spread']:.3f})"
    return f"{found['mean_abs']:.4f} / {found['max_abs']:.3f} vs {found['against']}"


def targets(results: list[dict]) -> list[str]:
    """Issue 35's targets against the cases as novarl ships them (no `+variant`): one row each, "not
    measured" where a case it needs did not run."""
    ran = {r["case"]: r for r in results if "error" not in r}
    shipped = [r for r in ran.values() if "+" not in r["case"]]

    def best(implementation: str, kind: str, layout: str | None = None) -> dict | None:
        found = [r for r in shipped if r["implementation"] == implementation and r["kind"] == kind
                 and layout in (None, r["layout"])]
        return max(found, key=lambda r: r["tokens_per_s"]) if found else None

    dtensor, plain = best("novarl", "equal"), ran.get("plain")
    packed, fixed = best("novarl", "equal", "packed"), best("novarl", "equal", "fixed")
    variable, megatron = best("novarl", "variable", "packed"), best("megatron", "equal")
    rows = [
        ("equal lengths: DTensor >= 40 % MFU", dtensor, lambda: (f"{dtensor['mfu']:.1%} ({dtensor['case']})",
                                                                dtensor["mfu"] >= 0.40)),
        ("equal lengths: DTensor tokens/s >= the plain loop's", dtensor and plain,
         lambda: (f"{dtensor['tokens_per_s'] / plain['tokens_per_s']:.2f}x", dtensor["tokens_per_s"] >=
                  plain["tokens_per_s"])),
        ("equal lengths: packed never slower than fixed rows", packed and fixed,
         lambda: (f"{packed['s_per_step']:.3f} vs {fixed['s_per_step']:.3f} s/step",
                  packed["s_per_step"] <= fixed["s_per_step"])),
        ("variable lengths: packed attention work <= 1.05x real", variable,
         lambda: (f"{variable['attention_work']:.2f}x", variable["attention_work"] <= 1.05)),
        ("variable lengths: packed >= 35 % MFU on real tokens", variable,
         lambda: (f"{variable['mfu']:.1%}", variable["mfu"] >= 0.35)),
        ("Megatron-core without Transformer Engine within 10 % of DTensor", megatron and dtensor,
         lambda: (f"{megatron['tokens_per_s'] / dtensor['tokens_per_s']:.2f}x ({megatron['case']})",
                  megatron["tokens_per_s"] >= 0.9 * dtensor["tokens_per_s"])),
        *((f"peak memory at micro-batch 4, {layout} rows: no higher than before ({gb} GB)",
           case and math.isfinite(case["peak_gb"]),  # nan: no CUDA to count it
           lambda case=case, gb=gb: (f"{case['peak_gb']:.1f} GB", case["peak_gb"] <= gb))
          for layout, gb, case in ((layout, gb, best("novarl", "equal", layout)) for layout, gb in BEFORE_GB.items())),
    ]
    lines = ["", "Issue 35's targets (the cases as novarl ships them):", "", "| target | measured | met |",
             "|---|---|---|"]
    for target, needed, measure in rows:
        shown, met = measure() if needed else ("not measured", None)
        lines.append(f"| {target} | {shown} | {'-' if met is None else 'yes' if met else 'no'} |")
    return lines


def time_breakdown(results: list[dict]) -> list[str]:
    """Where one profiled step's GPU time goes: kernels by category (ms), and the time the GPU had
    no kernel running (idle: the host's launches and waits)."""
    profiled = [r for r in results if r.get("kernels", {}).get("categories")]
    if not profiled:
        errors = [f"{r['case']}: {r['kernels']['error']}" for r in results if r.get("kernels", {}).get("error")]
        return ["", "Profile failed: " + "; ".join(errors)] if errors else []
    names = [category for category, _ in CATEGORIES]
    lines = ["", "One profiled step's GPU time by kernel category (ms; the profiler slows the step a little):", "",
             "| case | step (profiled span) | kernels busy | idle | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for r in profiled:
        k = r["kernels"]
        idle = 1 - k["busy_ms"] / k["span_ms"] if k["span_ms"] else float("nan")
        lines.append(f"| {r['case']} | {k['span_ms']:.0f} | {k['busy_ms']:.0f} | {idle:.0%} | "
                     + " | ".join(f"{k['categories'].get(n, 0.0):.0f}" for n in names) + " |")
    return lines + idle_lines(profiled)


def idle_lines(profiled: list[dict]) -> list[str]:
    """The idle time's shape (gaps between kernels by length) and, for traced cases, the host's waits."""
    lines = ["", "Idle stretches between kernels (count / ms) and, in traced cases, the host's waits on the GPU "
             "(calls, ms, and the outermost operators they ran in):", "",
             "| case | " + " | ".join(f"gaps > {edge:g} ms" for edge in GAP_BINS_MS) + " | host waits |",
             "|---|" + "---|" * (len(GAP_BINS_MS) + 1)]
    for r in profiled:
        k = r["kernels"]
        waits = k.get("waits")
        said = (f"{waits['n']} calls, {waits['ms']:.0f} ms: " + "; ".join(f"{name} {ms:.0f}" for name, ms in
                                                                        waits["under"].items())) if waits else "-"
        gaps = k.get("gaps", {})
        lines.append(f"| {r['case']} | " + " | ".join(
            "{} / {:.0f}".format(*gaps[f"> {edge:g} ms"]) if f"> {edge:g} ms" in gaps else "-" for edge in GAP_BINS_MS)
            + f" | {said} |")
    for r in (r for r in profiled if r["kernels"].get("idle_host")):
        lines += ["", f"{r['case']}: where the host was while the GPU idled (traced step: its stretches of over "
                  "0.05 ms, charged to the host operator at each one's middle, else the next one):", "",
                  "| ms | stretches | host operator @ frame |", "|---|---|---|"]
        lines += [f"| {ms:.1f} | {n:.0f} | `{where}` |" for where, (n, ms) in r["kernels"]["idle_host"].items()]
    return lines


def plot_breakdown(results: list[dict], device: str, out: Path) -> Path | None:
    """A stacked bar per profiled case: its step's GPU time by kernel category, and idle time (a PNG
    beside the table); None where no case was profiled or matplotlib is missing (the GPU host may
    lack it: `--plot-from` its train_gpu.json then draws it here)."""
    profiled = [r for r in results if r.get("kernels", {}).get("categories")]
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    if not profiled:
        return None
    figure = Figure(figsize=(max(6.0, 0.9 * len(profiled) + 2), 4.5))
    axes = figure.add_subplot()
    names = [category for category, _ in CATEGORIES] + ["idle"]
    bottoms = [0.0] * len(profiled)
    for name in names:
        heights = [r["kernels"]["span_ms"] - r["kernels"]["busy_ms"] if name == "idle" else
                   r["kernels"]["categories"].get(name, 0.0) for r in profiled]
        axes.bar(range(len(profiled)), heights, bottom=bottoms, label=name,
                 color="lightgrey" if name == "idle" else None)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    axes.set_xticks(range(len(profiled)), [r["case"] for r in profiled], rotation=30, ha="right", fontsize=8)
    axes.set_ylabel("ms of one profiled step")
    axes.set_title(f"Where a training step's GPU time goes ({device})", fontsize=10)
    axes.legend(fontsize=7, ncols=2)
    figure.tight_layout()
    FigureCanvasAgg(figure).print_png(str(out))
    return out


def _version(name: str) -> str:
    import importlib.metadata as metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch (checks the script)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--trace-to", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--traces", default="fixed-compile,packed-compile,megatron-packed-compile",
                        help="cases whose profiled step is also written as a gzipped Chrome trace (to $OUT, else "
                             "beside --out), with the host's waits in the report")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per case")
    parser.add_argument("--budget", type=float, help="seconds for all the cases (the model's saving included)")
    parser.add_argument("--plot-from", type=Path, help="draw the breakdown of a run's train_gpu.json (to --out)")
    args = parser.parse_args()
    if args.plot_from:
        results = json.loads(args.plot_from.read_text())
        device = next((r["device"] for r in results if "device" in r), "GPU")
        print(plot_breakdown(results, device, args.out or args.plot_from.with_suffix(".png")) or "nothing to draw")
    elif args.case:  # a child: one case
        import torch

        result = run_case(args.case, args.folder, args.steps, args.tiny, args.trace_to)
        torch.save(result.pop("logprobs"), Path(args.result).with_suffix(".logprobs.pt"))
        Path(args.result).write_text(json.dumps(result))
    else:
        run_cases(args)


def run_cases(args: argparse.Namespace) -> None:
    """The cases of args.cases in that order, each in a process of its own, then the report. With
    --budget, a case starts only where the time left holds the longest case so far (the rest are
    listed as not run), and none runs past the time left."""
    shape = "tiny" if args.tiny else "qwen2.5-1.5b"
    device = device_name()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or "?"
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                      cwd=ROOT).stdout.strip():
        commit += " + uncommitted changes"
    results: list[dict] = []
    started, longest = time.perf_counter(), 0.0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        params = save_model(folder, shape)
        (Path(tmp) / "params.json").write_text(json.dumps(params))
        for name in args.cases.split(","):
            left = args.budget - (time.perf_counter() - started) if args.budget else args.timeout
            if results and min(left, args.timeout) < longest:
                results.append({"case": name, "error": f"not run: {left:.0f} s of the budget left, the longest "
                                f"case took {longest:.0f} s"})
                continue
            tic = time.perf_counter()
            results.append(run_child(name, folder, args, min(left, args.timeout)))
            longest = max(longest, time.perf_counter() - tic)
            compare_logprobs(results, Path(tmp))
            if args.out:  # as it goes: a run stopped from outside keeps the cases done
                args.out.write_text(report(results, device, commit, shape, params, args.steps))
            print(f"{name}: {time.perf_counter() - tic:.0f} s {summary(results[-1])}", flush=True)
    write_outputs(args, results, report(results, device, commit, shape, params, args.steps), device)


def run_child(name: str, folder: Path, args: argparse.Namespace, timeout: float) -> dict:
    """One case in a process of its own: its result, or {"case", "error"}."""
    out = folder.parent / f"{name}.json"
    command = [sys.executable, __file__, "--case", name, "--folder", str(folder), "--result", str(out),
               "--steps", str(args.steps)] + (["--tiny"] if args.tiny else [])
    if name in args.traces.split(","):
        where = Path(os.environ["OUT"]) if os.environ.get("OUT") else (args.out.parent if args.out else folder.parent)
        command += ["--trace-to", str(where / f"trace_{name.replace('+', '_')}.json.gz")]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"})
    except subprocess.TimeoutExpired:
        return {"case": name, "error": f"failed: over {timeout:.0f} s"}
    if not out.exists():
        sys.stderr.write(done.stderr[-3000:])
        return {"case": name, "error": "failed: " + (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(out.read_text())


def compare_logprobs(results: list[dict], folder: Path) -> None:
    """Each case's first-step logprobs (of the tokens the loss reads; the same weights and batch in
    every case) against its batch's reference: the plain loop's where it ran, else the batch's first
    case's. Sets result["logprobs"] = {"against", "mean_abs", "max_abs", "spread": the reference's std}."""
    import torch

    done = [r for r in results if "error" not in r]
    for kind in {r["kind"] for r in done}:
        same = [r for r in done if r["kind"] == kind]
        reference = next((r for r in same if r["implementation"] == "plain"), same[0])
        theirs = torch.load(folder / f"{reference['case']}.logprobs.pt")
        for r in same:
            mine = torch.load(folder / f"{r['case']}.logprobs.pt")
            r["logprobs"] = {"against": reference["case"], "mean_abs": (mine - theirs).abs().mean().item(),
                             "max_abs": (mine - theirs).abs().max().item(), "spread": theirs.std().item()}


def summary(result: dict) -> str:
    if "error" in result:
        return result["error"]
    agreement = result.get("logprobs", {})
    return (f"{result['s_per_step']:.3f} s/step, {result['tokens_per_s']:,.0f} tokens/s, MFU {result['mfu']:.1%}, "
            f"peak {result['peak_gb']:.1f} GB, attention work {result['attention_work']:.2f}, logprobs vs "
            f"{agreement.get('against')}: mean |diff| {agreement.get('mean_abs', float('nan')):.4f}, kernels "
            f"{ {k: v for k, v in result['kernels'].items() if k != 'attention'} }")


def write_outputs(args: argparse.Namespace, results: list[dict], text: str, device: str) -> None:
    """The report (printed, and written unless a --tiny run without --out), the runs' JSON ($OUT or the
    temporary folder) and the breakdown's plot."""
    print(text)
    slug = "".join(c if c.isalnum() else "_" for c in device.lower()).strip("_")
    out = args.out or ROOT / "benchmarks" / "results" / f"train_gpu_{slug}.md"
    if not args.tiny or args.out:
        out.write_text(text)
        print(f"wrote {out}")
    for result in results:
        result["device"] = device
    Path(os.environ.get("OUT", tempfile.gettempdir()), "train_gpu.json").write_text(json.dumps(results, indent=1))
    drawn = plot_breakdown(results, device, out.with_suffix(".png")) if not args.tiny or args.out else None
    if drawn:
        print(f"wrote {drawn}")

if __name__ == "__main__":
    main()
