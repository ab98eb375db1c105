"""The engine's counters, in one record a benchmark, a stats line or a metrics endpoint reads.

The engine thread writes them; other threads read them (each field is one int, read whole), and copy in the disk
tier's counts (``take_disk``: the tier's own, so every writer writes the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .backend import DiskCounts

__all__ = ["EngineStats"]


@dataclass(slots=True)
class EngineStats:
    """Counters of one engine since it started. Bytes are KV-cache buffer bytes as MLX allocated them."""

    steps: int = 0
    failures: int = 0
    device: str = ""  # where MLX runs it (its name, backend and usable memory)
    # Admission by KV memory (engine/core/memory.py).
    kv_headroom_bytes: int = 0  # what the batch's KV caches may fill (0: no KV admission)
    kv_bytes: int = 0  # KV caches in use after the last step: the batch's plus preempted ones parked
    kv_bytes_peak: int = 0
    kv_reserved_bytes: int = 0  # what the admitted sequences may grow to (the admission estimate)
    rejected_too_large: int = 0  # requests that could never fit (context or headroom): error(bad_request)
    # Priority preemption.
    preemptions: int = 0  # sequences taken out of the batch for a higher-priority request
    resumes: int = 0  # preempted sequences put back with their KV cache (no recomputation)
    recomputes: int = 0  # preempted sequences put back by prefilling prompt + generated tokens again
    started_at_once: int = 0  # requests that outranked a running one or were below their group's share: prefilled alone
    # Steps held for claimed requests on their way (engine/core/engine.py: expect): an idle engine's first, or one
    # beside bulk rows while interactive ones come.
    admission_wait_ms: int = 0
    # Prefix (prompt) cache (engine/mlx/prefix/cache.py).
    prefix_hits: int = 0  # admissions that reused a cached prefix
    prefix_misses: int = 0  # admissions that found none (prompts too short to be worth a lookup not counted)
    prefix_tokens_saved: int = 0  # prompt tokens not prefilled thanks to a hit
    prefix_cache_bytes: int = 0
    prefix_cache_entries: int = 0
    # Its tier on disk (engine/mlx/prefix/disk.py), as of the last sync (it counts on its own threads).
    prefix_disk_hits: int = 0  # entries read from disk for a request
    prefix_disk_misses: int = 0  # requests whose prefix neither memory nor disk held
    prefix_disk_errors: int = 0  # entries unreadable (corrupt): their requests prefilled cold
    prefix_disk_writes: int = 0  # entries written
    prefix_disk_dropped: int = 0  # entries not written: the writer was too far behind (or one too large)
    prefix_disk_bytes: int = 0
    prefix_disk_entries: int = 0
    # Speculative decoding (engine/mlx/speculation/batch.py).
    spec_steps: int = 0  # steps that scored proposals
    spec_drafted: int = 0  # tokens proposed to rows that could take them
    spec_accepted: int = 0  # of those, tokens the target agreed with
    spec_k: int = 0  # tokens proposed per row at the last step (0: it decoded plainly)

    def take_disk(self, disk: DiskCounts) -> None:
        """The disk tier's counters as of now."""
        self.prefix_disk_hits, self.prefix_disk_misses = disk.hits, disk.misses
        self.prefix_disk_errors, self.prefix_disk_writes = disk.errors, disk.writes
        self.prefix_disk_dropped = disk.dropped
        self.prefix_disk_bytes, self.prefix_disk_entries = disk.bytes, disk.entries
