"""The SSD tier: `SSDTier` (`tier`) composes the slot index (`index`, no I/O), the slot I/O (`slot_io`: batched reads
and writes, checksums, the journal), the write queue, the tier directory and slot files, and the POSIX / kvikio I/O
engines. Plain Python, torch and msgspec: no LMCache or vLLM import."""
