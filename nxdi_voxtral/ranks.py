"""The one rank interface: tp 1 runs its graphs in this process, tp > 1 in rank worker processes (workers.py).

Both answer the same four things, so the application, the build and every backend open ranks once and never ask
how many there are:
- `setup`: the GraphSetup every rank built (rank 0's);
- `run(tag, bucket, *inputs)`: one graph on every rank, rank 0's outputs;
- `call(method, *args)`: an Engine method on every rank, the per-rank results in rank order;
- `close()`; plus `pids` (the rank processes, empty in-process) and `dead()` for the server's fault recovery.
"""
from __future__ import annotations

from .engine import Engine, build_engine


class LocalRank:
    """tp 1: the one Engine, in this process."""

    tp = 1
    pids: list[int] = []

    def __init__(self, build_kwargs: dict):
        build_kwargs = {k: v for k, v in build_kwargs.items() if k != "process_group"}  # no collectives at tp 1
        self.engine: Engine = build_engine(**build_kwargs)
        self.setup = self.engine.setup

    @classmethod
    def of(cls, engine: Engine) -> "LocalRank":
        """Wrap an engine that was built elsewhere (the NxD build reads its plan from a CPU engine)."""
        self = cls.__new__(cls)
        self.engine, self.setup = engine, engine.setup
        return self

    def run(self, tag: str, bucket: int, *inputs):
        return self.engine.run(tag, bucket, *inputs)

    def call(self, method: str, *args) -> list:
        return [getattr(self.engine, method)(*args)]

    def dead(self) -> bool:
        return False

    def close(self) -> None:
        pass


def open_ranks(tp: int, build_kwargs: dict, call_timeout_s: float | None = None, process_group: str = "gloo"):
    """Load the model on tp ranks (build_engine's keyword arguments) -> LocalRank or RankWorkers.
    process_group: the torch.distributed backend the rank workers join (gloo on CPU)."""
    if tp == 1:
        return LocalRank(build_kwargs)
    from .workers import RankWorkers
    return RankWorkers(tp, {**build_kwargs, "process_group": process_group}, call_timeout_s)
