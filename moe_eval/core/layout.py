"""Parallel layouts (TP, TEP, DEP), derived from a vLLM server's arguments.

The layout decides how many GPUs a config needs and how the experts of a layer are split
across ranks; the harness, the reports and the kernel oracle all name it the same way.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LayoutKind(str, enum.Enum):
    TP = "TP"  # tensor parallel: every rank holds a slice of every expert
    TEP = "TEP"  # tensor parallel + expert parallel: every rank holds whole experts, E / ranks of them
    DEP = "DEP"  # data parallel + expert parallel: own tokens per rank, experts split across ranks


@dataclass(frozen=True)
class Layout:
    kind: LayoutKind
    tensor_parallel: int = 1
    data_parallel: int = 1
    pipeline_parallel: int = 1

    @property
    def world_size(self) -> int:
        """Devices (GPUs, or CPU ranks on the CPU build) one server needs."""
        return self.tensor_parallel * self.data_parallel * self.pipeline_parallel

    @property
    def expert_parallel(self) -> bool:
        return self.kind in (LayoutKind.TEP, LayoutKind.DEP)

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the experts of one layer are split over (1 when experts are not split)."""
        if not self.expert_parallel:
            return 1
        return self.tensor_parallel * self.data_parallel

    def describe(self) -> str:
        parts = [f"TP{self.tensor_parallel}"]
        if self.data_parallel > 1:
            parts.append(f"DP{self.data_parallel}")
        if self.pipeline_parallel > 1:
            parts.append(f"PP{self.pipeline_parallel}")
        if self.expert_parallel:
            parts.append(f"EP{self.expert_parallel_size}")
        return f"{self.kind.value} ({' '.join(parts)})"


def _int_flag(args: list[str], names: tuple[str, ...], default: int) -> int:
    """Value of the last occurrence of any of `names`, as `--flag N` or `--flag=N`."""
    value = default
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                value = int(args[i + 1])
            elif arg.startswith(name + "="):
                value = int(arg.split("=", 1)[1])
    return value


def layout_from_server_args(args: list[str]) -> Layout:
    """Derive the layout from vLLM server arguments (already shell-split).

    Raises ValueError for a parallel size that is not a positive integer.
    """
    try:
        tp = _int_flag(args, ("--tensor-parallel-size", "-tp"), 1)
        dp = _int_flag(args, ("--data-parallel-size", "-dp"), 1)
        pp = _int_flag(args, ("--pipeline-parallel-size", "-pp"), 1)
    except ValueError as exc:
        raise ValueError(f"parallel size is not an integer: {exc}") from None
    for name, size in (("tensor", tp), ("data", dp), ("pipeline", pp)):
        if size < 1:
            raise ValueError(f"--{name}-parallel-size must be >= 1, got {size}")
    ep = any(a in ("--enable-expert-parallel", "-ep") for a in args)
    if ep and dp > 1:
        kind = LayoutKind.DEP
    elif ep and tp > 1:
        kind = LayoutKind.TEP
    else:
        # EP over a single rank splits nothing; vLLM then behaves as TP (or plain DP replicas).
        kind = LayoutKind.TP
    return Layout(kind=kind, tensor_parallel=tp, data_parallel=dp, pipeline_parallel=pp)
