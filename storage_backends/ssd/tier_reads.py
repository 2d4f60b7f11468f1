"""The SSD tier's read path (`TierReads`, a part of `SSDTier`): chunks into host buffers or device memory.

`read_batch` stages each chunk's destination (`alloc(key, meta)`), reads header and segments straight into it, and
verifies them against key, generation, metadata and CRCs (`SlotIO.read`); sealed chunks are opened as each arrives.
A chunk that fails any check is released, dropped from the tier and counted: a miss, never wrong KV.
`read_batch_into_device` reads through kvikio straight into device tensors. Reads are counted as activity
(`_reading`), which the slot preparer waits out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier.identity.namespace import KeyNamespace
from kvtier.storage_backends import metrics as M
from kvtier.storage_backends.base import ChunkMeta
from kvtier.storage_backends.ssd.index import Entry, SlotIndex
from kvtier.storage_backends.ssd.posix_io import bytes_view
from kvtier.storage_backends.ssd.sealing import ChunkSealer
from kvtier.storage_backends.ssd.slot_io import SlotIO, SlotRead

__all__ = ["TierReads"]

logger = logging.getLogger(__name__)


class TierReads:
    """The read path of `SSDTier` (which sets these attributes up)."""

    namespace: KeyNamespace
    io: SlotIO
    index: SlotIndex
    sealer: ChunkSealer | None
    _crypto: ThreadPoolExecutor | None
    _activity: threading.Lock
    _reads_active: int
    _last_io: float

    def read_batch(self, keys: Sequence[str], alloc: Callable[[str, ChunkMeta], tuple[memoryview, Any] | None],
                   release: Callable[[Any], None]) -> list[Any]:
        """Read chunks into destinations from `alloc(key, meta) -> (buffer, handle)`; returns the handles (None
        for a miss). A chunk that fails any check is released, dropped from the tier and counted. Never raises
        (an `alloc` or `release` that raises makes that chunk a miss)."""
        t0 = time.monotonic()
        self._reading(1)
        asked, keys = keys, [self.namespace.qualify(k) for k in keys]
        entries = self.index.begin_read(keys)
        verdicts: list[str | None] = [None] * len(keys)
        served = [False] * len(keys)
        out: list[Any] = [None] * len(keys)
        try:
            dests: list[tuple[memoryview, Any] | None] = [self._stage(k, e, alloc, release)
                                                          for k, e in zip(asked, entries)]
            todo = [i for i, d in enumerate(dests) if d is not None]
            reads = [SlotRead(keys[i], entries[i].slot, entries[i].gen,  # type: ignore[union-attr]
                              entries[i].meta, entries[i].seg, dests[i][0])  # type: ignore[union-attr,index]
                     for i in todo]  # (staged: an entry and a destination)
            opening: dict[int, Any] = {}  # sealed chunks are opened as each arrives, while later ones still read

            def open_now(j: int) -> None:
                i = todo[j]
                opening[i] = self._crypto.submit(  # type: ignore[union-attr]
                    self._opened, keys[i], entries[i].meta, dests[i][0])  # type: ignore[index,union-attr]

            results = list(zip(todo, self.io.read(reads, open_now if self._crypto is not None else None)))
            for i, verdict in results:
                if verdict is None:
                    ok = opening[i].result() if i in opening else self._opened(
                        keys[i], entries[i].meta, dests[i][0])  # type: ignore[index,union-attr]
                    verdict = None if ok else "auth"
                verdicts[i] = verdict
                if verdict is None:
                    out[i] = dests[i][1]  # type: ignore[index]
                    served[i] = True
                else:
                    _safe_release(release, dests[i][1])  # type: ignore[index]
        finally:
            self.index.end_read(keys, entries, verdicts, served)
            self._reading(-1)
        M.SSD_READ_SECONDS.observe(time.monotonic() - t0)
        return out

    def _opened(self, key: str, meta: Any, dest: memoryview) -> bool:
        """A chunk read whole: decrypted in place when the tier seals chunks (False: not sealed, or it fails
        authentication); a sealed chunk in a tier without the secret is refused too."""
        sealed = isinstance(meta.extra, dict) and "sealed" in meta.extra
        if self.sealer is None:
            return not sealed
        try:
            return sealed and self.sealer.open(key, meta, dest)
        except Exception:  # noqa: BLE001 - a chunk that cannot be opened is a miss, never an error for the caller
            logger.exception("SSD tier: opening sealed chunk %s failed; treated as a miss", key)
            return False

    @staticmethod
    def _stage(key: str, e: Entry | None, alloc, release) -> tuple[memoryview, Any] | None:
        if e is None:
            return None
        try:
            d = alloc(key, e.meta)
            if d is None:
                return None
            buf = bytes_view(d[0])
            if len(buf) < e.meta.nbytes:
                _safe_release(release, d[1])
                logger.warning("destination of %d bytes for the %d-byte SSD chunk %s; treated as a miss",
                               len(buf), e.meta.nbytes, key)
                return None
            return buf, d[1]
        except Exception:
            logger.exception("cannot stage SSD chunk %s; treated as a miss", key)
            return None

    def read_into_device(self, key: str, dest) -> bool:
        """Read a chunk straight into a GPU tensor through kvikio (GDS or compat mode). The data is verified
        against the slot's checksums before True is returned; False is a miss. Never raises."""
        return self.read_batch_into_device([key], lambda _k, _m: dest)[0]

    @property
    def reads_into_device(self) -> bool:
        """Whether reads can go straight into device memory (`kvtier.io_engine` resolved to kvikio, and chunks are not
        sealed: they are opened in host memory)."""
        return self.io is not None and self.io.device_reads and self.sealer is None

    def read_batch_into_device(self, keys: Sequence[str], dest: Callable[[str, ChunkMeta], Any]) -> list[bool]:
        """Read chunks straight into the device tensors `dest(key, meta)` names (None: not read) through kvikio,
        each verified against its slot's checksums; True where the chunk arrived whole. Never raises."""
        if self.sealer is not None:  # sealed chunks are opened in host memory (`reads_into_device` is False)
            return [False] * len(keys)
        t0 = time.monotonic()
        self._reading(1)
        asked, keys = keys, [self.namespace.qualify(k) for k in keys]
        entries = self.index.begin_read(keys)
        verdicts: list[str | None] = [None] * len(keys)
        served = [False] * len(keys)
        try:
            for i, (key, e) in enumerate(zip(keys, entries)):
                if e is None or self.io is None:
                    continue
                try:
                    d = dest(asked[i], e.meta)  # type: ignore[arg-type]  # (a replayed record has its fields)
                except Exception:
                    logger.exception("cannot place SSD chunk %s in device memory; treated as a miss", key)
                    d = None
                if d is None:
                    continue
                verdicts[i] = self.io.read_into_device(SlotRead(key, e.slot, e.gen, e.meta, e.seg, memoryview(b"")), d)
                served[i] = verdicts[i] is None
        finally:
            self.index.end_read(keys, entries, verdicts, served)
            self._reading(-1)
        M.SSD_READ_SECONDS.observe(time.monotonic() - t0)
        return served

    def _reading(self, delta: int) -> None:
        """A read begins (+1) or ends (-1): the activity the slot preparer waits out."""
        with self._activity:
            self._reads_active += delta
            self._last_io = time.monotonic()


def _safe_release(release: Callable[[Any], None], handle: Any) -> None:
    try:
        release(handle)
    except Exception:
        logger.exception("releasing a staging buffer failed")
