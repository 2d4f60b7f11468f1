"""`all`: every chunk is written (write-through; the default: kvtier's behaviour without admission)."""

from __future__ import annotations

import logging

from kvtier.storage_backends.admission.base import ADMIT_ALL, AdmissionQuery, Decision

logger = logging.getLogger(__name__)


class AdmitAll:
    name = "all"
    needs_keys = False

    def decide(self, query: AdmissionQuery) -> Decision:
        return ADMIT_ALL
