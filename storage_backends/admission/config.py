"""`kvtier.ssd_admission`: which chunks the SSD tier writes, parsed strictly (an unknown key, a wrong type or value
raises `ConfigError` naming `kvtier.ssd_admission.<key>`):

    extra_config:
      kvtier.ssd_admission:
        policy: all              # all | continuing | second-sight | none
        min_history_chunks: 2    # continuing: chunks of the prompt cached at arrival
        ghost_chunks: 65536      # second-sight: chunk keys the doorkeeper remembers
        min_seen_chunks: 1       # second-sight: prompt chunks seen before that make a request a second sight

`policy_for(options)` builds the policy object; `shared_policy` the shared tier's (`kvtier.shared.writes`) from the
same classes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

from kvtier.storage_backends.admission.admit_all import AdmitAll
from kvtier.storage_backends.admission.admit_none import AdmitNone
from kvtier.storage_backends.admission.base import AdmissionPolicy
from kvtier.storage_backends.admission.continuing import Continuing
from kvtier.storage_backends.admission.second_sight import SecondSight
from kvtier.storage_backends.config import ConfigError, check_int, refuse_unknown_keys, require_mapping
from kvtier.storage_backends.shared.config import SharedTierOptions

logger = logging.getLogger(__name__)

SSD_ADMISSION_KEY = "kvtier.ssd_admission"
POLICIES = ("all", "continuing", "second-sight", "none")


@dataclass(frozen=True)
class AdmissionOptions:
    policy: str = "all"
    min_history_chunks: int = 2
    ghost_chunks: int = 65536
    min_seen_chunks: int = 1

    @classmethod
    def parse(cls, raw: Any, where: str = SSD_ADMISSION_KEY) -> AdmissionOptions:
        if raw is None:
            return cls()
        raw = require_mapping(raw, where, "{policy: second-sight}")
        refuse_unknown_keys(raw, [f.name for f in fields(cls)], where)
        out = cls(**raw)
        if out.policy not in POLICIES:
            raise ConfigError(f"{where}.policy must be one of {', '.join(POLICIES)}, got {out.policy!r}")
        check_int(out.min_history_chunks, f"{where}.min_history_chunks", 0)
        check_int(out.ghost_chunks, f"{where}.ghost_chunks", 1)
        check_int(out.min_seen_chunks, f"{where}.min_seen_chunks", 1)
        return out


def policy_for(options: AdmissionOptions) -> AdmissionPolicy:
    """The policy object `options` name (a fresh one: a doorkeeper's ghost set is its own)."""
    if options.policy == "all":
        return AdmitAll()
    if options.policy == "none":
        return AdmitNone()
    if options.policy == "continuing":
        return Continuing(options.min_history_chunks)
    if options.policy == "second-sight":
        return SecondSight(options.ghost_chunks, options.min_seen_chunks)
    raise ConfigError(f"{SSD_ADMISSION_KEY}.policy must be one of {', '.join(POLICIES)}, got {options.policy!r}")


def make_policy(name: str) -> AdmissionPolicy:
    """The policy `name` with its default options (`kvtier replay --ssd-admission NAME`)."""
    return policy_for(AdmissionOptions.parse({"policy": name}))


def shared_policy(shared: SharedTierOptions | None) -> AdmissionPolicy:
    """The shared tier's write policy (`kvtier.shared.writes`: all | continuing | none, with its
    `min_history_chunks`) as an admission policy object; None options (no shared tier) write all."""
    if shared is None:
        return AdmitAll()
    return policy_for(AdmissionOptions(policy=shared.writes, min_history_chunks=shared.min_history_chunks))
