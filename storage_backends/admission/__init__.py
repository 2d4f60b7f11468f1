"""Write admission of kvtier's tiers (plain Python, no vLLM or LMCache import): which chunks are worth writing to the
SSD tier (`kvtier.ssd_admission`) and to the shared tier (`kvtier.shared.writes`), one policy object per rule.
The contract is `base.AdmissionPolicy`; `config.policy_for` builds one from its options."""

from kvtier.storage_backends.admission.base import AdmissionPolicy, AdmissionQuery, Decision

__all__ = ["AdmissionPolicy", "AdmissionQuery", "Decision"]
