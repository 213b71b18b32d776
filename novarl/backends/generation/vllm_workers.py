"""What novarl adds to the worker processes of a dedicated vLLM engine that spans several devices.

Such an engine (policy.generation.colocated.enabled=false with vllm_cfg tensor_parallel_size x
pipeline_parallel_size > 1) runs on an engine actor given all its devices: vLLM's multiprocessing
executor starts one worker process per device there (not Ray's executor, which would ask for a
placement-group bundle of one device per worker inside the actor's own bundle). The full weights
go to the workers themselves: each joins the weight bridge (distributed/weight_sync.py) as a rank
of its own, receives every bucket rank 0 broadcasts into its own device, and loads its shard of
each tensor as it comes (vLLM's `reload_weights`). Nothing passes through the engine actor, which
could not hand the workers a stream anyway (vLLM pickles what `collective_rpc` sends them).

`BridgeWorker` is vLLM's `worker_extension_cls`: its methods become the workers' own, reached
through `LLM.collective_rpc` by name; `self.rank` is the worker's rank in its engine.
"""

from __future__ import annotations

from typing import Any

WORKER_EXTENSION = "novarl.backends.generation.vllm_workers.BridgeWorker"


class BridgeWorker:
    """Methods of each worker of a dedicated engine that spans devices (a mix-in of vLLM's worker)."""

    rank: int
    novarl_bridge: Any = None

    def novarl_join_bridge(self, host: str, port: int, first_rank: int, world_size: int) -> None:
        """Join the weight bridge as rank first_rank + this worker's rank in the engine (on its device)."""
        from novarl.distributed.weight_sync import WeightBridge

        self.novarl_bridge = WeightBridge(host, port, first_rank + self.rank, world_size)

    def novarl_receive_weights(self, version: int, queued: bool) -> None:
        """Take weights `version` from the bridge into this worker's shard of the model (queued: rank 0's
        thread sends them once every engine's workers say they are here)."""
        from novarl.distributed.weight_sync import drain

        if queued:
            self.novarl_bridge.mark_ready(version)
        stream = self.novarl_bridge.receive()
        reload: Any = getattr(self, "reload_weights")  # vLLM's worker's
        reload(weights_iterator=stream)
        drain(stream)  # a tensor the model skipped still comes over the bridge
