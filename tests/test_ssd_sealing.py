"""Encryption at rest (`kvtier.encryption_key_file`, `storage_backends/ssd/sealing.py`): chunks on disk are
AES-256-GCM ciphertext under a key per tenant, read back bit-exact, authenticated with their tier key; a secret
that is unsafe or too short stops the start; another secret (or none) never decrypts them: they are another
identity's (foreign, reclaimed first); damage is still found by the checksums, and a forged slot (checksums
recomputed) fails authentication: a miss, never wrong bytes."""

from __future__ import annotations

import os
import zlib

import pytest

from kvtier.storage_backends.config import ConfigError
from kvtier.storage_backends.ssd.index import ChunkMeta
from kvtier.storage_backends.ssd.tier import SSDTier

pytestmark = pytest.mark.compat
pytest.importorskip("cryptography")

N = 3 * 4096 + 100  # not page-aligned: the tail goes through the writer's bounce buffer
NS = "m" + "c" * 20


def secret(tmp_path, name: str = "secret", data: bytes | None = None, mode: int = 0o600) -> str:
    p = tmp_path / name
    p.write_bytes(os.urandom(32) if data is None else data)
    os.chmod(p, mode)
    return str(p)


def chunk(key: str) -> bytes:
    return (f"PLAINTEXT-{key}-".encode() * (N // 12 + 1))[:N]


def put(t: SSDTier, keys: list[str]) -> None:
    for k in keys:
        assert t.submit_put(k, ChunkMeta(N, (N,), "uint8", "raw"), memoryview(bytearray(chunk(k))), lambda ok: None)
    assert t.flush(10)


def read(t: SSDTier, key: str) -> bytes | None:
    buf = bytearray(N)
    return bytes(buf) if t.read_batch([key], lambda k, m: (memoryview(buf), 1), lambda h: None)[0] else None


def disk_bytes(t: SSDTier) -> bytes:
    return b"".join(open(os.path.join(t.directory, f), "rb").read() for f in sorted(os.listdir(t.directory))
                    if f.startswith("slots-"))


TENANT_A = "lmodel@1@0@1f@bfloat16@kvtier_id%" + "a" * 32
TENANT_B = "lmodel@1@0@1f@bfloat16@kvtier_id%" + "b" * 32


def test_sealed_chunks_read_back_bit_exact_and_never_lie_in_the_clear(tier_config, tmp_path):
    cfg = tier_config(encryption_key_file=secret(tmp_path))
    t = SSDTier(cfg, N, namespace=NS)
    try:
        put(t, [TENANT_A, TENANT_B, "plain@1@0@2f@bfloat16"])
        for k in (TENANT_A, TENANT_B, "plain@1@0@2f@bfloat16"):
            assert read(t, k) == chunk(k)
        assert b"PLAINTEXT" not in disk_bytes(t)
        e = t.entry(TENANT_A)
        assert set(e.meta.extra) == {"sealed"} and t.stats.hits == 3
    finally:
        t.close()
    t = SSDTier(cfg, N, namespace=NS)  # a restart with the same secret: every chunk, decrypted
    try:
        assert sorted(t.keys()) == sorted([TENANT_A, TENANT_B, "plain@1@0@2f@bfloat16"])
        assert read(t, TENANT_B) == chunk(TENANT_B)
    finally:
        t.close()


def test_each_tenant_has_its_own_key(tier_config, tmp_path):
    cfg = tier_config(encryption_key_file=secret(tmp_path))
    t = SSDTier(cfg, N, namespace=NS)
    try:
        put(t, [TENANT_A])
        e = t.entry(TENANT_A)
        buf = bytearray(N)
        assert t.read_batch([TENANT_A], lambda k, m: (memoryview(buf), 1), lambda h: None)[0]
        sealer, qa = t.sealer, t.namespace.qualify(TENANT_A)
        sealed = bytearray(N)
        raw_meta = ChunkMeta(N, (N,), "uint8", "raw")
        meta, data = sealer.seal(qa, raw_meta, memoryview(bytearray(chunk(TENANT_A))))
        sealed[:] = data
        assert sealer.open(qa, meta, memoryview(sealed)) and bytes(sealed) == chunk(TENANT_A)
        # the same ciphertext, the tag and nonce, opened as tenant B's key: fails
        meta, data = sealer.seal(qa, raw_meta, memoryview(bytearray(chunk(TENANT_A))))
        as_b = bytearray(data)
        assert not sealer.open(t.namespace.qualify(TENANT_B), meta, memoryview(as_b))
        assert sealer._key(qa) != sealer._key(t.namespace.qualify(TENANT_B))
        assert e is not None
    finally:
        t.close()


def test_another_secret_or_none_never_decrypts_and_reclaims_first(tier_config, tmp_path):
    one, two = secret(tmp_path, "one"), secret(tmp_path, "two")
    t = SSDTier(tier_config(encryption_key_file=one), N, namespace=NS)
    put(t, [TENANT_A, TENANT_B])
    t.close()
    for cfg in (tier_config(encryption_key_file=two), tier_config()):
        t = SSDTier(cfg, N, namespace=NS)
        try:
            assert t.keys() == [] and t.foreign_chunks() == 2 and read(t, TENANT_A) is None
        finally:
            t.close()
    t = SSDTier(tier_config(), N, namespace=NS)  # without the secret: chunks stored in the clear, apart
    try:
        put(t, [TENANT_A])
        assert read(t, TENANT_A) == chunk(TENANT_A) and t.foreign_chunks() == 2
    finally:
        t.close()


def test_a_forged_slot_fails_authentication_damage_fails_its_checksum(tier_config, tmp_path):
    from kvtier.storage_backends.ssd.slot_format import HEADER_SIZE, decode_header, encode_header

    cfg = tier_config(encryption_key_file=secret(tmp_path), o_direct=False)
    t = SSDTier(cfg, N, namespace=NS)
    try:
        put(t, [TENANT_A, TENANT_B])
        for key, forge in ((TENANT_A, True), (TENANT_B, False)):
            path, base = t.io.files.locate_path(t.entry(key).slot)
            with open(path, "r+b") as f:
                f.seek(base)
                hdr = decode_header(memoryview(f.read(HEADER_SIZE)))
                f.seek(base + HEADER_SIZE + 10)
                b = f.read(1)
                f.seek(base + HEADER_SIZE + 10)
                f.write(bytes([b[0] ^ 1]))
                if forge:  # the checksums recomputed over the changed ciphertext: only the AEAD tag can tell
                    f.seek(base + HEADER_SIZE)
                    data = f.read(hdr.nbytes)
                    crcs = tuple(zlib.crc32(data[lo:lo + hdr.seg]) for lo in range(0, hdr.nbytes, hdr.seg))
                    out = bytearray(HEADER_SIZE)
                    from kvtier.storage_backends.ssd.slot_format import SlotHeader

                    encode_header(SlotHeader(hdr.version, hdr.key, hdr.gen, hdr.nbytes, hdr.shape, hdr.dtype, hdr.fmt,
                                             hdr.seg, crcs, hdr.extra), memoryview(out))
                    f.seek(base)
                    f.write(out)
        assert read(t, TENANT_A) is None and read(t, TENANT_B) is None
        assert t.stats.corrupt == 2 and not t.contains(TENANT_A) and not t.contains(TENANT_B)
    finally:
        t.close()


@pytest.mark.parametrize("how, message", [
    ("short", "holds 16 bytes"), ("mode", "readable or writable by others"), ("link", "cannot open"),
    ("missing", "cannot open")])
def test_an_unsafe_secret_stops_the_start_naming_the_key(tier_config, tmp_path, how, message):
    if how == "short":
        path = secret(tmp_path, data=os.urandom(16))
    elif how == "mode":
        path = secret(tmp_path, mode=0o644)
    elif how == "link":
        os.symlink(secret(tmp_path), tmp_path / "link")
        path = str(tmp_path / "link")
    else:
        path = str(tmp_path / "nothing")
    with pytest.raises(ConfigError, match=f"kvtier.encryption_key_file: .*{message}"):
        tier_config(encryption_key_file=path)
