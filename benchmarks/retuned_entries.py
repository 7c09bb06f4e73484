"""Merge entries retuned on a GPU into that GPU's shipped tile files where the benchmark timed them faster.

`benchmarks/device/limit_bench.sh STAGES="tune prefill" TUNE_M=1024,4096,16384
PREFILL_PEERS="triton_package ..."` retunes some sizes of every shape on the GPU at hand (`tuned.tgz`: the
package's files for that GPU with the tuner's picks merged in) and times the whole call on those tiles
(`triton`) beside the package's own tiles (`triton_package`) in the same replays. An entry of the package's
file is replaced by the tuner's pick only where `triton` was faster than `triton_package` by at least
MIN_GAIN in every repeat of that run: the tuner times the stages apart, a whole call can rank them
otherwise, and within noise the shipped tiles (which served) stay. A size the tuner did not reach in that
run (its timings in the tuned file are none, or the package file's own) is not touched; the folder must be
seeded afresh for each tuning (limit_bench.sh's tune stage copies the package's files in first), or sizes an
earlier tuning reached would count as reached by this one. Every entry tried is recorded in the file's
meta (`retuned`: both times per repeat, the tuner's own stage times, kept or not) with an edit line.

Usage: python benchmarks/retuned_entries.py --tuned DIR --rows prefill_rows.jsonl --m 1024 4096 16384
       --device "NVIDIA H100 80GB HBM3" --gpu-uuid GPU-... --date YYYY-MM-DD [--base-dir DIR] --out DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from bench_fused_moe import (
    CHECK_TOLERANCE,
    faster_in_every_repeat,
    repeat_medians,
    rows_by_cell,
)  # beside this

from moe_eval.kernels.tile_configs import (
    SHIPPED_SHAPES,
    TUNED_DIR,
    MoeTileConfig,
    config_file_name,
    read_tuned_file,
    write_tuned_file,
)

MIN_GAIN = 0.005  # 0.5 %, as borrowed_tile_files.PDL_MIN_GAIN: the repeats of one run agree within ~0.3 %


def _repeats(row: dict) -> list[float]:
    """A row's repeat medians, rounded as the file records them (the decision and its record agree)."""
    return [round(t, 1) for t in repeat_medians(row)]


def faster_every_repeat(fresh: dict | None, shipped: dict | None) -> bool:
    if not fresh or not shipped:
        return False
    a, b = _repeats(fresh), _repeats(shipped)
    return len(a) == len(b) > 0 and faster_in_every_repeat(a, b, MIN_GAIN)


def _timed_tiles(row: dict) -> MoeTileConfig | None:
    return MoeTileConfig.from_json(json.loads(row["config"])) if row.get("config") else None


def merge_shape(name: str, shape_name: str, args: argparse.Namespace, by: dict) -> str | None:
    base_path, tuned_path = args.base_dir / name, args.tuned / name
    if not base_path.is_file() or not tuned_path.is_file():
        return None
    body = json.loads(base_path.read_text())
    meta, configs = body["meta"], read_tuned_file(base_path)
    tuned, tuned_meta = read_tuned_file(tuned_path), json.loads(tuned_path.read_text())["meta"]
    retuned, edits = dict(meta.get("retuned", {})), list(meta.get("edits", []))
    changed = []
    for m in args.m:
        if m not in tuned or m not in configs:
            continue
        tuner_us = tuned_meta.get("timings_us", {}).get(str(m))
        if tuner_us is None or tuner_us == meta.get("timings_us", {}).get(str(m)):
            continue  # the tuner did not reach this size in this run: the folder holds the package's entry
        fresh, shipped = by.get((shape_name, m, "triton")), by.get((shape_name, m, "triton_package"))
        if fresh is None or shipped is None:
            continue  # not timed at this size: nothing to decide on
        # The rows must be of these tiles: `triton` read the tuned folder, `triton_package` this file.
        if _timed_tiles(fresh) != tuned[m]:
            raise SystemExit(
                f"{shape_name} M={m}: the row 'triton' timed other tiles than {args.tuned / name}"
            )
        if _timed_tiles(shipped) != configs[m]:
            if configs[m] == tuned[m] and retuned.get(str(m), {}).get("outcome") == "replaced":
                continue  # merged by an earlier pass over the same run: its record stands
            raise SystemExit(
                f"{shape_name} M={m}: the row 'triton_package' timed other tiles than {base_path}"
            )
        same = tuned[m] == configs[m]
        right = fresh.get("rel_err", 0.0) <= CHECK_TOLERANCE  # a wrong output is never shipped, however fast
        keep = not same and right and faster_every_repeat(fresh, shipped)
        retuned[str(m)] = {
            "gpu": args.gpu_uuid,
            "date": args.date,
            "tuner_timings_us": tuner_us,
            "tuned_tiles_us": _repeats(fresh),
            "shipped_tiles_us": _repeats(shipped),
            "outcome": (
                "the tuner picked the shipped tiles" if same
                else "replaced" if keep
                else "kept shipped: the tuned tiles computed a wrong output" if not right
                else "kept shipped"
            ),
        }  # fmt: skip
        if keep:
            configs[m] = tuned[m]
            changed.append(m)
            edits.append(
                f"entry '{m}': retuned on this GPU ({args.gpu_uuid}), {args.date}: faster than the tiles "
                f"before by >= {MIN_GAIN:.1%} in every repeat ({retuned[str(m)]['tuned_tiles_us']} against "
                f"{retuned[str(m)]['shipped_tiles_us']} us)"
            )
    if retuned == meta.get("retuned", {}):  # nothing tried here: the file stays byte for byte
        if (args.out / name).resolve() != base_path.resolve():
            shutil.copyfile(base_path, args.out / name)
        return f"{shape_name}: {name}: no size retuned in this run"
    meta = {**meta, "retuned": retuned, "edits": edits}
    if changed:
        meta["retune_command"] = tuned_meta.get("command", "").split("; then ")[-1]
        meta["source"] = (
            meta.get("source", "")
            + f"; entries {changed} retuned on this GPU ({args.gpu_uuid}, {args.date}): "
            "meta.retuned, benchmarks/retuned_entries.py"
        )
    write_tuned_file(args.out / name, configs, meta)
    return f"{shape_name}: {name}: replaced {changed}; tried {sorted(int(m) for m in retuned)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tuned", type=Path, required=True, help="limit_bench.sh's tuned folder (tuned.tgz)")
    parser.add_argument(
        "--rows", type=Path, required=True, help="the same run's rows: triton and triton_package"
    )
    parser.add_argument("--m", type=int, nargs="+", required=True, help="the sizes retuned")
    parser.add_argument("--device", required=True)
    parser.add_argument("--gpu-uuid", required=True)
    parser.add_argument("--date", required=True)
    parser.add_argument(
        "--base-dir", type=Path, default=TUNED_DIR, help="the shipped files (default: the package's)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
    by = rows_by_cell(rows)
    for shape in SHIPPED_SHAPES:
        said = merge_shape(
            config_file_name(shape.local_experts, shape.F, shape.D, args.device), shape.name, args, by
        )
        if said:
            print(said)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
