"""megatron-core on the CPU, for testing the Megatron backend on machines without GPUs.

megatron-core trains on CUDA only: it asks for `torch.cuda.current_device()`,
allocates buffers with `device="cuda"`, keeps CUDA RNG states and asserts
`param.type() == "torch.cuda.FloatTensor"`. None of that is about the maths.
With `NOVARL_MEGATRON_ON_CPU=1` the Megatron backend runs every rank's copy of
megatron-core on the CPU (gloo between ranks) by mapping those CUDA requests to
the CPU inside the rank's process:

- a TorchFunctionMode turns `device="cuda"` (and `.cuda()`, `.to("cuda")`) into
  the CPU and reports CPU tensors' types as their CUDA names;
- `torch.cuda.current_device` answers "cpu", the CUDA RNG functions use the CPU
  generator, and `torch.cuda.synchronize` has nothing to wait for.

It is for tests and for reading the code path on a laptop: it is slow and has
no fused kernels (no Transformer Engine: no sequence parallelism or FP8). It
is installed in the processes that host Megatron ranks (Ray actors), never in
the driver, because it changes torch for the whole process.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
from torch.overrides import TorchFunctionMode

ENV = "NOVARL_MEGATRON_ON_CPU"


def requested() -> bool:
    """True when the user asked for megatron-core on the CPU (and this host has no CUDA)."""
    return os.environ.get(ENV, "") not in ("", "0") and not torch.cuda.is_available()


def _cpu(device):
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _CudaAsCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
        elif func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        else:
            kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


_installed = False


def install() -> None:
    """Map megatron-core's CUDA requests to the CPU in this process (idempotent)."""
    global _installed
    if _installed:
        return
    # megatron-core reads .grad of views its CUDA paths make, which this mode keeps as CPU tensors
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf Tensor")
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]  # a device all the same
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.synchronize = lambda device=None: None  # CPU ops are synchronous
    _CudaAsCpu().__enter__()
    # its model-parallel RNG forks compare the CPU generator's state before and after: here the
    # "CUDA" generator is the CPU one, so each fork would log that the CPU state changed
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    _installed = True
