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
class Stoppable(Protocol):
    """A role with processes or engines of its own to stop (Ray ranks, engine actors)."""

    def shutdown(self) -> None: ...
