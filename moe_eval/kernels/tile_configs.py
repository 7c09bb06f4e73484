"""Tile configs of the Triton fused MoE: tuned JSON per (local experts, F, D, device), else a default.

A tuned file is `tuned_configs/E=<e>,F=<F>,D=<D>,device=<GPU name, spaces as _>.json`, written by
`benchmarks/tune_fused_moe.py`. E in the name is the number of experts this rank holds (the
shape the kernel sees): Qwen3-30B-A3B at EP2 is `E=64`. A call with T tokens takes the entry
whose M is nearest to T on a log scale (the grid is geometric, 1 ... 16384), logged once per file;
with no file the default heuristic is used, with a warning once per shape.

MOE_EVAL_TUNED_DIR (a folder of such files) is searched first: a kernel engineer serves a fresh tuning,
or another valid tile set (a different accumulation order), without editing the package. Set it in a
config's `env:` or the environment of `moe-eval run` (servers inherit it; results.json records it).

Usage: `cfg = get_tile_config(num_tokens=T, num_experts=e, F=F, D=D, top_k=K, device_name=name)`.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

log = logging.getLogger(__name__)

TUNED_DIR = Path(__file__).parent / "tuned_configs"
TUNED_DIR_ENV = "MOE_EVAL_TUNED_DIR"


# Hopper allows 227 KiB (232448 bytes) of shared memory per block, and Triton 3.6 allocates
# num_stages tiles of A and B (seen on the H200: "Required: 245760" for 3 stages of 80 KiB;
# triton 3.9's offline sm_90 compile allocated num_stages - 1): the larger count is assumed.
SMEM_LIMIT = 232448


@dataclass(frozen=True)
class GemmTile:
    """One GEMM's tiling. BLOCK_M is shared by both GEMMs (it is the alignment's block size).

    group_m: GROUP_M swizzle width (a runtime argument: no recompile per value).
    interleave (GEMM1 only): gate and up rows interleaved into one [BLOCK_K, 2*BLOCK_N] weight
    tile and one tl.dot of width 2*BLOCK_N, instead of two tl.dots of width BLOCK_N.
    tma (GEMM2 only, aligned plans): both operands loaded through TMA descriptors instead of
    pointer loads (cp.async); needs F * itemsize and D * F * itemsize to be multiples of 16 bytes.
    persistent (aligned plans; the prefill path): one program per SM walks the (M-block, N-tile)
    work items of the blocks in use, the weight tiles come by TMA (GEMM2: needs tma, both operands),
    and the loop is software-pipelined across work items. warp_specialize (needs persistent):
    Triton's producer / consumer warp groups instead of that cross-item pipelining.
    """

    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    interleave: bool = False
    tma: bool = False
    persistent: bool = False
    warp_specialize: bool = False

    FLAGS = ("interleave", "tma", "persistent", "warp_specialize")

    def __post_init__(self) -> None:
        if self.warp_specialize and not self.persistent:
            raise ValueError("warp_specialize needs persistent (it specialises the persistent loop's warps)")

    @classmethod
    def from_json(cls, data: dict) -> GemmTile:
        _check_keys(data, {f for f in cls.__dataclass_fields__}, "GemmTile")
        return cls(**{k: (bool(v) if k in cls.FLAGS else int(v)) for k, v in data.items()})

    def stage_bytes(self, block_m: int, b_tiles: int, itemsize: int = 2) -> int:
        """Shared memory of one pipeline stage: the A tile and `b_tiles` weight tiles of BLOCK_N columns."""
        return (block_m * self.block_k + b_tiles * self.block_k * self.block_n) * itemsize

    def shared_bytes(self, block_m: int, b_tiles: int, itemsize: int = 2, stages: int | None = None) -> int:
        """Shared memory of the GEMM: its pipeline stages, and for a persistent tile the epilogue's
        buffer (GEMM1: the h tile staged for its TMA store; GEMM2: half that, the output's layout
        change) and barriers. Measured with triton 3.6 for sm_90 (benchmarks/aot_sm90.py): GEMM1
        128 x (2 x 128) x 64, 4 stages: 229408 bytes = 196608 + 32800; GEMM2 128 x 256 x 64, 4
        stages: 229408, warp-specialized 229608."""
        stages = self.num_stages if stages is None else stages
        total = stages * self.stage_bytes(block_m, b_tiles, itemsize)
        if self.persistent:
            total += block_m * self.block_n * itemsize // (1 if b_tiles == 2 else 2) + 1024
        return total


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclass(frozen=True)
class GemvTiles:
    """The decode path (`MoeTileConfig.gemv`): both GEMMs as GEMVs, without tl.dot.

    Each GemmTile reads as it does for the GEMMs, with N the outputs and K the reduction:
    gemm1.block_n F rows of gate and of up per program, gemm1.block_k the step over D; gemm2.block_n
    D rows of the output per program (times the K slots it sums), gemm2.block_k the step over F.
    num_warps as usual; num_stages > 1 software-pipelines the reduction loop's loads
    (`tl.range(num_stages=)`, which Triton applies to loads without a tl.dot only when asked), 1 leaves
    it plain. group_m and the flags mean nothing to a GEMV and must keep their defaults.
    pdl: GEMM2 is launched as a programmatic dependent of GEMM1 (sm_90+, where Triton has the launch
    option): its programs start while GEMM1's last ones run and load their first weight step before
    they wait for h. Where the device or Triton lacks it (the interpreter) the same kernels run
    without it.
    """

    gemm1: GemmTile
    gemm2: GemmTile
    pdl: bool = False

    def __post_init__(self) -> None:
        for name, tile in (("gemm1", self.gemm1), ("gemm2", self.gemm2)):
            if any(getattr(tile, flag) for flag in GemmTile.FLAGS) or tile.group_m != 1:
                raise ValueError(f"gemv.{name}: group_m and {GemmTile.FLAGS} mean nothing to a GEMV ({tile})")
            if not (_power_of_two(tile.block_n) and _power_of_two(tile.block_k)):
                raise ValueError(f"gemv.{name}: block sizes must be powers of two (tl.arange), got {tile}")

    def to_json(self) -> dict:
        return {"gemm1": asdict(self.gemm1), "gemm2": asdict(self.gemm2), "pdl": self.pdl}

    @classmethod
    def from_json(cls, data: dict) -> GemvTiles:
        _check_keys(data, {"gemm1", "gemm2", "pdl"}, "GemvTiles")
        missing = {"gemm1", "gemm2"} - set(data)
        if missing:
            raise ValueError(f"GemvTiles: missing keys {sorted(missing)}")
        pdl = data.get("pdl", False)
        if not isinstance(pdl, bool):
            raise ValueError(f"GemvTiles: pdl must be true or false, got {pdl!r}")
        return cls(GemmTile.from_json(data["gemm1"]), GemmTile.from_json(data["gemm2"]), pdl)


@dataclass(frozen=True)
class MoeTileConfig:
    """Both GEMMs' tiles and the slot assignment.

    naive: calls that `fused_moe.naive_qualifies` (one token, or T*K*4 <= e) skip the alignment
    and run one M-block per slot. fold_k (needs naive): on those calls GEMM2 sums each token's K
    slots itself, in a fixed order, instead of a separate sum launch.
    gemv (needs naive): on those calls both GEMMs run as GEMVs instead (`GemvTiles`; GEMM2 always
    sums the K slots itself, so fold_k stays False); the calls that do not qualify run the aligned
    GEMMs with gemm1 / gemm2 as before.
    pdl (not with gemv, which has its own; the pointer GEMMs only, neither persistent nor tma): GEMM1,
    GEMM2 and the sum are launched as programmatic dependents (sm_90+), each of the launch before it: each
    is put on the SMs while that launch finishes and waits for it (griddepcontrol.wait) before reading
    anything. On aligned calls GEMM1 follows the alignment, which lets it on at its start. The same
    kernels, the same bits; a decode call's launch gaps go, but where GEMM1's grid is more than a wave
    GEMM2's early programs crowd it (slower at Mixtral's naive M = 1 on the H200), so a file asks for it
    only where it measured faster. Where the device or Triton lacks it they run without.
    sum_in_gemm2 (the pointer GEMMs only; issue 56): on aligned calls with K > 1 the
    program of GEMM2 that stores a token's last slot of an N-tile adds the token's K rows there, in slot
    order, in fp32, rounded once (`_moe_sum_kernel`'s arithmetic, so the same bits), instead of a sum
    launch after GEMM2: one launch fewer, no atomics on the values (a counter per token and N-tile,
    zeroed by GEMM1, says which program is last; under an expert map a token counts its slots held here,
    and GEMM1 zeroes the output for the tokens with none). Naive calls keep their own plan (fold_k, or
    the sum launch).
    """

    block_m: int
    gemm1: GemmTile
    gemm2: GemmTile
    naive: bool = False
    fold_k: bool = False
    gemv: GemvTiles | None = None
    pdl: bool = False
    sum_in_gemm2: bool = False

    def __post_init__(self) -> None:
        # A field the code would ignore is an error (house style).
        if self.gemv is not None and not self.naive:
            raise ValueError("gemv needs naive: the GEMVs run on the calls that skip the alignment")
        if self.pdl and self.gemv is not None:
            raise ValueError("pdl is the tl.dot chains'; a gemv config says it in gemv.pdl")
        if self.pdl and not self.pdl_capable:
            raise ValueError("pdl needs the pointer GEMMs: the persistent and tma kernels have no wait")
        if self.sum_in_gemm2 and (self.gemm1.persistent or self.gemm2.persistent or self.gemm2.tma):
            raise ValueError(
                "sum_in_gemm2 needs the pointer GEMMs: GEMM1 zeroes the counters, GEMM2 counts in and sums"
            )
        if self.gemv is not None and self.fold_k:
            raise ValueError(
                "gemv always sums over K in its GEMM2; fold_k (the tl.dot GEMM2's) would be ignored"
            )
        if self.gemm2.interleave:
            raise ValueError("interleave is GEMM1's (gate and up tiles); GEMM2 has one weight tile")
        if self.fold_k and not self.naive:
            raise ValueError(
                "fold_k needs naive: GEMM2 sums a token's slots only when each block is one slot"
            )
        if self.gemm1.tma:
            raise ValueError("tma is GEMM2's: GEMM1 gathers token rows, which a Hopper TMA cannot load")
        if self.gemm2.tma and self.naive:
            raise ValueError("tma needs aligned plans (a naive block's rows are one slot and padding)")
        if self.naive and (self.gemm1.persistent or self.gemm2.persistent):
            raise ValueError("persistent needs aligned plans (its work items are the aligned M-blocks)")
        if self.gemm2.persistent and not self.gemm2.tma:
            raise ValueError("gemm2.persistent loads both operands by TMA: set gemm2.tma too")

    @property
    def pdl_capable(self) -> bool:
        """The tl.dot chain whose kernels have the grid-dependency wait: no GEMVs (they carry their own
        pdl), neither GEMM persistent, GEMM2 not by TMA. Where `pdl` may be asked for."""
        return self.gemv is None and not (self.gemm1.persistent or self.gemm2.persistent or self.gemm2.tma)

    def shared_memory(self, itemsize: int = 2) -> tuple[int, int]:
        """Bytes of shared memory (GEMM1, GEMM2) as Triton 3.6 allocates them (num_stages stages)."""
        return self.gemm1.shared_bytes(self.block_m, 2, itemsize), self.gemm2.shared_bytes(
            self.block_m, 1, itemsize
        )

    def to_json(self) -> dict:
        body = {"block_m": self.block_m, "gemm1": asdict(self.gemm1), "gemm2": asdict(self.gemm2),
                "naive": self.naive, "fold_k": self.fold_k}  # fmt: skip
        if self.gemv is not None:  # only when set: files written before it stay byte for byte
            body["gemv"] = self.gemv.to_json()
        if self.pdl:  # the same
            body["pdl"] = True
        if self.sum_in_gemm2:  # the same
            body["sum_in_gemm2"] = True
        return body

    @classmethod
    def from_json(cls, data: dict) -> MoeTileConfig:
        _check_keys(
            data,
            {"block_m", "gemm1", "gemm2", "naive", "fold_k", "gemv", "pdl", "sum_in_gemm2"},
            "MoeTileConfig",
        )
        for flag in ("pdl", "sum_in_gemm2"):
            if not isinstance(data.get(flag, False), bool):
                raise ValueError(f"MoeTileConfig: {flag} must be true or false, got {data[flag]!r}")
        return cls(
            block_m=int(data["block_m"]),
            gemm1=GemmTile.from_json(data["gemm1"]),
            gemm2=GemmTile.from_json(data["gemm2"]),
            naive=bool(data.get("naive", False)),
            fold_k=bool(data.get("fold_k", False)),
            # Absent or null: no GEMV; anything else must be whole GemvTiles ({} is an error, not "off").
            gemv=GemvTiles.from_json(data["gemv"]) if data.get("gemv") is not None else None,
            pdl=data.get("pdl", False),
            sum_in_gemm2=data.get("sum_in_gemm2", False),
        )


def fit_shared_memory(config: MoeTileConfig, itemsize: int) -> MoeTileConfig:
    """The config with fewer pipeline stages where `itemsize`-byte operands would not fit (fp32 on
    tiles tuned for bf16); unchanged when they fit (always at 2 bytes for the shipped files)."""
    tiles = []
    for tile, b_tiles in ((config.gemm1, 2), (config.gemm2, 1)):
        stages = tile.num_stages
        while stages > 1 and tile.shared_bytes(config.block_m, b_tiles, itemsize, stages) > SMEM_LIMIT:
            stages -= 1
        tiles.append(tile if stages == tile.num_stages else replace(tile, num_stages=stages))
    if tiles == [config.gemm1, config.gemm2]:
        return config
    return replace(config, gemm1=tiles[0], gemm2=tiles[1])


def _check_keys(data: dict, allowed: set[str], what: str) -> None:
    # A key the code ignores is an error (house style): a typo must not silently use a default.
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"{what}: unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")


def device_tag(device_name: str) -> str:
    return device_name.strip().replace(" ", "_")


def config_file_name(num_experts: int, F: int, D: int, device_name: str) -> str:
    return f"E={num_experts},F={F},D={D},device={device_tag(device_name)}.json"


def write_tuned_file(path: Path, configs: dict[int, MoeTileConfig], meta: dict) -> None:
    body = {"meta": meta, "configs": {str(m): configs[m].to_json() for m in sorted(configs)}}
    path.write_text(json.dumps(body, indent=1, sort_keys=False) + "\n")


def read_tuned_file(path: Path) -> dict[int, MoeTileConfig]:
    body = json.loads(path.read_text())
    _check_keys(body, {"meta", "configs"}, path.name)
    configs = {int(m): MoeTileConfig.from_json(c) for m, c in body["configs"].items()}
    if not configs:
        raise ValueError(f"{path}: no configs")
    return configs


def tuned_file_path(num_experts: int, F: int, D: int, device_name: str) -> Path:
    """The tuned file a shape reads: MOE_EVAL_TUNED_DIR's when that folder has one, else the package's."""
    name = config_file_name(num_experts, F, D, device_name)
    override = os.environ.get(TUNED_DIR_ENV)
    if override:
        if not Path(override).is_dir():
            raise FileNotFoundError(f"{TUNED_DIR_ENV}={override}: not a folder")
        if (Path(override) / name).is_file():
            return Path(override) / name
    return TUNED_DIR / name


def tile_source(num_experts: int, F: int, D: int, device_name: str) -> dict[str, str | None]:
    """Where a shape's tiles come from on this GPU, for the record: the tuned file it reads, or the default
    heuristic when this GPU has none (the shipped files are the H200's, and the H100's for the seven per-rank
    shapes of the shipped configs: the H200's tiles, Qwen3's decode sizes tuned there; docs/perf.md)."""
    path = tuned_file_path(num_experts, F, D, device_name)
    if path.is_file():
        return {"source": "tuned file", "file": str(path)}
    return {"source": f"default heuristic: no tuned file for {device_name}", "file": None}


@functools.cache
def _tuned(num_experts: int, F: int, D: int, device_name: str) -> dict[int, MoeTileConfig] | None:
    path = tuned_file_path(num_experts, F, D, device_name)
    if not path.is_file():
        log.warning(
            "fused_moe: no tuned tile configs for e=%d F=%d D=%d on %s (%s); using the default heuristic",
            num_experts,
            F,
            D,
            device_name,
            path.name,
        )
        return None
    configs = read_tuned_file(path)
    log.info("fused_moe: tile configs from %s (M = %s)", path, sorted(configs))
    return configs


def nearest_m(available: list[int], num_tokens: int) -> int:
    """Nearest tuned M on a log2 scale; ties go to the smaller M (fewer rows, smaller blocks)."""
    target = math.log2(max(num_tokens, 1))
    return min(sorted(available), key=lambda m: abs(math.log2(max(m, 1)) - target))


# Elements of the weight tile a GEMV program loads per step, per thread: 64 bf16 are eight 16-byte
# loads in flight per thread (about 32 KiB per SM at two 4-warp programs), what one H200 SM needs
# in flight to stream its share of ~4.2 TB/s through ~0.7 us of memory latency.
GEMV_ELEMENTS_PER_THREAD = 64


def default_gemv_tiles(F: int, D: int, top_k: int, pdl: bool = False) -> GemvTiles:
    """A starting point for the decode GEMVs of one shape (the probe sweeps around it; nothing ships it).

    4 warps; each step loads GEMV_ELEMENTS_PER_THREAD weights a thread: GEMM1 2 x block_n rows of
    block_k (gate and up), GEMM2 next_pow2(K) slots x block_n rows of block_k. The reduction step is
    at most 1024 (the whole of F or D where it fits, so no loop); the rest goes to rows, at least 1.
    Few rows per program make many programs: Qwen3-30B-A3B TP1 at M = 1 gets 1536 GEMM1 and 2048
    GEMM2 programs for 132 SMs, so a slow program or the last wave costs little.
    """
    per_step = GEMV_ELEMENTS_PER_THREAD * 32 * 4
    k1 = min(1 << max(D - 1, 0).bit_length(), 1024)
    k2 = min(1 << max(F - 1, 0).bit_length(), 1024)
    slots = 1 << max(top_k - 1, 0).bit_length()
    gemm1 = GemmTile(max(1, per_step // (2 * k1)), k1, num_warps=4, num_stages=1)
    gemm2 = GemmTile(max(1, per_step // (slots * k2)), k2, num_warps=4, num_stages=1)
    return GemvTiles(gemm1, gemm2, pdl=pdl)


def default_config(num_tokens: int, num_experts: int, top_k: int) -> MoeTileConfig:
    """Heuristic for shapes with no tuned file, by the mean rows per expert.

    Few rows per expert: the layer streams weights, so the smallest MMA-friendly BLOCK_M (16)
    wastes the least and a long K-step keeps bytes in flight. Many rows: compute-bound, so large
    tiles with GROUP_M swizzle for L2 reuse.
    """
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    if rows_per_expert <= 16:
        tile = GemmTile(block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
        return MoeTileConfig(block_m=16, gemm1=tile, gemm2=tile)
    if rows_per_expert <= 96:
        tile = GemmTile(block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4)
        return MoeTileConfig(block_m=64, gemm1=tile, gemm2=tile)
    return MoeTileConfig(
        block_m=128,
        gemm1=GemmTile(block_n=64, block_k=64, group_m=8, num_warps=8, num_stages=3),
        gemm2=GemmTile(block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
    )


def get_tile_config(
    *, num_tokens: int, num_experts: int, F: int, D: int, top_k: int, device_name: str
) -> MoeTileConfig:
    tuned = _tuned(num_experts, F, D, device_name)
    if tuned is None:
        return default_config(num_tokens, num_experts, top_k)
    return tuned[nearest_m(list(tuned), num_tokens)]


# ---------------------------------------------------------------------------------------------
# The per-rank shapes the shipped configs produce: tuned, benchmarked and tested at these.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeShape:
    """One MoE layer as one rank sees it."""

    model: str
    layout: str  # TP1, TP2, TEP2 (TP2 + expert parallel: the per-rank shape of DEP2 too)
    num_experts: int  # E, global
    local_experts: int  # e, on this rank
    top_k: int
    D: int
    F: int  # per rank
    apply_router_weight_on_input: bool = False

    @property
    def name(self) -> str:
        return f"{self.model} {self.layout}"

    @property
    def tuned_file(self) -> str:
        return config_file_name(self.local_experts, self.F, self.D, "NVIDIA H200")


SHIPPED_SHAPES = (
    MoeShape("Qwen3-30B-A3B", "TP1", 128, 128, 8, 2048, 768),
    MoeShape("Qwen3-30B-A3B", "TP2", 128, 128, 8, 2048, 384),
    MoeShape("Qwen3-30B-A3B", "TEP2", 128, 64, 8, 2048, 768),
    MoeShape("Mixtral-8x7B", "TP1", 8, 8, 2, 4096, 14336),
    MoeShape("Mixtral-8x7B", "TP2", 8, 8, 2, 4096, 7168),
    MoeShape("Mixtral-8x7B", "TEP2", 8, 4, 2, 4096, 14336),
    # Llama-4 routes top-1 and scales the expert's input by the router weight.
    MoeShape("Llama-4-Scout", "TP1", 16, 16, 1, 5120, 8192, apply_router_weight_on_input=True),
    MoeShape("Llama-4-Scout", "TP2", 16, 16, 1, 5120, 4096, apply_router_weight_on_input=True),
    MoeShape("Llama-4-Scout", "TEP2", 16, 8, 1, 5120, 8192, apply_router_weight_on_input=True),
)

# The per-rank shapes of the shipped configs, plus Qwen3-30B-A3B TP1 (the shape of the earlier tables):
# tuned with the prefill path in the space and benchmarked against both peers (issue 23, docs/perf.md).
PREFILL_SHAPES = (
    "Qwen3-30B-A3B TP1", "Qwen3-30B-A3B TP2", "Qwen3-30B-A3B TEP2", "Mixtral-8x7B TP2", "Mixtral-8x7B TEP2",
    "Llama-4-Scout TP2", "Llama-4-Scout TEP2",
)  # fmt: skip

M_GRID = (1, 16, 64, 256, 1024, 4096, 16384)
