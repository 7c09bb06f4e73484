"""Mutation targets from a run's layer-check tables: the least-routed expert of a dispatch range (routed slots
summed over the layers and ranks of the first bundled row found), for `--mutate scale_expert:expert=E`.

    python benchmarks/layer_targets.py RUN_DIR --least-routed M=1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from moe_eval.core import layer_cells
from moe_eval.core.plugin_protocol import LAYER_CHECK_DIR, layer_range_names


def least_routed(run_dir: Path, range_name: str) -> tuple[int, int]:
    """(expert, routed slots) of the rarest expert any row of the run routed in `range_name`."""
    folders = sorted({p.parent.parent for p in Path(run_dir).rglob(f"{LAYER_CHECK_DIR}/*.npz")})
    if not folders:
        raise SystemExit(f"{run_dir}: no {LAYER_CHECK_DIR}/ tables")
    files, problems = layer_cells.read_folder(folders[0])
    if problems or not files:
        raise SystemExit(f"{folders[0]}: {problems or 'no readable table'}")
    i = layer_range_names().index(range_name)
    routed = sum(f.routed[:, i].sum(0) for f in files)
    candidates = np.nonzero(routed > 0)[0]
    if not len(candidates):
        raise SystemExit(f"{folders[0]}: no expert routed in {range_name}")
    expert = int(candidates[np.argmin(routed[candidates])])
    return expert, int(routed[expert])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--least-routed", metavar="RANGE", required=True, choices=layer_range_names())
    args = parser.parse_args()
    expert, slots = least_routed(args.run_dir, args.least_routed)
    print(f"{expert}")
    print(f"expert {expert}: {slots} slots routed in {args.least_routed}", file=sys.stderr)


if __name__ == "__main__":
    main()
