"""moe_eval.evaluate.logprobs without a vLLM server: the texts against lm-eval's own rendering, the file
format, divergence and its checks against hand-computed values, the gate's power against a
brute-force binomial, and `capture` against a small fake server shaped like vLLM 0.32.0's reply."""

from __future__ import annotations

import itertools
import json
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self

import numpy as np
import pytest
import yaml

from moe_eval.core.errors import ConfigError, InfraError
from moe_eval.core.logprob_texts import TextLogprobs, read_logprobs, write_logprobs
from moe_eval.evaluate.logprobs import capture, read_rows, scoring_texts
from moe_eval.gates.divergence import Divergence, DivergenceLimits, divergence, divergence_checks
from moe_eval.gates.stats import describe_power, detectable_drop, gate_fail_probability

TRAIN = [
    {"question": "Ann has 3 pens. She buys 2. How many?", "answer": "3 + 2 = <<3+2=5>>5\n#### 5"},
    {"question": "Bo has 10 $ and spends 4.", "answer": "10 - 4 = 6\n#### 6"},
    {"question": "unused", "answer": "#### 0"},
]
TEST = [
    {"question": "Cy has {{7}} eggs\u2019 worth.", "answer": "7 * 2 = 14\n#### 14"},
    {"question": "Di reads 12 pages.  ", "answer": "12 / 3 = 4\n#### 4"},
]


# --- texts -------------------------------------------------------------------------------------


def test_scoring_texts_hand_written():
    shots = (
        "Question: Ann has 3 pens. She buys 2. How many?\nAnswer: 3 + 2 = <<3+2=5>>5\n#### 5\n\n"
        "Question: Bo has 10 $ and spends 4.\nAnswer: 10 - 4 = 6\n#### 6\n\n"
    )
    assert scoring_texts(TRAIN, TEST, 2, 2) == [
        shots + "Question: Cy has {{7}} eggs\u2019 worth.\nAnswer: 7 * 2 = 14\n#### 14",
        shots + "Question: Di reads 12 pages.  \nAnswer: 12 / 3 = 4\n#### 4",
    ]
    assert scoring_texts(TRAIN, TEST, 0, 1) == [
        "Question: Cy has {{7}} eggs\u2019 worth.\nAnswer: 7 * 2 = 14\n#### 14"
    ]


def test_scoring_texts_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match="num_fewshot 4: the train rows hold 3"):
        scoring_texts(TRAIN, TEST, 4, 1)
    with pytest.raises(ValueError, match="n 3: the test rows hold 2"):
        scoring_texts(TRAIN, TEST, 1, 3)
    with pytest.raises(ValueError, match="test row 0: a GSM8K row needs 'question' and 'answer'"):
        scoring_texts(TRAIN, [{"q": "x"}], 1, 1)


def _real_and_odd_rows(gsm8k_dir: str | None) -> tuple[list[dict], list[dict]]:
    """GSM8K's first rows where a local copy exists, and the odd rows above (braces, unicode, trailing
    spaces) in any case."""
    if gsm8k_dir is None:
        return TRAIN * 2, TEST
    folder = Path(gsm8k_dir)
    return read_rows(folder / "train.jsonl")[:6] + TRAIN, read_rows(folder / "test.jsonl")[:3] + TEST


def test_scoring_texts_match_lm_evals_gsm8k_rendering(tmp_path, monkeypatch, gsm8k_dir):
    """lm-eval renders the same rows through its own gsm8k task (the stock YAML, re-pointed at local
    files by moe_eval.evaluate.gsm8k.write_local_task, with the first_n sampler so it takes the first shots
    as scoring_texts does): its prompt + target delimiter + target must be our text, byte for byte."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    from moe_eval.evaluate.gsm8k import write_local_task

    train, test = _real_and_odd_rows(gsm8k_dir)
    data = tmp_path / "data"
    data.mkdir()
    for name, rows in (("train", train), ("test", test)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task_yaml = write_local_task(data, tmp_path / "tasks", "gsm8k_scoring_probe")
    spec = yaml.safe_load(task_yaml.read_text())
    # What the format below depends on: lm-eval's defaults for both delimiters.
    assert "target_delimiter" not in spec and "fewshot_delimiter" not in spec
    spec["fewshot_config"] = {"sampler": "first_n"}
    spec["dataset_kwargs"]["cache_dir"] = str(tmp_path / "hf-cache")  # nothing lands in ~/.cache
    task_yaml.write_text(yaml.safe_dump(spec, sort_keys=False))
    task = TaskManager(include_path=str(task_yaml.parent), include_defaults=False).load(
        ["gsm8k_scoring_probe"]
    )["tasks"]["gsm8k_scoring_probe"]
    rendered = [
        task.fewshot_context(doc, 5) + task.config.target_delimiter + task.doc_to_target(doc)
        for doc in task.test_docs()
    ]
    assert rendered == scoring_texts(train, test, 5, len(test))


def test_read_rows_names_the_bad_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"question": "a", "answer": "b"}\n\n[1]\n')
    with pytest.raises(ConfigError, match=r"rows.jsonl:3: expected a JSON object"):
        read_rows(path)
    path.write_text('{"question": "a", "answer": "b"}\n')
    assert read_rows(path) == [{"question": "a", "answer": "b"}]


# --- files -------------------------------------------------------------------------------------


def _rec(index: int, ids, lps, tops) -> TextLogprobs:
    """tops: per position None or [(id, logprob), ...] (sorted here, most likely first)."""
    top_ids, top_lps = [], []
    for top in tops:
        if top is None:
            top_ids.append(None)
            top_lps.append(None)
            continue
        top = sorted(top, key=lambda p: (-p[1], p[0]))
        top_ids.append(tuple(t for t, _ in top))
        top_lps.append(tuple(float(lp) for _, lp in top))
    return TextLogprobs(index, tuple(ids), tuple(lps), tuple(top_ids), tuple(top_lps))


REC0 = _rec(
    0,
    [7, 3, 9],
    [None, -0.1234567891, -2.0],
    [None, [(3, -0.1234567891), (4, -2.5)], [(8, -0.5), (9, -2.0), (1, -3.0)]],
)
REC1 = _rec(1, [7, 5], [None, -9999.0], [None, [(2, -0.01), (6, -4.6)]])


def test_logprobs_file_round_trip(tmp_path):
    path = tmp_path / "sub" / "logprobs.jsonl"
    write_logprobs(path, [REC0, REC1])
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and " " not in lines[0]  # one compact line per text
    assert json.loads(lines[0])["logprobs"] == [None, -0.123457, -2.0]  # 6 decimals
    back = read_logprobs(path)
    assert back[1] == REC1
    assert back[0].token_ids == REC0.token_ids and back[0].top_ids == REC0.top_ids
    assert back[0].logprobs[1] == -0.123457 and back[0].top_logprobs[1] == (-0.123457, -2.5)
    assert not list(path.parent.glob(".*.tmp"))  # written through a temporary file, renamed


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"index": 0, "token_ids": [1, 2]', "not JSON"),
        ('{"index": 0, "token_ids": [1], "logprobs": [null], "top_ids": [null]}', "missing top_logprobs"),
        (
            '{"index": 0, "token_ids": [1, 2], "logprobs": [null], "top_ids": [null, [2]], '
            '"top_logprobs": [null, [0]]}',
            "differ in length",
        ),
        (
            (
                '{"index": 0, "token_ids": [1, 2], "logprobs": [null, null], "top_ids": [null, null], '
                '"top_logprobs": [null, null]}'
            ),
            "position 1: null",
        ),
        (
            '{"index": "0", "token_ids": [1], "logprobs": [null], "top_ids": [null], "top_logprobs": [null]}',
            "not an integer",
        ),
        (
            (
                '{"index": 0, "token_ids": [1, 2], "logprobs": [null, -1], "top_ids": [null, [2, 3]], '
                '"top_logprobs": [null, [-1]]}'
            ),
            "position 1: top_ids",
        ),
    ],
)
def test_malformed_logprobs_file_names_file_and_line(tmp_path, line, problem):
    path = tmp_path / "lp.jsonl"
    write_logprobs(path, [REC0])
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(ConfigError, match=rf"lp.jsonl:2: .*{problem}"):
        read_logprobs(path)


# --- divergence --------------------------------------------------------------------------------


def _shifted(rec: TextLogprobs, by: float) -> TextLogprobs:
    return TextLogprobs(
        rec.index,
        rec.token_ids,
        tuple(None if v is None else v + by for v in rec.logprobs),
        rec.top_ids,
        tuple(None if t is None else tuple(v + by for v in t) for t in rec.top_logprobs),
    )


def test_identical_captures_diverge_nowhere():
    div = divergence([REC0, REC1], [REC1, REC0])  # matched by index, not by order
    assert div == Divergence(
        texts=2,
        positions=3,
        mean_abs_dlogp=0.0,
        p99_abs_dlogp=0.0,
        max_abs_dlogp=0.0,
        kl_topk=0.0,
        kl_positions_skipped=0,
        top1_flips=0,
        top1_flip_rate=0.0,
    )


def test_a_uniform_shift_moves_logprobs_but_not_the_renormalised_top_k():
    div = divergence([REC0, REC1], [_shifted(REC0, -0.25), _shifted(REC1, -0.25)])
    assert div.mean_abs_dlogp == pytest.approx(0.25) and div.max_abs_dlogp == pytest.approx(0.25)
    assert div.p99_abs_dlogp == pytest.approx(0.25)
    assert div.kl_topk == pytest.approx(0.0, abs=1e-15) and div.top1_flips == 0  # renormalised: unchanged


def test_p99_is_numpys_linear_percentile():
    n = 101  # positions 1..100 carry |Δ| = 0.000, 0.001, ..., 0.099
    ids = list(range(n))
    tops = [None] + [[(1, -0.1), (2, -0.2)]] * (n - 1)
    base = _rec(0, ids, [None] + [-1.0] * (n - 1), tops)
    new = _rec(0, ids, [None] + [-1.0 - 0.001 * i for i in range(n - 1)], tops)
    div = divergence([base], [new])
    # rank 0.99 * (100 - 1) = 98.01: 0.098 + 0.01 * 0.001
    assert div.p99_abs_dlogp == pytest.approx(0.09801) and div.max_abs_dlogp == pytest.approx(0.099)
    assert div.mean_abs_dlogp == pytest.approx(0.0495)


def test_top1_flip_and_tie_break():
    base = _rec(
        0, [1, 2, 3], [None, -0.7, -0.69], [None, [(2, -0.7), (5, -0.9)], [(3, -0.69), (5, -0.69)]]
    )  # pos 2: tie, id 3 wins
    flip = _rec(
        0, [1, 2, 3], [None, -0.9, -0.69], [None, [(2, -0.9), (5, -0.7)], [(5, -0.69), (3, -0.69)]]
    )  # pos 1 flips; pos 2 same tie
    div = divergence([base], [flip])
    assert div.top1_flips == 1 and div.top1_flip_rate == 0.5 and div.positions == 2


def test_kl_on_the_shared_top_k_by_hand():
    """Base top-3 {1: .5, 2: .3, 3: .2}, new {1: .4, 2: .4, 4: .2}: shared {1, 2}, renormalised
    p = (.625, .375), q = (.5, .5); KL = .625 ln(1.25) + .375 ln(.75). Second position: one shared
    token only, KL counted 0 and the position counted as skipped."""
    ln = math.log
    base = _rec(
        0,
        [0, 1, 9],
        [None, ln(0.5), ln(0.1)],
        [None, [(1, ln(0.5)), (2, ln(0.3)), (3, ln(0.2))], [(9, ln(0.1)), (5, ln(0.6)), (6, ln(0.3))]],
    )
    new = _rec(
        0,
        [0, 1, 9],
        [None, ln(0.4), ln(0.1)],
        [None, [(1, ln(0.4)), (2, ln(0.4)), (4, ln(0.2))], [(9, ln(0.1)), (7, ln(0.6)), (8, ln(0.3))]],
    )
    div = divergence([base], [new])
    kl = 0.625 * math.log(1.25) + 0.375 * math.log(0.75)
    assert kl == pytest.approx(0.0315839, abs=1e-7)
    assert div.kl_topk == pytest.approx(kl / 2, rel=1e-12) and div.kl_positions_skipped == 1
    assert div.mean_abs_dlogp == pytest.approx(abs(ln(0.4) - ln(0.5)) / 2)
    assert div.top1_flips == 1  # position 2: 5 -> 7


def test_different_tokens_or_texts_are_refused():
    other = _rec(0, [7, 3, 8], REC0.logprobs, [None, [(3, -0.1)], [(8, -0.5)]])
    with pytest.raises(ValueError, match="text 0: token ids differ at position 2"):
        divergence([REC0, REC1], [other, REC1])
    with pytest.raises(ValueError, match="text 1 is only in the baseline"):
        divergence([REC0, REC1], [REC0])
    shorter = _rec(1, [7], [None], [None])
    with pytest.raises(ValueError, match="text 1: token ids differ at position 1"):
        divergence([REC1], [shorter])


def test_divergence_checks_one_per_limit():
    div = Divergence(
        texts=64,
        positions=25352,
        mean_abs_dlogp=0.0123,
        p99_abs_dlogp=0.2,
        max_abs_dlogp=1.5,
        kl_topk=1e-4,
        kl_positions_skipped=3,
        top1_flips=30,
        top1_flip_rate=30 / 25352,
    )
    assert divergence_checks(div, DivergenceLimits()) == []
    checks = divergence_checks(
        div,
        DivergenceLimits(
            max_mean_abs_dlogp=0.05, max_p99_abs_dlogp=0.1, max_top1_flip_rate=0.002, max_kl_topk=1e-4
        ),
    )
    assert [(c.name, c.passed) for c in checks] == [
        ("logprob_mean_abs", True),
        ("logprob_p99_abs", False),
        ("logprob_top1_flips", True),
        ("logprob_kl", True),
    ]
    assert checks[0].detail == "mean |Δ log p| 0.0123 (limit 0.05) over 25352 positions of 64 texts"
    assert "30 positions" in checks[2].detail and "3 positions with < 2 shared" in checks[3].detail


# --- the gate's power --------------------------------------------------------------------------


def _brute_fail_probability(n: int, p: float, floor: float) -> float:
    """P(correct / n < floor) by building Binomial(n, p) one question at a time (no lgamma, no tail
    formula): an independent check of the closed-form CDF."""
    pmf = np.zeros(n + 1)
    pmf[0] = 1.0
    for i in range(n):
        pmf[1 : i + 2] = pmf[1 : i + 2] * (1 - p) + pmf[0 : i + 1] * p
        pmf[0] *= 1 - p
    passing = np.array([round(k / n - floor, 12) >= 0 for k in range(n + 1)])
    return float(pmf[~passing].sum())


def test_detectable_drop_at_full_gsm8k():
    """1319 questions, expected accuracy 0.88, floor 0.853 (0.88 - 3 stderr): the gate catches a true
    drop of 0.0351 with 80% probability, found by bisection on the lgamma CDF and held here against
    the brute-force binomial just above and below."""
    drop = detectable_drop(1319, 0.88, 0.853)
    assert drop == pytest.approx(0.035116, abs=1e-6)
    p = 0.88 - drop
    assert _brute_fail_probability(1319, p, 0.853) == pytest.approx(0.8, abs=1e-6)
    assert (
        _brute_fail_probability(1319, p + 1e-4, 0.853) < 0.8 < _brute_fail_probability(1319, p - 1e-4, 0.853)
    )
    assert gate_fail_probability(1319, p, 0.853) == pytest.approx(0.8, abs=1e-9)


def test_detectable_drop_shrinks_with_more_questions():
    drops = [detectable_drop(n, 0.88, 0.853) for n in (50, 100, 200, 400, 800, 1319)]
    assert all(a > b for a, b in itertools.pairwise(drops))
    assert detectable_drop(200, 0.88, 0.853, power=0.95) > detectable_drop(200, 0.88, 0.853, power=0.8)


@pytest.mark.parametrize(
    "n, floor, expected_pass",
    [
        (200, 0.9, 180),  # exactly at the floor passes (GateResult's rule)
        (3, 2 / 3, 2),  # 2/3 as a float: equal to the floor after GateResult's 12-digit rounding
        (7, 0.5, 4),
    ],
)
def test_fail_probability_uses_the_gates_rule(n, floor, expected_pass):
    # P(fail) at p -> 1 - 0: only the runs with < expected_pass right fail
    for p in (0.3, 0.7):
        assert gate_fail_probability(n, p, floor) == pytest.approx(
            _brute_fail_probability(n, p, floor), abs=1e-12
        )
    assert gate_fail_probability(n, 1.0, floor) == 0.0
    assert _brute_fail_probability(n, 0.5, floor) == pytest.approx(
        sum(math.comb(n, k) for k in range(expected_pass)) / 2**n
    )


def test_detectable_drop_edges_and_description():
    assert detectable_drop(100, 0.9, 0.0) == math.inf  # a run with none right still passes
    assert detectable_drop(100, 0.5, 0.9) == 0.0  # the floor sits far above: fails without any drop
    assert describe_power(200, 0.88, 0.853) == (
        f"at n=200 the gate (floor 0.8530) catches a drop of >= {detectable_drop(200, 0.88, 0.853):.3f} "
        "from 0.880 with 80% probability"
    )
    assert describe_power(10, 0.9, 0.0).endswith("cannot fail")


# --- capture against a fake vLLM ---------------------------------------------------------------


def _vllm_reply(prompt: str, top_k: int) -> dict:
    """A /v1/completions reply as vLLM 0.32.0 builds it for echo + logprobs + max_tokens 1 +
    return_tokens_as_token_ids (completion/serving.py request_output_to_completion_response and
    _create_completion_logprobs; the response model dumped with every field): prompt tokens then the
    generated one; position 0 None everywhere; each later position's dict holds the actual token
    first, then the top-k, so k + 1 entries when the actual token is outside the top-k (here: odd
    positions). choices[0].prompt_logprobs repeats the prompt's logprobs with ranks; not parsed."""
    ids = [ord(c) for c in prompt] + [10]  # one token per character; the generated token is 10
    tokens, token_lps, tops, offsets, prompt_logprobs = [], [], [], [], []
    for pos, tid in enumerate(ids):
        tokens.append(f"token_id:{tid}")
        offsets.append(sum(len(t) for t in tokens[:-1]))  # lengths of the "token_id:N" strings
        if pos == 0:
            token_lps.append(None)
            tops.append(None)
            prompt_logprobs.append(None)
            continue
        top = {2000 + j: -0.1 * (j + 1) - 0.001 * pos for j in range(top_k)}
        outside = pos % 2 == 1  # odd: the actual token ranks below the top-k
        actual_lp = -5.0 - 0.01 * pos if outside else -0.05
        ranked = [(tid, actual_lp, 50 if outside else 1)]  # the actual token first, with its rank
        others = sorted(top.items(), key=lambda p: -p[1])[: top_k if outside else top_k - 1]
        ranked += [(t, lp, r + (1 if outside else 2)) for r, (t, lp) in enumerate(others)]
        token_lps.append(actual_lp)
        tops.append({f"token_id:{t}": lp for t, lp, _ in ranked})
        if pos < len(ids) - 1:  # the raw prompt logprobs vLLM also returns, keyed by id, with ranks
            prompt_logprobs.append(
                {str(t): {"logprob": lp, "rank": r, "decoded_token": chr(t % 128)} for t, lp, r in ranked}
            )
    return {
        "id": "cmpl-test",
        "object": "text_completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": prompt + "\n",
                "logprobs": {
                    "text_offset": offsets,
                    "token_logprobs": token_lps,
                    "tokens": tokens,
                    "top_logprobs": tops,
                },
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": prompt_logprobs,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": len(ids) - 1,
            "total_tokens": len(ids),
            "completion_tokens": 1,
            "prompt_tokens_details": None,
        },
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


class _FakeVllm:
    def __init__(self, failures_per_prompt: int = 0, status: int = 500) -> None:
        self.requests: list[dict] = []
        self.failures_per_prompt = failures_per_prompt
        self.status = status
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append(body)
                    seen = sum(r["prompt"] == body["prompt"] for r in fake.requests)
                if self.path != "/v1/completions":
                    code, reply = 404, {"error": "not found"}
                elif seen <= fake.failures_per_prompt:
                    code, reply = fake.status, {"error": {"message": "engine hiccup", "code": fake.status}}
                else:
                    code, reply = 200, _vllm_reply(body["prompt"], body["logprobs"])
                data = json.dumps(reply).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # A short poll: shutdown() waits for it (the default 0.5 s would make each test slow).
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_capture_parses_vllms_echo_reply():
    texts = ["abc", "hello"]
    with _FakeVllm() as fake:
        got = capture(fake.url, "m", texts, top_k=3)
    assert fake.requests[0] == {
        "model": "m",
        "prompt": "abc",
        "echo": True,
        "logprobs": 3,
        "max_tokens": 1,
        "temperature": 0.0,
        "return_tokens_as_token_ids": True,
    }
    rec = got[1]
    assert rec.index == 1 and rec.token_ids == tuple(ord(c) for c in "hello")  # the generated token dropped
    assert rec.logprobs[0] is None and rec.top_ids[0] is None and rec.top_logprobs[0] is None
    assert rec.logprobs[1:] == (-5.01, -0.05, -5.03, -0.05)
    # odd position: the actual token (-5.01) came as a (k+1)-th entry and is cut; the true top-3 stay
    assert rec.top_ids[1] == (2000, 2001, 2002) and rec.top_logprobs[1] == pytest.approx(
        (-0.101, -0.201, -0.301)
    )
    # even position: the actual token is the top-1; k entries
    assert rec.top_ids[2] == (ord("l"), 2000, 2001) and rec.top_logprobs[2] == pytest.approx(
        (-0.05, -0.102, -0.202)
    )
    assert [r.token_ids for r in got] == [tuple(map(ord, t)) for t in texts]


def test_capture_with_concurrency_keeps_text_order():
    texts = [f"text {i}" * (i + 1) for i in range(7)]
    with _FakeVllm() as fake:
        sequential = capture(fake.url, "m", texts)
        concurrent = capture(fake.url, "m", texts, concurrency=3)
    assert concurrent == sequential and [r.index for r in concurrent] == list(range(7))


def test_capture_retries_a_5xx():
    with _FakeVllm(failures_per_prompt=1) as fake:
        got = capture(fake.url, "m", ["abc"], retries=3, backoff=0.01)
    assert len(fake.requests) == 2 and got[0].token_ids == (97, 98, 99)


def test_capture_gives_up_with_an_infra_error():
    fake = _FakeVllm(failures_per_prompt=99)
    expected = rf"POST {fake.url}/v1/completions \(text 0\): 3 attempts failed; last: HTTP 500"
    with fake, pytest.raises(InfraError, match=expected):
        capture(fake.url, "m", ["abc"], retries=3, backoff=0.01)
    assert len(fake.requests) == 3


def test_capture_does_not_retry_a_4xx():
    fake = _FakeVllm(failures_per_prompt=99, status=400)
    with fake, pytest.raises(InfraError, match="HTTP 400"):
        capture(fake.url, "m", ["abc"], retries=3, backoff=0.01)
    assert len(fake.requests) == 1


def test_capture_connection_refused_is_an_infra_error():
    with socket.socket() as sock:  # a port nothing listens on once the socket closes
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(InfraError, match=r"2 attempts failed; last: ConnectionError"):
        capture(f"http://127.0.0.1:{port}", "m", ["abc"], retries=2, backoff=0.01, timeout=5)


def test_capture_refuses_a_reply_of_the_wrong_shape():
    from moe_eval.evaluate.logprobs import parse_completion

    with _FakeVllm() as fake:
        good = _vllm_reply("abc", 2)
        bad = json.loads(json.dumps(good))
        bad["usage"]["prompt_tokens"] = 2  # 2 + 1 != 4 echoed tokens
        with pytest.raises(ValueError, match="usage says 2 prompt"):
            parse_completion(bad, 0, 2)
        bad = json.loads(json.dumps(good))
        bad["choices"][0]["logprobs"]["tokens"][1] = (
            "b"  # not an id: the server ignored return_tokens_as_token_ids
        )
        with pytest.raises(ValueError, match="position 1 is 'b'"):
            parse_completion(bad, 0, 2)
        assert capture(fake.url, "m", ["abc"], top_k=2)[0] == parse_completion(good, 0, 2)
