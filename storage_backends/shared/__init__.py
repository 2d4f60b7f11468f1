"""The tier several engines share: LMCache's remote backend (Redis/Valkey/Mooncake) behind kvtier's local tiers,
with health tracking, a bounded write queue and its own metrics (`tier.attach_shared_tier`)."""
