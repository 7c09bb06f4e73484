"""Tile configs: the JSON format, the nearest-M rule, the default heuristic, and the shipped files.

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k.
"""

from __future__ import annotations

import json

import pytest

from moe_eval.kernels import tile_configs
from moe_eval.kernels.tile_configs import (
    M_GRID,
    SHIPPED_SHAPES,
    TUNED_DIR,
    GemmTile,
    MoeTileConfig,
    default_config,
    get_tile_config,
    nearest_m,
    read_tuned_file,
    write_tuned_file,
)

# Hopper's shared memory per block; Triton 3.6 allocates num_stages tiles of A and B(s).
SMEM_LIMIT = 232448


@pytest.mark.parametrize(
    ("T", "expected"),
    [
        (0, 1),  # no token: the smallest entry
        (1, 1),
        (3, 1),  # log2 3 = 1.6 is nearer 0 (M=1) than 4 (M=16)
        (5, 16),
        (100, 64),  # log2 100 = 6.6: 6 (64) beats 8 (256)
        (128, 64),  # exactly between 64 and 256 in log2: the smaller M
        (20000, 16384),  # past the grid
    ],
)
def test_nearest_m_on_log_scale(T, expected):
    assert nearest_m(list(M_GRID), T) == expected


def test_json_round_trip(tmp_path):
    configs = {
        1: MoeTileConfig(16, GemmTile(32, 128), GemmTile(64, 256, 8, 4, 4)),
        4096: MoeTileConfig(128, GemmTile(128, 64, 8, 8, 3), GemmTile(256, 64, 8, 8, 4)),
    }
    path = tmp_path / "E=8,F=64,D=128,device=TEST.json"
    write_tuned_file(path, configs, {"note": "test"})
    assert read_tuned_file(path) == configs


def test_unknown_key_is_an_error(tmp_path):
    path = tmp_path / "x.json"
    body = {"meta": {}, "configs": {"1": {"block_m": 16, "gemm1": {"block_n": 32, "block_k": 64, "num_wraps": 4},
                                           "gemm2": {"block_n": 32, "block_k": 64}}}}  # fmt: skip
    path.write_text(json.dumps(body))
    with pytest.raises(ValueError, match="num_wraps"):
        read_tuned_file(path)


@pytest.mark.parametrize(
    ("T", "e", "K", "block_m"), [(1, 128, 8, 16), (64, 8, 2, 16), (512, 8, 2, 128), (256, 64, 8, 64)]
)
def test_default_heuristic(T, e, K, block_m):
    assert default_config(T, e, K).block_m == block_m


def test_default_is_used_with_a_warning_once(caplog):
    tile_configs._tuned.cache_clear()
    with caplog.at_level("WARNING"):
        for _ in range(3):
            get_tile_config(num_tokens=5, num_experts=3, F=48, D=80, top_k=2, device_name="No Such GPU")
    assert sum("no tuned tile configs" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("shape", SHIPPED_SHAPES, ids=lambda s: s.name.replace(" ", "-"))
def test_shipped_file_covers_the_grid(shape):
    path = TUNED_DIR / shape.tuned_file
    assert path.is_file(), f"missing tuned configs {path.name}: run benchmarks/tune_fused_moe.py on an H200"
    configs = read_tuned_file(path)
    assert sorted(configs) == sorted(M_GRID)
    meta = json.loads(path.read_text())["meta"]
    # The file's name and its contents describe the same shape and device.
    assert f"e={shape.local_experts} " in meta["shape"] and f"D={shape.D} F={shape.F}" in meta["shape"]
    assert meta["device"] == "NVIDIA H200"
    for M, cfg in configs.items():
        assert get_tile_config(num_tokens=M, num_experts=shape.local_experts, F=shape.F, D=shape.D,
                               top_k=shape.top_k, device_name="NVIDIA H200") == cfg  # fmt: skip
        for n_b, tile in ((2, cfg.gemm1), (1, cfg.gemm2)):
            sizes = (cfg.block_m, tile.block_n, tile.block_k)
            assert all(v >= 16 and v & (v - 1) == 0 for v in sizes), (
                f"M={M}: tl.dot needs powers of two >= 16"
            )
            smem = tile.num_stages * (cfg.block_m * tile.block_k + n_b * tile.block_k * tile.block_n) * 2
            assert smem <= SMEM_LIMIT, f"M={M}: {smem} bytes of shared memory"
