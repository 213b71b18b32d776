"""What a worker group asks of the roles it runs, beyond their own verbs: optional abilities,
checked with isinstance (backends/protocols.py re-exports them with the roles' Protocols)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Offloadable(Protocol):
    """What colocation needs: free the accelerator memory while the other role runs."""

    def offload(self) -> None: ...

    def onload(self) -> None: ...


@runtime_checkable
class Parkable(Protocol):
    """What a training role does beside colocated engines: its optimizer's state or its weights to host memory
    while they generate (distributed/parking.py); they come back when the role next needs them."""

    def park(self, group: str, host_too: bool = False) -> int:
        """Park `group` ("optimizer" or "weights"); bytes freed on this rank's device. host_too: host storages
        as well (parking.PARK_ON_CPU_VARIABLE: the tests' colocated flow on a CPU host)."""
        ...


@runtime_checkable
class Stoppable(Protocol):
    """A role with processes or engines of its own to stop (Ray ranks, engine actors)."""

    def shutdown(self) -> None: ...
