"""The layer check: the MoE calls a server really makes, compared with the exact MoE of the same inputs.

Inside every vLLM process that runs a bundled kernel, `LayerCheck.observe` looks at each MoE layer's calls
as the plugin serves them: vLLM's hidden states, routing and expert map as handed to apply(), the layer's
weights as vLLM loaded them (before any conversion to the kernel's layout and before a `--mutate` bug), and
the output the served path returned (so a plugin, layout or routing bug counts like a kernel bug).

Evidence per cell, not per call. A cell is (layer, dispatch range, global expert) on this rank; each holds
the sums of core/layer_cells.CELL_FIELDS over the slots compared there, and each (layer, range) the row sums
of ROW_FIELDS. Which rows a call compares (layer_check_ref.pick_rows): on a background call (the layer's
first `burst` calls of a range, then every `period`-th) up to `cap` rows spread over the call; on any other
call, up to `cap` of its rows that hold an expert whose cell has fewer than `target` slots. So decode-size
calls are compared row by row while their cells fill, every expert the model routes to gets its slots, and
once the cells hold them the check costs a background sample now and then. The arithmetic of a compared row
(joint least squares over its slots, the incumbent's rounding, the SiLU slope direction):
moe_eval.kernels.layer_check_ref.

On a CUDA device the decision, the exact MoE and the sums run on the device (_layer_check_kernels.py): a
captured call is checked when its graph replays, with no host work per call. On the CPU (eager servers) the
torch definition runs. A flusher thread (kernels/stats_file.py) writes <run dir>/layer-check/<pid>.npz
(core/layer_cells.py) from host copies the device keeps current.

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k, R compared rows,
L layers of this process, NR dispatch ranges.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_eval.core import layer_cells
from moe_eval.core.layer_cells import CELL_FIELDS, ROW_FIELDS
from moe_eval.core.plugin_protocol import (
    LAYER_CHECK_PAUSE,
    LAYER_RANGE_EDGES,
    layer_range_index,
    layer_range_names,
)
from moe_eval.kernels import layer_check_ref as ref
from moe_eval.kernels.moe_call import MoeCall
from moe_eval.kernels.stats_file import StatsFile

ROWS_CAP = 64  # rows one call compares at most (the device scratch is sized for it)
# Slots a cell (layer, range, expert) collects before its rows stop being picked for it (the config's
# layer_check_slots sets it in a server). At random-weight real shapes one slot resolves a 1 % scale error;
# on the trained CPU canary 16 a layer left a rarely routed expert's pooled cell at 1.05 % (its incumbent's
# own estimate sits at -0.4 % there), 32 brings it under 1 % (docs/logprob-gate.md, "Power").
SLOT_TARGET = 32
SAMPLE_BURST = 4  # a layer's first calls of each range are compared spread over their rows ...
SAMPLE_PERIOD = 16  # ... then every 16th: every part of the calls stays looked at after the cells are full
NUM_RANGES = len(LAYER_RANGE_EDGES)
NUM_CELL_FIELDS, NUM_ROW_FIELDS = len(CELL_FIELDS), len(ROW_FIELDS)


def result_width(top_k: int) -> int:
    """Per compared row: K x 6 slot sums, K valid flags, 11 row sums (_row_stats_kernel's layout)."""
    return 7 * top_k + NUM_ROW_FIELDS - 1


class _LayerTables:
    """One MoE layer's sums: on the host (torch fp64), or on the device with pinned host mirrors."""

    def __init__(self, name: str, num_experts: int, device: torch.device | None, pin: bool) -> None:
        self.name = name
        shapes = ((NUM_RANGES, num_experts, NUM_CELL_FIELDS), (NUM_RANGES, NUM_ROW_FIELDS))
        where = device if device is not None else torch.device("cpu")
        self.cells = torch.zeros(shapes[0], dtype=torch.float64, device=where)
        self.rows = torch.zeros(shapes[1], dtype=torch.float64, device=where)
        self.seen = torch.zeros(NUM_RANGES, dtype=torch.int64, device=where)
        self.routed = torch.zeros(NUM_RANGES, num_experts, dtype=torch.int64, device=where)
        self.mirrors: tuple[torch.Tensor, ...] | None = None
        if device is not None:
            mirrors = (
                torch.zeros(shapes[0], dtype=torch.float64),
                torch.zeros(shapes[1], dtype=torch.float64),
                torch.zeros(NUM_RANGES, dtype=torch.int64),
                torch.zeros(NUM_RANGES, num_experts, dtype=torch.int64),
            )
            # The device writes them directly; the flusher only reads.
            self.mirrors = tuple(m.pin_memory() for m in mirrors) if pin else mirrors

    def host_view(self) -> tuple[np.ndarray, ...]:
        """cells, rows, seen, routed as the host sees them."""
        tables = self.mirrors if self.mirrors is not None else (self.cells, self.rows, self.seen, self.routed)
        return tuple(t.numpy().copy() for t in tables)


class LayerCheck:
    """One per process (vLLM runs one per rank), one table per MoE layer registered with it."""

    def __init__(
        self,
        backend: str,
        num_experts: int,
        path: Path | None,
        rank: dict[str, Any],
        max_tokens: int,
        *,
        target: int = SLOT_TARGET,
        cap: int = ROWS_CAP,
        burst: int = SAMPLE_BURST,
        period: int = SAMPLE_PERIOD,
    ) -> None:
        self.backend = backend
        self.num_experts = num_experts
        self.rank = rank
        self.max_tokens = max_tokens
        self.target, self.cap, self.burst, self.period = target, cap, burst, period
        self.device: torch.device | None = None  # set by attach_device (CUDA); None: torch on the host
        self.pin = True
        self.layers: list[_LayerTables] = []
        self.experts_held: list[int] | None = None  # global experts this rank holds (None: every one)
        self._lock = threading.Lock()
        self._scratch: dict[tuple, tuple[torch.Tensor, ...]] = {}
        # Paused: calls are neither counted nor compared (set_paused). The device reads the flag from host
        # memory at every call, so captured graphs keep their check kernels and obey it at replay.
        self.paused = False
        self._pause_flag = torch.zeros(1, dtype=torch.int32)
        self.file = StatsFile(
            path, self.snapshot, "moe-eval-layer-check", write=_write, same=_same,
            before_flush=self.follow_pause_file,
        )  # fmt: skip

    # --- set-up (weight loading, before vLLM's warm-up and graph capture) ---

    def attach_device(self, device: torch.device, pin: bool = True) -> None:
        """Device tables for the layers registered from now on. pin=False: plain host mirrors (Triton's
        interpreter on a machine without CUDA)."""
        assert not self.layers, "attach the device before the first layer registers"
        self.device, self.pin = device, pin
        if pin:  # the mirrors' rule: host memory the device reads
            self._pause_flag = self._pause_flag.pin_memory()

    def set_paused(self, paused: bool) -> None:
        """Paused, the calls from now on are neither counted nor compared (an eager call launches nothing;
        a captured one runs the pick, which finds the flag, and four launches that return at once)."""
        self._pause_flag.fill_(int(paused))
        self.paused = paused

    def follow_pause_file(self) -> None:
        """Paused while <run dir>/layer-check/LAYER_CHECK_PAUSE exists (the flusher's tick; the harness reads
        the state back from this process's file)."""
        paused = (self.file.path.parent / LAYER_CHECK_PAUSE).exists()  # flush runs only with a path
        if paused != self.paused:
            self.set_paused(paused)

    def register_layer(self, name: str | None = None) -> int:
        """A new MoE layer's tables; its index is what `observe` takes."""
        index = len(self.layers)
        self.layers.append(_LayerTables(name or f"layer{index}", self.num_experts, self.device, self.pin))
        return index

    def prepare(
        self, w13_eFD: torch.Tensor, w2_eDF: torch.Tensor, top_k: int, expert_map_E: Any, on_input: bool
    ) -> None:
        """Scratch for one layer shape and the kernels compiled for it (calls on random inputs into a
        throwaway table, both branches of the pick): nothing compiles while the server serves."""
        if self.device is None:
            return
        D = w2_eDF.shape[1]
        throwaway = _LayerTables("warm-up", self.num_experts, self.device, self.pin)
        for T, seen in ((3, 0), (ROWS_CAP + 5, self.burst + 1)):  # a background call, then a needy one
            throwaway.seen.fill_(seen)
            hidden = torch.randn(T, D, device=self.device).to(w13_eFD.dtype)
            ids = torch.stack(
                [torch.randperm(self.num_experts, device=self.device)[:top_k] for _ in range(T)]
            )
            ids = ids.to(torch.int32)
            weights = torch.rand(T, top_k, device=self.device, dtype=torch.float32)
            out = torch.zeros(T, D, device=self.device, dtype=w13_eFD.dtype)
            self._observe_on_device(
                throwaway, 0, hidden, out, weights, ids, expert_map_E, w13_eFD, w2_eDF, on_input
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- observing (hot path) ---

    def observe(self, layer: int, call: MoeCall, out_TD: torch.Tensor) -> None:
        """One served call: `call` as vLLM handed it (its routing, its expert map, the weights it loaded, in
        the checkpoint's layout) and what the kernel returned."""
        hidden_TD, routing = call.hidden_TD, call.routing
        T = hidden_TD.shape[0]
        if T == 0:
            return
        self.file.start()
        if self.paused and not (hidden_TD.is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        range_index = layer_range_index(T)
        tables = self.layers[layer]
        if self.device is None:
            self._observe_on_host(tables, range_index, call, out_TD)
            return
        args = (hidden_TD, out_TD, routing.weights_TK, routing.ids_TK, call.expert_map_E)
        weights = (call.weights.w13_eFD, call.weights.w2_eDF, call.options.apply_router_weight_on_input)
        self._observe_on_device(tables, range_index, *args, *weights)

    def _observe_on_host(
        self, tables: _LayerTables, range_index: int, call: MoeCall, out_TD: torch.Tensor
    ) -> None:
        topk_ids_TK, expert_map_E = call.routing.ids_TK, call.expert_map_E
        seen = int(tables.seen[range_index])
        tables.seen[range_index] += 1
        ids = topk_ids_TK.long().cpu().reshape(-1)
        if expert_map_E is not None:
            ids = ids[expert_map_E.long().cpu()[ids] >= 0]
        tables.routed[range_index].index_add_(0, ids, torch.ones_like(ids))
        rows = ref.pick_rows(
            call.hidden_TD.shape[0],
            seen,
            self.needy_rows(tables.cells[range_index], topk_ids_TK, expert_map_E),
            self.cap,
            self.burst,
            self.period,
        )
        if not rows:
            return
        sums = ref.call_row_sums(call, out_TD, rows)
        with self._lock:
            add(tables, range_index, sums)

    def needy_rows(
        self, cells_EF: torch.Tensor, topk_ids_TK: torch.Tensor, expert_map_E: torch.Tensor | None
    ) -> torch.Tensor:
        """(T,) bool: the rows with a slot of this rank whose expert's cell has fewer than `target` slots."""
        ids = topk_ids_TK.long().cpu()
        held = (
            expert_map_E.long().cpu()[ids] >= 0
            if expert_map_E is not None
            else torch.ones_like(ids, dtype=torch.bool)
        )
        return (held & (cells_EF[:, 0].cpu()[ids] < self.target)).any(-1)

    # --- the CUDA path ---

    def _buffers(self, F: int, D: int, K: int) -> tuple[torch.Tensor, ...]:
        key = (F, D, K)
        if key not in self._scratch:
            cap, dev = self.cap, self.device
            self._scratch[key] = (
                torch.zeros(cap, dtype=torch.int32, device=dev),  # rows
                torch.zeros(1, dtype=torch.int32, device=dev),  # count
                torch.zeros(cap * K * F, dtype=torch.float32, device=dev),  # h
                torch.zeros(cap * K * F, dtype=torch.float32, device=dev),  # slope direction of h
                torch.zeros(cap * K * D, dtype=torch.float32, device=dev),  # y
                torch.zeros(cap * K * D, dtype=torch.float32, device=dev),  # q
                torch.zeros(cap * K * D, dtype=torch.float32, device=dev),  # v
                torch.zeros(cap * result_width(K), dtype=torch.float64, device=dev),  # per-row sums
                torch.full((1,), -1, dtype=torch.int32, device=dev),  # stands in for a missing expert map
            )
        return self._scratch[key]

    def _observe_on_device(
        self,
        tables: _LayerTables,
        range_index: int,
        hidden_TD: torch.Tensor,
        out_TD: torch.Tensor,
        topk_weights_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        expert_map_E: torch.Tensor | None,
        w13_eFD: torch.Tensor,
        w2_eDF: torch.Tensor,
        on_input: bool,
    ) -> None:
        import triton

        from moe_eval.kernels import _layer_check_kernels as kernels

        T, D = hidden_TD.shape
        K = topk_ids_TK.shape[1]
        F = w2_eDF.shape[2]
        E = self.num_experts
        R = min(T, self.cap)  # the grids: programs beyond the picked count return at once
        assert hidden_TD.is_contiguous() and out_TD.is_contiguous(), "hidden and output must be contiguous"
        assert w13_eFD.stride(2) == 1 and w2_eDF.stride(2) == 1, "weights must be row-major in their last dim"
        # No-ops when vLLM already hands int32 ids and fp32 weights (it does): one kernel variant each.
        ids = topk_ids_TK.to(torch.int32).contiguous()
        weights = topk_weights_TK.to(torch.float32).contiguous()
        rows, count, h, hs, y, q, v, result, no_map = self._buffers(F, D, K)
        emap = expert_map_E.to(torch.int32) if expert_map_E is not None else no_map
        has_map = expert_map_E is not None
        block_k = max(2, triton.next_power_of_2(K))
        _, _, seen_mirror, routed_mirror = tables.mirrors
        kernels._pick_rows_kernel[(1,)](
            tables.seen, seen_mirror, tables.cells, tables.routed, routed_mirror, ids, emap, rows, count,
            self._pause_flag, T, E, range_index, self.cap, self.burst, self.period, self.target,
            K=K, NF=NUM_CELL_FIELDS, HAS_MAP=has_map, BLOCK_K=block_k, BLOCK_T=max(16, 256 // block_k),
            BLOCK_CAP=triton.next_power_of_2(self.cap), BLOCK_E=triton.next_power_of_2(E + 1), num_warps=4,
        )  # fmt: skip
        kernels._exact_h_kernel[(R * K, triton.cdiv(F, 32))](
            count, rows, hidden_TD, ids, weights, emap, w13_eFD, h, hs,
            T, D, F, w13_eFD.stride(0), w13_eFD.stride(1),
            K=K, HAS_MAP=has_map, WEIGHT_ON_INPUT=on_input, BLOCK_F=32, BLOCK_D=128, num_warps=4,
        )  # fmt: skip
        kernels._exact_y_kernel[(R * K, triton.cdiv(D, 64))](
            count, rows, ids, weights, emap, w2_eDF, h, hs, y, q, v,
            T, D, F, w2_eDF.stride(0), w2_eDF.stride(1),
            K=K, HAS_MAP=has_map, WEIGHT_ON_INPUT=on_input, BLOCK_F=64, BLOCK_D=64, num_warps=4,
        )  # fmt: skip
        kernels._row_stats_kernel[(R,)](
            count, rows, out_TD, ids, emap, y, q, v, result, T, D,
            K=K, NRES=result_width(K), HAS_MAP=has_map, BLOCK_K=block_k, BLOCK_D=32, num_warps=4,
        )  # fmt: skip
        cells_mirror, rows_mirror, _, _ = tables.mirrors
        kernels._accumulate_kernel[(1,)](
            count, rows, ids, result, tables.cells, tables.rows, cells_mirror, rows_mirror, E, range_index,
            K=K, NF=NUM_CELL_FIELDS, NRF=NUM_ROW_FIELDS, NRES=result_width(K), BLOCK_K=block_k, num_warps=1,
        )  # fmt: skip

    # --- reading ---

    def snapshot(self) -> tuple[dict[str, Any], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """meta, cells, rows, seen, routed (core/layer_cells.py)."""
        with self._lock:
            views = [tables.host_view() for tables in self.layers]
        E, L = self.num_experts, len(views)
        empty = {
            0: np.zeros((0, NUM_RANGES, E, NUM_CELL_FIELDS)),
            1: np.zeros((0, NUM_RANGES, NUM_ROW_FIELDS)),
            2: np.zeros((0, NUM_RANGES), dtype=np.int64),
            3: np.zeros((0, NUM_RANGES, E), dtype=np.int64),
        }
        cells, rows, seen, routed = (np.stack([v[i] for v in views]) if L else empty[i] for i in range(4))
        meta = {
            "backend": self.backend,
            "pid": os.getpid(),
            "rank": self.rank,
            "max_tokens": self.max_tokens,
            "num_experts": E,
            "layers": [tables.name for tables in self.layers],
            "experts_held": self.experts_held,
            "ranges": list(layer_range_names()),
            "sampling": {"target": self.target, "cap": self.cap, "burst": self.burst, "period": self.period},
            "counted_on": "device" if self.device is not None else "host",
            "paused": self.paused,
        }
        return meta, cells, rows, seen, routed

    def flush(self) -> None:
        self.file.flush()


def add(tables: _LayerTables, range_index: int, sums: ref.RowSums) -> None:
    """One call's row sums into a layer's host tables (what _accumulate_kernel does on the device)."""
    valid = sums.valid_RK.cpu()
    experts = sums.experts_RK.cpu()[valid]
    slot = sums.slot_RK6.cpu()[valid]
    cells = tables.cells[range_index]
    cells[:, 0].index_add_(0, experts, torch.ones(len(experts), dtype=torch.float64))
    cells[:, 1:].index_add_(0, experts, slot)
    tables.rows[range_index, 0] += 1
    tables.rows[range_index, 1:] += sums.row_R11.cpu().sum(0)


def _write(path: Path, snapshot: tuple) -> None:
    layer_cells.write(path, *snapshot)


def _same(a: tuple, b: tuple) -> bool:
    """Equal tables need no rewrite (unless the pause changed: the harness waits to read it). Every table is
    compared, not only the counts: a copy taken while the device was writing a call can hold its new `rows`
    with its old `cells` (or its new `seen` with its old `routed`), and the next tick, copied after the call,
    must replace it, since its flush mark tells the harness the file holds every call before it."""
    return (
        a[0]["layers"] == b[0]["layers"]
        and a[0]["paused"] == b[0]["paused"]
        and all(np.array_equal(x, y) for x, y in zip(a[1:], b[1:], strict=True))
    )
