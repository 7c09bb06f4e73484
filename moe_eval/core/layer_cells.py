"""The layer check's file: what each bundled-kernel process writes and the gate reads (no torch, no vLLM).

One file per process, `<run dir>/layer-check/<pid>.npz` (`<pid>-<n>.npz` for a second table in one
process), rewritten atomically while the server serves:

- `cells`  float64 (L, NR, E, len(CELL_FIELDS)): per MoE layer of the process, dispatch range and global
  expert, the sums over the slots compared there (moe_eval.kernels.layer_check_ref defines each field);
- `rows`   float64 (L, NR, len(ROW_FIELDS)): per layer and range, the row sums (errors, and the activation
  direction's sums);
- `seen`   int64 (L, NR): the calls each layer made in each range, compared or not;
- `routed` int64 (L, NR, E): the slots routed to each expert of this rank, compared or not;
- `meta`   a JSON string: backend, pid, rank (its place in the layout), world_size, max_tokens, layer names,
  the sampling parameters, where the sums were counted (device or host), the field names.

A binary table, not JSON: a real model's table (48 layers x 7 ranges x 128 experts x 7 fields) is 2.4 MB,
rewritten every STATS_INTERVAL_SECONDS by a thread inside the server.

L layers, NR dispatch ranges, E global experts.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_eval.core.plugin_protocol import LAYER_CHECK_DIR

FORMAT_VERSION = 2
# Per (layer, range, expert), summed over the slots of that expert compared there. With y~ the slot's output
# direction made orthogonal to the other slots of its row (the row's joint least squares), res = served -
# exact, inc = incumbent - exact, diff = served - incumbent, all over the hidden dimension:
#   n slots; a = <y~, res>; b = <y~, y> (= |y~|^2); vb = sum y~^2 res^2; a_inc = <y~, inc>;
#   vd = sum y~^2 diff^2; vd2 = sum (y~^2 diff^2)^2 (how concentrated vd is: its degrees of freedom).
CELL_FIELDS = ("n", "a", "b", "vb", "a_inc", "vd", "vd2")
# Per (layer, range): sampled calls and compared rows; squared errors of the served output and of the
# incumbent's arithmetic against the exact MoE, the exact output's own square; served values not finite where
# the exact one is; then the activation direction's six sums, as the cells' (v~ = the SiLU slope direction
# made orthogonal to every slot output of the row).
ROW_FIELDS = (
    "calls",
    "rows",
    "sq_res",
    "sq_exact",
    "sq_ref",
    "nonfinite",
    "sa",
    "sb",
    "svb",
    "sa_inc",
    "svd",
    "svd2",
)
CELL = {name: i for i, name in enumerate(CELL_FIELDS)}
ROW = {name: i for i, name in enumerate(ROW_FIELDS)}


@dataclass
class LayerFile:
    """One process's tables as read back."""

    meta: dict[str, Any]
    cells: np.ndarray  # (L, NR, E, len(CELL_FIELDS))
    rows: np.ndarray  # (L, NR, len(ROW_FIELDS))
    seen: np.ndarray  # (L, NR)
    routed: np.ndarray | None = None  # (L, NR, E); None: not counted (a synthetic table)
    path: Path | None = None

    @property
    def rank(self) -> dict[str, Any]:
        return self.meta.get("rank") or {}


def write(
    path: Path,
    meta: dict[str, Any],
    cells: np.ndarray,
    rows: np.ndarray,
    seen: np.ndarray,
    routed: np.ndarray,
) -> None:
    """Atomically (a temporary name, then a rename): a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    header = json.dumps(
        meta | {"format": FORMAT_VERSION, "cell_fields": CELL_FIELDS, "row_fields": ROW_FIELDS}
    )
    np.savez(buffer, meta=np.array(header), cells=cells, rows=rows, seen=seen, routed=routed)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, path)


def read_meta(path: Path) -> dict[str, Any]:
    """One file's meta alone (np.load reads an .npz member only when asked); ValueError when unreadable."""
    try:
        with np.load(path, allow_pickle=False) as data:
            meta: dict[str, Any] = json.loads(str(data["meta"]))
            return meta
    except (OSError, KeyError, ValueError, EOFError) as exc:
        raise ValueError(f"{path}: not a layer-check file ({exc})") from None


def read(path: Path) -> LayerFile:
    """One file; ValueError when it is not a layer-check file of this format."""
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            cells, rows, seen, routed = data["cells"], data["rows"], data["seen"], data["routed"]
    except (OSError, KeyError, ValueError, EOFError) as exc:
        raise ValueError(f"{path}: not a layer-check file ({exc})") from None
    if meta.get("format") != FORMAT_VERSION or tuple(meta.get("cell_fields", ())) != CELL_FIELDS:
        raise ValueError(
            f"{path}: layer-check format {meta.get('format')}, this moe-eval reads {FORMAT_VERSION}"
        )
    shapes = (rows.shape[:2], seen.shape, routed.shape[:2], routed.shape[2:] or (0,))
    if cells.ndim != 4 or shapes != (cells.shape[:2], cells.shape[:2], cells.shape[:2], cells.shape[2:3]):
        raise ValueError(f"{path}: tables of mismatched shapes {cells.shape}, {rows.shape}, {routed.shape}")
    return LayerFile(meta, cells, rows, seen, routed, path)


def paths(run_dir: Path) -> list[Path]:
    """The processes' files of a config's run folder, in name order (none before any process wrote one)."""
    folder = Path(run_dir) / LAYER_CHECK_DIR
    return sorted(folder.glob("*.npz")) if folder.is_dir() else []


def read_metas(run_dir: Path) -> dict[str, dict[str, Any] | None]:
    """Each process's file name and its meta alone (None: unreadable, such as mid-rewrite)."""
    metas: dict[str, dict[str, Any] | None] = {}
    for path in paths(run_dir):
        try:
            metas[path.name] = read_meta(path)
        except ValueError:
            metas[path.name] = None
    return metas


def read_folder(run_dir: Path) -> tuple[list[LayerFile], list[str]]:
    """Every process's file of a config's run folder, and the problems met (a file that is not one)."""
    files, problems = [], []
    for path in paths(run_dir):
        try:
            files.append(read(path))
        except ValueError as exc:
            problems.append(str(exc))
    return files, problems
