"""What KV is: the identity a stored chunk carries besides its tokens.

- `identity.request`: a request's identity beyond its token ids (cache salt, LoRA adapter, multimodal inputs,
  prompt embeddings), as vLLM folds it into its own block hashes.
- `identity.model`: the fingerprint of what computed the KV (the weights' content, the model config, the KV dtype,
  the chunk layout and its format version, the tensor-parallel size and rank, the chunk size).
- `identity.namespace`: how a fingerprint names a tier's chunks (the namespace of a tier key), and the report of a
  tier's chunks of other fingerprints.

Plain Python with no vLLM or LMCache import: the connector, the LMCache plugin, the MP-mode L2 adapter, vLLM's
offloading tier and `kvtier check-config` use the same functions (docs/design/identity.md).
"""
