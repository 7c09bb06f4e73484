"""Golden records: what keys them, how they are stored, and that a bad one is refused by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from moe_eval.configs.config import parse_config
from moe_eval.core.errors import ConfigError
from moe_eval.core.logprob_texts import TextLogprobs
from moe_eval.evaluate.golden import (
    GoldenKey,
    GoldenStore,
    golden_server_argv,
    model_identity,
    weights_digest,
)

KEY = GoldenKey(
    model="weights-sha256:ab",
    texts_sha256="cd",
    texts=2,
    decode_texts=1,
    decode_tokens=4,
    server_args=("--dtype", "bfloat16"),
    env=(),
    device="cpu: test",
    vllm="0.32.0",
    torch="2.13.0",
)
PREFILL = [
    TextLogprobs(
        0, (1, 2, 3), (None, -0.5, -0.25), (None, (2, 7), (3, 7)), (None, (-0.5, -2.0), (-0.25, -3.0))
    ),
    TextLogprobs(1, (1, 4), (None, -1.5), (None, (4, 2)), (None, (-1.5, -1.75))),
]
DECODE = [TextLogprobs(0, (5, 6), (-0.125, -0.5), ((5, 1), (6, 1)), ((-0.125, -3.0), (-0.5, -2.0)))]


def config(tmp_path: Path, server_args: str, extra: str = ""):
    text = (
        'model_name: "builtin:canary-qwen3-moe"\naccuracy_threshold: 0.5\nnum_questions: 10\n'
        "num_fewshot: 5\n"
        f'moe_backend: torch\nserver_args: "{server_args}"\n{extra}'
    )
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return parse_config(path, text)


def test_round_trip_and_files_checked(tmp_path):
    store = GoldenStore(tmp_path / "goldens")
    assert store.load(KEY) is None
    saved = store.save(KEY, PREFILL, DECODE, PREFILL, {"made_seconds": 1.0})
    loaded = store.load(KEY)
    assert loaded.prefill == PREFILL and loaded.decode == DECODE and loaded.probe == PREFILL
    assert loaded.path == saved.path == tmp_path / "goldens" / KEY.digest
    assert not [p for p in (tmp_path / "goldens").iterdir() if p.name.startswith(f".{KEY.digest}.")], (
        "no temp left"
    )


def test_a_refresh_swaps_the_record_whole_even_under_a_reader(tmp_path, monkeypatch):
    store = GoldenStore(tmp_path)
    store.save(KEY, PREFILL, DECODE, PREFILL, {})
    store.save(KEY, PREFILL[:1], DECODE, PREFILL[:1], {})  # --refresh: the new record replaces the old
    assert store.load(KEY).prefill == PREFILL[:1]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [KEY.digest]
    # A reader whose read straddles a refresh (golden.json of one record, files of the other) reads again.
    read_once = store._load_once

    def straddled(key):
        monkeypatch.setattr(store, "_load_once", read_once)
        store.save(KEY, PREFILL, DECODE, PREFILL, {})  # the refresh lands mid-read
        raise ConfigError("sha256 is not the one its golden.json records")

    monkeypatch.setattr(store, "_load_once", straddled)
    assert store.load(KEY).prefill == PREFILL
    # Without a swap, a bad record stays an error (never silently reread into a pass).
    monkeypatch.setattr(store, "_load_once", lambda key: (_ for _ in ()).throw(ConfigError("corrupt")))
    with pytest.raises(ConfigError, match="corrupt"):
        store.load(KEY)


def test_a_key_with_env_reloads(tmp_path):
    key = dataclasses.replace(KEY, env=(("VLLM_ATTENTION_BACKEND", "FLASH_ATTN"),))
    store = GoldenStore(tmp_path)
    store.save(key, PREFILL, DECODE, PREFILL, {})
    assert store.load(key).prefill == PREFILL


def test_a_changed_file_is_refused_naming_it(tmp_path):
    store = GoldenStore(tmp_path)
    saved = store.save(KEY, PREFILL, DECODE, PREFILL, {})
    prefill = saved.path / "prefill.jsonl"
    prefill.write_text(prefill.read_text().replace("-0.5", "-0.6"))
    with pytest.raises(ConfigError, match=f"{prefill}.*sha256"):
        store.load(KEY)
    prefill.unlink()
    with pytest.raises(ConfigError, match=f"{prefill}: golden file unreadable"):
        store.load(KEY)


def test_a_corrupt_or_foreign_golden_json_is_refused(tmp_path):
    store = GoldenStore(tmp_path)
    saved = store.save(KEY, PREFILL, DECODE, PREFILL, {})
    meta_path = saved.path / "golden.json"
    meta = json.loads(meta_path.read_text())
    meta["key"]["vllm"] = "0.31.0"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="made for another key \\(differs in vllm\\)"):
        store.load(KEY)
    meta_path.write_text("{not json")
    with pytest.raises(ConfigError, match="corrupt golden record"):
        store.load(KEY)


def test_what_changes_the_key():
    assert dataclasses.replace(KEY, vllm="0.33.0").digest != KEY.digest  # a new vLLM: a new golden
    assert dataclasses.replace(KEY, model="weights-sha256:ff").digest != KEY.digest  # another revision
    assert dataclasses.replace(KEY, texts_sha256="ee").digest != KEY.digest
    assert dataclasses.replace(KEY).digest == KEY.digest


def test_golden_server_drops_parallel_flags_and_is_eager(tmp_path):
    tep = config(tmp_path, "--max-model-len 2048 --tensor-parallel-size 2 --enable-expert-parallel")
    assert golden_server_argv(tep) == ["--max-model-len", "2048", "--enforce-eager"]
    dep = config(tmp_path, "--data-parallel-size=2 -ep --enforce-eager --dtype bfloat16")
    assert golden_server_argv(dep) == ["--enforce-eager", "--dtype", "bfloat16"]
    pp = config(tmp_path, "--tensor-parallel-size 2", 'golden_server_args: "--pipeline-parallel-size 2"\n')
    assert golden_server_argv(pp) == ["--pipeline-parallel-size", "2", "--enforce-eager"]
    eplb = config(tmp_path, "-tp 2 -ep --enable-eplb --num-redundant-experts 2 -dcp 2 --dtype bfloat16")
    assert golden_server_argv(eplb) == ["--dtype", "bfloat16", "--enforce-eager"]


def test_model_identity_hashes_the_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    memo = tmp_path / "memo.json"
    first = model_identity("local", str(tmp_path), memo)
    assert first.startswith("weights-sha256:") and memo.is_file()
    assert weights_digest(tmp_path, memo) == first.split(":", 1)[1]  # from the memo
    (tmp_path / "model.safetensors").write_bytes(b"weights, fine-tuned")
    assert model_identity("local", str(tmp_path), memo) != first


def test_golden_keys_in_configs(tmp_path):
    on = config(tmp_path, "")
    assert on.golden_gated and on.key("golden_margin") == 0.10 and on.decode_texts == 8
    off = config(tmp_path, "", "golden: false\n")
    assert not off.golden_gated
    with pytest.raises(ConfigError, match="key 'golden': value 'yes' must be true or false"):
        config(tmp_path, "", "golden: 'yes'\n")
    with pytest.raises(ConfigError, match="key 'golden_margin'"):
        config(tmp_path, "", "golden_margin: -1\n")
    with pytest.raises(ConfigError, match="key 'logprob_texts': value 4 is too few for the golden gate"):
        config(tmp_path, "", "logprob_texts: 4\n")
    assert not config(tmp_path, "", "logprob_texts: 4\ngolden: false\n").golden_gated
