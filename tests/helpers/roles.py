"""Roles for worker-group tests: the smallest that a rank can host (no model)."""

import os


class Kept:
    """Leaves nothing behind in its rank's process: the process may serve another group
    (novarl/distributed/kept_ranks.py: REUSE_RANKS_VARIABLE)."""

    process_reusable = True

    def __init__(self, tag: int) -> None:
        self.tag = tag

    def pid(self) -> int:
        return os.getpid()

    def tagged(self) -> int:
        return self.tag


class NotKept(Kept):
    """As if it left global state behind (Megatron's, DeepSpeed's): its rank's process ends with it."""

    process_reusable = False
