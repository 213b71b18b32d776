"""What a run exposes to the network: every socket that novarl's own Ray instance, the
rendezvous store, gloo and the weight bridge listen on is on the loopback interface, and
the weight bridge decodes plain data, never a pickle.

The socket tests list, with psutil, the sockets of the driver and every process below it
(Ray's GCS, raylet, agents and workers are all started by the driver) while the run is live:
the reward function, called in the driver every step, takes the samples.
"""

import ipaddress
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from novarl.config import load_config
from novarl.trainer.api import GRPOTrainer
from tests.helpers import HF
from tests.helpers.rewards import digit_fraction

FSDP2X2_RECIPE = Path(__file__).parents[1] / "examples" / "configs" / "grpo_tiny_fsdp2x2.yaml"


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.shutdown()  # the first run starts its own instance, as a user's would
    yield
    ray.shutdown()


def listening_sockets() -> set[tuple[str, str, str, int]]:
    """(process, protocol, address, port) of every socket the driver or a process below it
    listens on: TCP in LISTEN, and UDP bound without a peer (it takes datagrams from anyone)."""
    import psutil  # Ray ships its own copy

    driver = psutil.Process()
    found = set()
    for proc in [driver, *driver.children(recursive=True)]:
        try:
            name = os.path.basename((proc.cmdline() or [proc.name()])[0])
            connections = proc.net_connections(kind="inet")
        except psutil.Error:  # it exited meanwhile
            continue
        for conn in connections:
            if conn.type == socket.SOCK_STREAM and conn.status == psutil.CONN_LISTEN:
                found.add((f"{name}[{proc.pid}]", "tcp", conn.laddr.ip, conn.laddr.port))
            elif conn.type == socket.SOCK_DGRAM and not conn.raddr:
                found.add((f"{name}[{proc.pid}]", "udp", conn.laddr.ip, conn.laddr.port))
    return found


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, an IPv6 socket's view of 127.0.0.1
    return (mapped or address).is_loopback


class SocketSampler:
    """A reward function (the share of digits) that also lists the listening sockets, at most
    once a second: once a step at this size."""

    def __init__(self) -> None:
        self.samples: list[set[tuple[str, str, str, int]]] = []
        self.last = 0.0

    def __call__(self, completion: str, answer: str) -> float:
        if time.monotonic() - self.last > 1.0:
            self.samples.append(listening_sockets())
            self.last = time.monotonic()
        return digit_fraction(completion, answer)


def run_sampling_sockets(tmp_path, recipe, *overrides) -> set[tuple[str, str, str, int]]:
    cfg = load_config(recipe, overrides=[
        f"logger.log_dir={tmp_path}", "logger.progress_bar=false", "grpo.max_train_seconds=null",
        "grpo.max_num_steps=2", "grpo.val_at_start=false", "grpo.val_at_end=false",
        "checkpointing.enabled=false", "grpo.num_prompts_per_step=16", "policy.train_micro_batch_size=64", HF,
        *overrides])
    sampler = SocketSampler()
    GRPOTrainer(cfg, reward_fn=sampler).train()
    assert len(sampler.samples) >= 2  # the check before the run, and at least one step
    return set().union(*sampler.samples)


def assert_all_on_loopback(seen: set[tuple[str, str, str, int]], *, rank0_sockets: int) -> None:
    """Every socket in `seen` is on loopback, and `seen` holds the run: Ray's servers, and a rank
    process listening on `rank0_sockets` ports (policy rank 0: its gRPC server, gloo, the store)."""
    from collections import Counter

    assert {"gcs_server", "raylet"} <= {name.split("[")[0] for name, *_ in seen}, sorted(seen)
    per_rank = Counter(name for name, *_ in seen if name.startswith("ray::RankActor"))
    assert len(per_rank) >= 2 and max(per_rank.values()) >= rank0_sockets, sorted(seen)
    exposed = sorted(s for s in seen if not is_loopback(s[2]))
    assert exposed == [], f"listening beyond loopback: {exposed}"


@pytest.mark.slow
def test_a_two_rank_run_with_dedicated_generation_listens_on_loopback_only_and_ray_asks_for_its_token(
        tmp_path, ray_session):
    """2 policy ranks (FSDP2, gloo between them) + the generator's actor, joined by the weight bridge
    (its store on policy rank 0, which then listens on 5 ports: the bridge's store and gloo besides
    its own 3): every server of the run on loopback, and Ray's asks for the run's token. Ray is
    started as a run starts it, with a logical CPU for each of the 3 processes (this host may have 2)."""
    from novarl.distributed.ray_group import start_local_ray

    start_local_ray(num_cpus=3)
    seen = run_sampling_sockets(tmp_path, FSDP2X2_RECIPE, "cluster.gpus_per_node=3",
                                "policy.generation.colocated.enabled=false",
                                "policy.generation.colocated.resources.gpus_per_node=1")
    assert_all_on_loopback(seen, rank0_sockets=5)
    # A process of this machine without the run's token cannot use its Ray either.
    assert gcs_answers(token=os.environ["RAY_AUTH_TOKEN"])
    assert not gcs_answers(token=None) and not gcs_answers(token="0" * 64)


def gcs_answers(token: str | None) -> bool:
    """Whether the running Ray's GCS answers a request that carries `token` (or none)."""
    import grpc
    import ray
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(ray.get_runtime_context().gcs_address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), metadata=metadata, timeout=30)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
            return False
    return True


class WritesAFile:
    """Unpickling this runs code: it writes a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "pwned"))


def test_the_weight_bridge_header_is_json_with_known_dtypes_and_plain_shapes(tmp_path):
    import json
    import pickle

    from novarl.distributed.weight_sync import MalformedHeader, decode_header

    good = [["float32", [["embed.weight", [50, 8]], ["step", []]]], ["bfloat16", [["scale", [8]]]]]
    assert decode_header(json.dumps(good).encode()) == [
        ("float32", [("embed.weight", (50, 8)), ("step", ())]), ("bfloat16", [("scale", (8,))])]
    marker = tmp_path / "pwned"
    malformed = {
        "a pickle": pickle.dumps([("float32", [("w", WritesAFile(marker))])]),
        "not UTF-8": b"\xff\xfe",
        "not a list": json.dumps({"float32": []}).encode(),
        "a dtype outside the list": json.dumps([["Tensor", [["w", [1]]]]]).encode(),
        "a dtype that is a list": json.dumps([[["float32"], [["w", [1]]]]]).encode(),
        "a negative dim": json.dumps([["float32", [["w", [2, -1]]]]]).encode(),
        "a float dim": json.dumps([["float32", [["w", [2.0]]]]]).encode(),
        "a bool dim": json.dumps([["float32", [["w", [True]]]]]).encode(),
        "a name that is not a string": json.dumps([["float32", [[1, [2]]]]]).encode(),
        "a short bucket": json.dumps([["float32"]]).encode(),
    }
    for what, data in malformed.items():
        with pytest.raises(MalformedHeader):
            decode_header(data)
            pytest.fail(f"{what} was accepted")
    assert not marker.exists()


def test_a_receiver_refuses_a_pickled_header_sent_over_the_bridge(tmp_path):
    """A real weight-transfer group (gloo, one process, two threads): rank 0 broadcasts a pickle
    where the header goes; the receiver raises and runs nothing."""
    import pickle
    import threading

    from novarl.distributed.weight_sync import MalformedHeader, WeightBridge, listen_on

    listener = listen_on("127.0.0.1")
    port = listener.getsockname()[1]
    marker = tmp_path / "pwned"

    def sender() -> None:
        bridge = WeightBridge("127.0.0.1", port, 0, 2, listener, device=torch.device("cpu"))
        bridge._broadcast_bytes(pickle.dumps(WritesAFile(marker)))

    thread = threading.Thread(target=sender)
    thread.start()
    receiver = WeightBridge("127.0.0.1", port, 1, 2, device=torch.device("cpu"))  # gloo: one GPU holds no 2 NCCL ranks
    with pytest.raises(MalformedHeader, match="not JSON"):
        next(receiver.receive())
    thread.join(timeout=60)
    assert not marker.exists()
