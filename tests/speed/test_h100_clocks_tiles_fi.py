"""One H100 (GPU-ca890f50, 2026-12-06 16:01-16:23 UTC, code at 9bf115e), re-judged by the rule as it is now
(docs/perf.md "The SM clock, the H100 tiles served, FlashInfer gated"):
- two more STAGE=power runs of the canary with the SM clock recorded (power-gated-canary-3.json: 5 correct
  bundled rows, 2 of vLLM's, the 5 % / 10 % mutation twice; the second repeat without the clock's polling);
- the Qwen3-30B-A3B twin pair with every gate, the bundled row on the H100 tile file
  (served-gated-twin-h100-tiles.json), against the earlier H100 rows on the default heuristic;
- FlashInfer CUTLASS beside vLLM's Triton on the canary, every gate (served-gated-canary-fi.json).
(Named served-gated-*, not canary-* / twin-*: test_h200_records.py's eager-spread test reads those, rows of
the time before the eager calls were gated.)"""

from __future__ import annotations

import itertools
import math

from moe_eval.gates.speed import speed_check
from tests.speed import stored_power as stored
from tests.speed.stored_power import DECODE, EAGER, MARGINS, SLOWED, timing

CANARY_RUNS = ("power-gated-canary", "power-gated-canary-2", "power-gated-canary-3", "power-gated-canary-4")
UNSAMPLED = "20261206-160528"  # the repeat run without nvidia-smi's polling (ALTERNATE_CLOCKS=1)


def _canary(repo_root) -> list[dict]:
    return stored.stored_rows(repo_root, "power-gated-canary-3")


def test_the_sm_clock_stayed_at_its_maximum_in_every_sampled_row(repo_root):
    """The clock guess for the canary's eager calls moving between servers, tested: nvidia-smi's samples every
    100 ms read 1980 MHz (the H100's maximum) from first to last in every row, the mutated ones too. The
    row run without the polling says so in its record rather than holding no field."""
    rows = _canary(repo_root)
    sampled = [r for r in rows if r["run"] != UNSAMPLED]
    assert len(sampled) == 8
    for row in sampled:
        clocks = row["timing"]["gpu_clocks"]
        assert clocks["sm_mhz_min"] == clocks["sm_mhz_max"] == 1980.0 and clocks["samples"] >= 40, row["run"]
    (unsampled,) = [r for r in rows if r["run"] == UNSAMPLED]
    assert "clock sampling off" in unsampled["timing"]["gpu_clocks"]["error"]


def test_the_polling_does_not_move_the_calls_beyond_what_servers_differ_by(repo_root):
    """The unsampled row against the four sampled correct rows, each pair passing: its decode calls ran
    -0.2 % to +1.6 % off theirs (mean +0.4 %: slower, not faster, without the polling), the sampled rows'
    own pairs within 1.7 % either way. What the polling costs, if anything, is inside what one machine's
    servers differ by."""
    correct = stored.correct(_canary(repo_root))
    (unsampled,) = [r for r in correct if r["run"] == UNSAMPLED]
    sampled = [r for r in correct if r["run"] != UNSAMPLED]
    assert len(sampled) == 4

    def decode_logs(row, reference):
        check, _ = speed_check(timing(row), timing(reference), MARGINS, reference["run"])
        assert check is not None and check.passed, (row["run"], reference["run"])
        judged = stored.ranges_judged(row, reference)
        return [math.log(judged[r].ratio) for r in DECODE]

    polled = [x for other in sampled for x in decode_logs(unsampled, other)]  # unpolled / polled
    between = [x for a, b in itertools.combinations(sampled, 2) for x in decode_logs(b, a)]
    assert len(polled) == 4 * len(DECODE)
    assert max(abs(x) for x in polled) <= max(abs(x) for x in between) < 0.02
    assert abs(sum(polled) / len(polled)) < 0.005


def test_over_six_canary_runs_decode_is_caught_in_23_of_24_ranges_and_eager_in_8_of_16(repo_root):
    """Runs 4 and 5 (16:01-16:23 UTC): the 10 % eager slowdown read x1.096-1.104 (all three caught), then
    x1.079-1.097 (M>=4096 x1.082 against x1.085: missed). Run 6 (power-gated-canary-4, another H100,
    20:32-20:38 UTC, code at 574b670): decode caught 4 of 4, eager x1.043-1.058 against x1.077-1.101, none
    caught: the pair's row, the reference, ran its eager calls 1-3.5 % slower than the repeat row did
    minutes later. With the clock pinned, the canary's eager calls still move between servers of one
    machine: a per-server floor of 0.014 over 5 servers (power_table.py --floors), against the 0.01 the gate
    assumes. A 10 % slowdown read against a threshold of x1.076-1.10 is caught only where the two servers
    happen to agree within ~2 %."""
    decode_caught, decode_judged, eager_caught, eager_judged, whole_runs = 0, 0, 0, 0, 0
    for stem in CANARY_RUNS:
        rows = stored.stored_rows(repo_root, stem)
        for row in (r for r in rows if r["mutation"] == SLOWED):
            judged = stored.ranges_judged(row, stored.baseline(rows, row))
            decode_caught += sum(judged[r].passed is False for r in DECODE)
            decode_judged += sum(judged[r].passed is not None for r in DECODE)
            eager = [judged[r] for r in EAGER if judged[r].passed is not None]
            eager_judged += len(eager)
            eager_caught += sum(j.passed is False for j in eager)
            whole_runs += all(j.passed is False for j in eager)
    assert (decode_caught, decode_judged, eager_caught, eager_judged, whole_runs) == (23, 24, 8, 16, 2)


def test_the_twin_on_the_h100_tile_file_passes_every_gate_and_is_faster_where_the_benchmark_said(repo_root):
    """The served twin with tuned_configs/...device=NVIDIA_H100_80GB_HBM3.json (the H200's tiles): every gate
    passes, and against the bundled rows on the default heuristic (the morning's and the afternoon's H100) the
    speed gate's matched sizes read M=1 x0.905-0.923, M=1024-4095 x0.84-0.87 and M>=4096 x0.80 (the benchmark:
    1.16 / 1.06-1.17 / 1.37 of vLLM against 1.05 / 0.95-1.03 / 1.07). vLLM's kernel, untouched, read
    x1.006-1.016 at M=1 against its own rows there: the gain is the tiles', not this machine's."""
    rows = stored.stored_rows(repo_root, "served-gated-twin-h100-tiles")
    (bundled,), (vllm,) = stored.correct(rows), stored.correct(rows, vllm=True)
    (tiles,) = bundled["tiles"]
    assert tiles["source"] == "tuned file" and tiles["file"].endswith("device=NVIDIA_H100_80GB_HBM3.json")
    assert all(c["passed"] for c in bundled["checks"]) and bundled["status"] == "passed"
    check, _ = speed_check(timing(bundled), timing(vllm), MARGINS, vllm["run"])
    assert check is not None and check.passed
    judged = stored.ranges_judged(bundled, vllm)
    assert len(judged) == 7 and all(j.passed for j in judged.values())  # 7 of 7 judged, each passing
    for stem in ("power-gated-twin", "power-gated-twin-2"):
        earlier = stored.stored_rows(repo_root, stem)
        for heuristic in stored.correct(earlier):
            judged = stored.ranges_judged(bundled, heuristic)
            assert 0.90 <= judged["M=1"].ratio <= 0.93
            assert 0.83 <= judged["M=1024-4095"].ratio <= 0.87
            assert judged["M>=4096"].ratio is None or 0.79 <= judged["M>=4096"].ratio <= 0.81
        for theirs in stored.correct(earlier, vllm=True):
            assert 1.0 <= stored.ranges_judged(vllm, theirs)["M=1"].ratio <= 1.02


def test_flashinfer_cutlass_passes_every_gate_beside_vllms_triton(repo_root):
    """The false-alarm row the issue names: FlashInfer CUTLASS (the CPU-built module, autotuned while vLLM
    warmed up) against vLLM's Triton on the canary, every gate on. Speed: 6 of 7 ranges judged, x0.78-0.98;
    M>=4096 not judged (8 matched calls of the 12 needed), which an eager range may be for a pass."""
    rows = stored.stored_rows(repo_root, "served-gated-canary-fi")
    fi = next(r for r in rows if "fi-cutlass" in r["config"])
    vllm = next(r for r in rows if "vllm" in r["config"])
    assert fi["status"] == "passed" and all(c["passed"] for c in fi["checks"])
    assert {"golden_gate", "layer_check_ranges", "speed_gate"} <= {c["name"] for c in fi["checks"]}
    judged = stored.ranges_judged(fi, vllm)
    assert judged["M>=4096"].passed is None
    assert all(judged[r].passed and judged[r].ratio < 1.0 for r in DECODE + EAGER[:2])
