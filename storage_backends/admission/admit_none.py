"""`none`: nothing is written (the tier is only read: what another engine, or an earlier run, wrote)."""

from __future__ import annotations

import logging

from kvtier.storage_backends.admission.base import REFUSE_ALL, AdmissionQuery, Decision

logger = logging.getLogger(__name__)


class AdmitNone:
    name = "none"
    needs_keys = False

    def decide(self, query: AdmissionQuery) -> Decision:
        return REFUSE_ALL
