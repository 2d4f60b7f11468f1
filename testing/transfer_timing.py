"""Tests only: hold or slow the connector worker's transfers (`kvtier.connector.transfer_timing`).

    install(HeldTransfers(requests=("5-", "11-"), load_hold=6, save_hold=40))   # before vLLM starts

`HeldTransfers` holds asynchronous loads / saves of the requests whose id starts with one of `requests` that many
engine steps on the transfer thread (`load_hold`, `save_hold`), makes those loads sleep `load_delay` seconds first,
and every prefetch sleep `prefetch_delay` seconds (a slow SSD). `install` puts it on `WorkerSide.timing`, in this
process: a worker built afterwards uses it (an in-process engine, `VLLM_ENABLE_V1_MULTIPROCESSING=0` with one rank).
Engines in a child process get it through their harness: `EngineProcess(..., timing=HeldTransfers(...))`
(`kvtier.testing.vllm_engine`) passes `as_dict()` along and the child calls `install_dict` before it builds `LLM`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvtier.connector.transfer_timing import TransferTiming

__all__ = ["HeldTransfers", "install", "install_dict"]


@dataclass(frozen=True)
class HeldTransfers(TransferTiming):
    """Holds and delays for the requests whose id starts with one of `requests` ("": every request)."""

    requests: tuple[str, ...] = ("",)
    #: seconds every prefetch sleeps first (whatever its request)
    prefetch_delay: float = 0.0
    #: seconds an asynchronous load of those requests sleeps on the transfer thread first
    load_delay: float = 0.0
    #: engine steps their asynchronous loads / saves wait on the transfer thread
    load_hold: int = 0
    save_hold: int = 0

    def _applies(self, req_id: str) -> bool:
        return req_id.startswith(tuple(self.requests))

    def prefetch_delay_s(self, rid: str) -> float:
        return self.prefetch_delay

    def load_delay_s(self, req_id: str) -> float:
        return self.load_delay if self._applies(req_id) else 0.0

    def load_hold_steps(self, req_id: str) -> int:
        return self.load_hold if self._applies(req_id) else 0

    def save_hold_steps(self, req_id: str) -> int:
        return self.save_hold if self._applies(req_id) else 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, for an engine in another process (`install_dict`)."""
        return {**asdict(self), "requests": list(self.requests)}


def install(timing: TransferTiming) -> None:
    """Every connector worker built in this process from now on uses `timing`."""
    from kvtier.connector.worker_side import WorkerSide

    WorkerSide.timing = timing


def install_dict(raw: dict[str, Any] | None) -> None:
    """`install` of a `HeldTransfers.as_dict()` (nothing for None)."""
    if raw is not None:
        install(HeldTransfers(**{**raw, "requests": tuple(raw.get("requests", ("",)))}))
