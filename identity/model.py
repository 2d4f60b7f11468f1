"""The fingerprint of what computed a chunk's KV: changed weights, config, KV dtype, layout, parallelism or chunk
size mean misses, never old KV.

`ModelFingerprint` holds the parts and their digest (`namespace`): every persistent key a tier writes carries it
(`identity.namespace`), so chunks of any other fingerprint are never found. Parts:

- weights: a content fingerprint of the weight files (`weights_identity`), not their path or modification time:
  - files in a Hugging Face cache snapshot are links to blobs named by the SHA-256 of their content: that name
    is the file's fingerprint (exact, free);
  - other `.safetensors` files: the header (every tensor's name, dtype, shape and offsets) plus 256 bytes at the
    start, middle and end of every tensor's data (a fine-tune changes every tensor it touches throughout);
  - other weight files: 64 windows of 4 KiB spread over the file, plus its first and last 64 KiB;
  - always every file's name and size. A few MB read per model, once at start.
  An operator may instead declare the weights' identity (`kvtier.model_identity`): builds that declare the same
  name share KV (the other parts must still agree), e.g. a checkpoint copied or re-saved without changes, or a
  change the sampling cannot see.
- config: a digest of the model config (config.json, or the engine's effective config), without the keys that
  name paths or library versions;
- compute: what the engine computes with besides the weights (vLLM's dtype and quantization), where known;
- kv_dtype, layout (chunk format, page size, kvtier's KV format version), chunk tokens, tp_size and tp_rank.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.identity.request import digest

logger = logging.getLogger(__name__)

__all__ = ["KV_FORMAT_VERSION", "ModelFingerprint", "WeightsIdentity", "config_digest", "files_fingerprint",
           "weights_identity"]

#: kvtier's KV chunk format version: bumped when the bytes of a chunk mean something else for the same layout
KV_FORMAT_VERSION = 1
#: model names that already are a fingerprint (the connector names its LMCache engine's model so)
FINGERPRINT_PREFIX = "kvtier-fp-"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz", ".msgpack", ".h5")
_TENSOR_SAMPLE = 256
_WINDOWS, _WINDOW = 64, 4096
_EDGE = 64 << 10
#: config keys that name where or with what a config was saved, not what the model computes
_CONFIG_NOISE = ("transformers_version", "_name_or_path", "name_or_path", "_commit_hash", "torch_dtype_str")


@dataclass(frozen=True)
class WeightsIdentity:
    """`source`: files (sampled content), hub (blob hashes of a Hugging Face cache), declared
    (`kvtier.model_identity`), connector (a name the kvtier connector made from a fingerprint) or name (nothing
    readable: the model's name alone, logged as a warning)."""

    source: str
    digest: str
    files: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        if self.source in ("files", "hub"):
            how = "blob hashes" if self.source == "hub" else "sampled content"
            return f"{self.digest[:12]} ({self.files} files, {self.nbytes / (1 << 30):.2f} GiB, {how})"
        return f"{self.digest[:12]} ({self.source})"


def files_fingerprint(path: str) -> WeightsIdentity:
    """The content fingerprint of the weight files under a directory (or of one weight file)."""
    t0 = time.perf_counter()
    root = os.path.abspath(path)
    if os.path.isfile(root):
        files = [root]
        root = os.path.dirname(root)
    else:
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(root, followlinks=True) for f in names
                       if f.endswith(WEIGHT_SUFFIXES))
    h = hashlib.blake2b(digest_size=16)
    hub = bool(files)
    total = 0
    for f in files:
        size = os.path.getsize(f)
        total += size
        h.update(f"{os.path.relpath(f, root)}\0{size}\0".encode("utf-8", "surrogatepass"))
        blob = _blob_hash(f)
        if blob is not None:
            h.update(b"blob\0" + blob.encode())
            continue
        hub = False
        h.update(_sample(f, size))
    return WeightsIdentity("hub" if hub else "files", h.hexdigest(), len(files), total, time.perf_counter() - t0)


def _blob_hash(path: str) -> str | None:
    """The content hash a Hugging Face cache names a file's blob by (None: not such a file)."""
    if not os.path.islink(path):
        return None
    real = os.path.realpath(path)
    name = os.path.basename(real)
    if os.path.basename(os.path.dirname(real)) == "blobs" and len(name) in (40, 64) and \
            all(c in "0123456789abcdef" for c in name):
        return name
    return None


def _sample(path: str, size: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        if path.endswith(".safetensors") and size >= 8:
            (n,) = struct.unpack("<Q", f.read(8))
            if 0 < n <= min(size - 8, 100 << 20):
                header = f.read(n)
                h.update(header)
                try:
                    tensors = json.loads(header)
                except ValueError:
                    tensors = None
                if isinstance(tensors, dict):
                    base = 8 + n
                    spans = sorted(tuple(v["data_offsets"]) for k, v in tensors.items()
                                   if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v)
                    for lo, hi in spans:
                        for at in (lo, (lo + hi) // 2 - _TENSOR_SAMPLE // 2, hi - _TENSOR_SAMPLE):
                            at = max(lo, at)
                            f.seek(base + at)
                            h.update(f.read(max(0, min(_TENSOR_SAMPLE, hi - at))))
                    return h.digest()
            f.seek(0)
        for at in [0, max(0, size - _EDGE)] + [size * i // _WINDOWS for i in range(1, _WINDOWS)]:
            f.seek(at)
            h.update(f.read(_EDGE if at in (0, max(0, size - _EDGE)) else _WINDOW))
    return h.digest()


def _hub_snapshot(model: str, revision: str | None) -> str | None:
    """The local snapshot directory of a Hugging Face model id in the cache (no network), or None."""
    if model.count("/") > 1 or not model or model.startswith((".", "/")):
        return None
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return snapshot_download(repo_id=model, revision=revision, local_files_only=True)
    except Exception:  # not in the cache, or not a repository id
        return None


def weights_identity(model: str, declared: str = "", revision: str | None = None) -> WeightsIdentity:
    """The identity of a model's weights: `declared` if given, else the content of its files (a local path, or
    a Hugging Face id found in the local cache), else its name (logged: a model updated under the same name is
    then not noticed)."""
    if model.startswith(FINGERPRINT_PREFIX):  # the connector's own fingerprint (declared identity included)
        return WeightsIdentity("connector", model[len(FINGERPRINT_PREFIX):])
    if declared:
        return WeightsIdentity("declared", digest(["declared", declared]))
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        path = _hub_snapshot(model, revision) or ""
    if path and os.path.exists(path):
        ident = files_fingerprint(path)
        if ident.files:
            return ident
        logger.warning("kvtier: no weight files (%s) under %s: the KV identity names the model by its config and "
                       "name only; set kvtier.model_identity to name its weights", ", ".join(WEIGHT_SUFFIXES), path)
        return WeightsIdentity("name", digest(["name", model]))
    logger.warning("kvtier: the weights of %r cannot be read here (neither a local path nor in the Hugging Face "
                   "cache): the KV identity names the model by its name only, so new weights under the same name "
                   "would not be noticed; set kvtier.model_identity to name them", model)
    return WeightsIdentity("name", digest(["name", model]))


def config_digest(config: Mapping[str, Any] | None) -> str:
    """A digest of a model config (a dict, e.g. config.json), without keys naming paths or library versions."""
    if not config:
        return ""
    clean = {k: v for k, v in config.items() if k not in _CONFIG_NOISE and not str(k).startswith("_")}
    return digest(json.loads(json.dumps(clean, sort_keys=True, default=str)))


def read_config(model: str, revision: str | None = None) -> dict[str, Any] | None:
    """config.json of a local model directory or of a cached Hugging Face snapshot (None: none readable)."""
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        path = _hub_snapshot(model, revision) or ""
    if os.path.isfile(path):
        path = os.path.dirname(path)
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            out = json.load(f)
        return out if isinstance(out, dict) else None
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class ModelFingerprint:
    weights: WeightsIdentity
    config: str
    kv_dtype: str
    layout: str
    chunk_tokens: int
    tp_size: int
    tp_rank: int  #: -1: the chunk holds every rank's share (vLLM's offloading tier)
    compute: Mapping[str, str] = field(default_factory=dict)
    format_version: int = KV_FORMAT_VERSION

    def parts(self) -> dict[str, Any]:
        return {"weights": f"{self.weights.source}:{self.weights.digest}", "config": self.config,
                "compute": dict(sorted(self.compute.items())), "kv_dtype": self.kv_dtype, "layout": self.layout,
                "format": self.format_version, "chunk_tokens": self.chunk_tokens, "tp_size": self.tp_size,
                "tp_rank": self.tp_rank}

    @property
    def digest(self) -> str:
        """20 hex digits over every part."""
        return digest(self.parts())[:20]

    @property
    def namespace(self) -> str:
        """The namespace of this fingerprint's chunks in a tier (`identity.namespace`)."""
        return "m" + self.digest

    def describe(self) -> str:
        compute = ", ".join(f"{k} {v}" for k, v in sorted(self.compute.items()))
        rank = "all ranks" if self.tp_rank < 0 else f"rank {self.tp_rank}"
        return (f"{self.namespace}: weights {self.weights.describe()}, config {self.config[:12] or 'unknown'}"
                f"{', ' + compute if compute else ''}, KV {self.kv_dtype}, layout {self.layout} "
                f"v{self.format_version}, chunk {self.chunk_tokens} tokens, TP {self.tp_size} ({rank})")
