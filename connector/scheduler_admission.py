"""The scheduler side's write admission: once per admitted request, which of its chunks go to the shared tier
(`kvtier.shared.writes`) and which to the SSD tier (`kvtier.ssd_admission`), both decided by the policy objects of
`kvtier.storage_backends.admission`; then, per save job, the chunks the worker must keep off the SSD
(`SaveSpec.ssd_refused`). The default (`all` for both) decides nothing per chunk and sends nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence

from kvtier.connector.scheduler_state import RequestState
from kvtier.storage_backends import metrics as SM
from kvtier.storage_backends.admission.base import ADMIT_ALL, AdmissionQuery
from kvtier.storage_backends.admission.config import AdmissionOptions, policy_for, shared_policy
from kvtier.storage_backends.shared.config import SharedTierOptions

logger = logging.getLogger(__name__)


class WriteAdmission:
    def __init__(self, shared: SharedTierOptions | None, ssd: AdmissionOptions | None, chunk: int) -> None:
        self.shared = shared_policy(shared)
        self.ssd = policy_for(ssd or AdmissionOptions())
        self.chunk = chunk
        if self.ssd.name != "all":
            logger.info("kvtier: SSD write admission %s", self.ssd.name)

    def admit(self, st: RequestState, cached_tokens: int, keys: Callable[[], Sequence[Hashable]]) -> None:
        """Decide for request state `st` (its `share` and `ssd_admission`), `cached_tokens` of whose prompt were
        cached at arrival; `keys()` gives its prompt chunk keys (computed only for a policy that reads them). The
        shared verdict is decided again when a preempted request is admitted again (as before); the SSD verdict
        once per request (a doorkeeper must not see a request's own keys as a second sight)."""
        cached = cached_tokens // self.chunk
        st.share = self.shared.decide(AdmissionQuery(cached)).rest
        if st.ssd_admission is None:
            st.ssd_admission = self.ssd.decide(AdmissionQuery(cached, keys() if self.ssd.needs_keys else ()))

    def refused(self, st: RequestState, skip: int, end: int) -> tuple[int, ...]:
        """Chunk indices in [skip, end) (tokens, chunk aligned) of `st`'s save that the SSD tier must not write;
        counts the save's chunks by decision."""
        first, last = skip // self.chunk, end // self.chunk
        out = (st.ssd_admission or ADMIT_ALL).refused(first, last)
        if out:
            SM.SSD_ADMISSION_CHUNKS.labels("refused").inc(len(out))
        if last - first - len(out):
            SM.SSD_ADMISSION_CHUNKS.labels("admitted").inc(last - first - len(out))
        return out
