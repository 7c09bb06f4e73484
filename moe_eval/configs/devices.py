"""The devices a run may hand to its servers: free GPUs, or CPU cores, and how many each config needs.

A config needs `layout.world_size` GPUs (one per rank), or on the CPU build one core per rank at
least. `run --jobs 1` keeps today's behaviour: each server may use the whole machine (devices
None). With more jobs, servers get disjoint device sets: GPU ids that no other process is using,
or an equal share of this process's CPU cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from moe_eval.configs.hardware import nvidia_smi, visible_devices

BUSY_MEMORY_MIB = 1024  # a GPU with more memory in use than this belongs to someone else


@dataclass(frozen=True)
class DevicePool:
    kind: str  # "gpu" or "cpu"
    ids: tuple[int, ...]  # GPU indices (nvidia-smi's) or CPU core numbers
    busy: tuple[int, ...] = ()  # GPUs left out because another process uses them

    def units_for(self, world_size: int, jobs: int | None) -> int:
        """Devices one config gets: its ranks' GPUs; on the CPU at least a core per rank, and an
        equal share of the cores when `jobs` servers run at once (None: auto, a core per rank)."""
        if self.kind == "gpu" or jobs is None:
            return world_size
        return max(world_size, len(self.ids) // max(jobs, 1))


def gpu_pool() -> DevicePool:
    """GPUs nobody is using (no compute process on them, little memory in use), among CUDA_VISIBLE_DEVICES."""
    rows = nvidia_smi(["--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits"])
    apps = set(nvidia_smi(["--query-compute-apps=gpu_uuid", "--format=csv,noheader"]))
    allowed = visible_devices()
    free: list[int] = []
    busy: list[int] = []
    for row in rows:
        index, uuid, used = (part.strip() for part in row.split(","))
        if allowed is not None and index not in allowed and uuid not in allowed:
            continue
        is_busy = uuid in apps or (used.isdigit() and int(used) > BUSY_MEMORY_MIB)
        (busy if is_busy else free).append(int(index))
    return DevicePool("gpu", tuple(free), tuple(busy))


def cpu_pool() -> DevicePool:
    return DevicePool("cpu", tuple(sorted(os.sched_getaffinity(0))))
