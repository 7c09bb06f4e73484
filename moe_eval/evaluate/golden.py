"""Golden references: a config's scoring texts scored by the same model with its MoE computed exactly.

A golden record is what the golden gate (moe_eval.gates.golden_errors) measures kernels against. It is made
by a vLLM server whose MoE layers run the reference backend (moe_eval.kernels.reference_moe: fp32,
IEEE, weights upcast per expert on the fly; never a kernel under test, never mutated), eager, at the
config's layout with its parallel flags removed (TP=1), or at `golden_server_args` where one GPU cannot
hold the model (pipeline parallelism keeps TP=1's arithmetic). Everything else about the model is what
the run serves: the same bf16 weights, attention, norms and router, so golden and run differ by the MoE
kernel's error alone.

A record holds, per text, the reference tokens' log-probabilities and top-k (prefill, `prefill.jsonl`),
the greedy continuation of the first `decode_texts` prompts (`decode.jsonl`), and the same prefill
scored with global expert 0's output 5% short (`probe.jsonl`: the gate's power, never a golden; the same
server switches it on after the golden's texts, kernels/golden_probe.py). It
is content-addressed by what determines it (GoldenKey: the model's weights hash or hub revision, the
texts' hash, vLLM and torch versions, device, golden method, server arguments that change numbers,
top-k, decode length, probe) in a cache folder CI can keep between runs (`--golden-cache`,
MOE_EVAL_GOLDEN_CACHE, default ~/.cache/moe-eval/goldens). A new vLLM, model revision or text set
makes a new key, so a stale record is never found; a record whose files do not match its own
golden.json (sha256) or whose key differs is an error naming the file, never reused.

Stages: `golden_spec` (key, server args, texts) -> `GoldenStore.load` or `make_golden` (under a file
lock, so configs running in parallel make one record) -> `GoldenStore.save` (atomic: a folder renamed
into place).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moe_eval.configs.config import EvalConfig
from moe_eval.core.errors import ConfigError, InfraError
from moe_eval.core.layout import layout_from_server_args
from moe_eval.core.logprob_texts import TOP_K, TextLogprobs, read_logprobs, write_logprobs
from moe_eval.core.plugin_protocol import GOLDEN_PROBE_EXTENSION, GOLDEN_PROBE_METHOD, GOLDEN_PROBE_MUTATION
from moe_eval.core.results import atomic_write_json, versions
from moe_eval.evaluate.gsm8k import Gsm8kData
from moe_eval.evaluate.serving import (
    capture_continuations,
    capture_prefill,
    scoring_inputs,
    server_launch,
    serving,
)
from moe_eval.kernels.mutations import ONE_EXPERT_SCALE, TARGET_EXPERT

GOLDEN_FORMAT = 1  # golden.json's layout; a record of another format is refused by name
GOLDEN_METHOD = (
    "bf16 model; MoE exact: fp32 IEEE GEMMs and sums, weights upcast per expert (reference_moe); eager"
)
REFERENCE_BACKEND = "reference"
# Global expert TARGET_EXPERT's output short by PROBE_SCALE_ERROR (kernels/mutations.py).
PROBE = GOLDEN_PROBE_MUTATION
PROBE_SCALE_ERROR = round(1 - ONE_EXPERT_SCALE, 6)
FILES = ("prefill.jsonl", "decode.jsonl", "probe.jsonl")

# Parallel flags dropped from a config's server arguments for its golden (the golden is TP=1 unless
# golden_server_args says otherwise): value flags, then switches.
_PARALLEL_VALUE_FLAGS = (
    "--tensor-parallel-size",
    "-tp",
    "--data-parallel-size",
    "-dp",
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size-local",
    "--data-parallel-address",
    "--data-parallel-rpc-port",
    "--data-parallel-start-rank",
    "--decode-context-parallel-size",
    "-dcp",
    "--eplb-config",
    "--num-redundant-experts",
)
# Expert load balancing moves experts between ranks: meaningless in a one-rank golden.
_PARALLEL_SWITCHES = ("--enable-expert-parallel", "-ep", "--enable-eplb")
# Server arguments that do not change the numbers of a text scored alone (memory, admission, logging),
# left out of the key so that, for example, two configs differing only in memory share a golden.
_NON_NUMERIC_VALUE_FLAGS = (
    "--gpu-memory-utilization",
    "--max-num-seqs",
    "--max-model-len",
    "--swap-space",
    "--kv-cache-memory-bytes",
    "--cpu-offload-gb",
    "--api-server-count",
)
_NON_NUMERIC_SWITCHES = (
    "--enforce-eager",
    "--disable-log-requests",
    "--disable-log-stats",
    "--no-enable-log-requests",
)


def cache_dir(option: str | None = None) -> Path:
    """--golden-cache, else MOE_EVAL_GOLDEN_CACHE, else <MOE_EVAL_CACHE or ~/.cache/moe-eval>/goldens."""
    if option:
        return Path(option).resolve()
    if os.environ.get("MOE_EVAL_GOLDEN_CACHE"):
        return Path(os.environ["MOE_EVAL_GOLDEN_CACHE"]).resolve()
    from moe_eval.models.builtin import cache_root

    return cache_root() / "goldens"


def _drop_flags(argv: list[str], value_flags: tuple[str, ...], switches: tuple[str, ...]) -> list[str]:
    kept, skip = [], False
    for word in argv:
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name in value_flags:
            skip = "=" not in word
            continue
        if name in switches:
            continue
        kept.append(word)
    return kept


def golden_server_argv(config: EvalConfig) -> list[str]:
    """The golden server's arguments: golden_server_args, else the config's without parallel flags;
    always eager (no CUDA graphs, no compiled MoE: the reference runs as written)."""
    if config.golden_server_args is not None:
        argv = shlex.split(config.golden_server_args)
    else:
        argv = _drop_flags(config.server_argv, _PARALLEL_VALUE_FLAGS, _PARALLEL_SWITCHES)
    return argv if "--enforce-eager" in argv else [*argv, "--enforce-eager"]


# --- the key ---------------------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)


def weights_digest(model_dir: Path, memo_path: Path | None = None) -> str:
    """sha256 over a checkpoint folder's weights, config and tokenizer files (name + content hash each).
    A multi-GB checkpoint takes minutes to hash: each file's hash is remembered in `memo_path` by path,
    size and modification time, so it is hashed once per machine."""
    memo: dict[str, str] = {}
    if memo_path is not None and memo_path.is_file():
        with contextlib.suppress(OSError, ValueError):
            memo = json.loads(memo_path.read_text())
    files = sorted(
        p
        for p in model_dir.iterdir()
        if p.is_file() and (p.suffix in (".safetensors", ".bin", ".pt") or p.name in _MODEL_FILES)
    )
    if not files:
        raise ConfigError(f"{model_dir}: no weights (*.safetensors, *.bin) to identify the model by")
    total = hashlib.sha256()
    changed = False
    for path in files:
        stat = path.stat()
        memo_key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        if memo_key not in memo:
            memo[memo_key] = _sha256_file(path)
            changed = True
        total.update(f"{path.name}\0{memo[memo_key]}\n".encode())
    if changed and memo_path is not None:
        atomic_write_json(memo_path, memo)
    return total.hexdigest()


def model_identity(model_name: str, model_path: str, memo_path: Path | None = None) -> str:
    """'weights-sha256:<hex>' for a local checkpoint (builtin models included); for a hub id, the
    revision of the local hub cache's snapshot, else the hub's current revision, else the id alone
    (said so: 'unresolved')."""
    path = Path(model_path)
    if path.is_dir():
        return f"weights-sha256:{weights_digest(path, memo_path)}"
    with contextlib.suppress(Exception):
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(model_name, local_files_only=True))
        return f"hub:{model_name}@{local.name}"
    with contextlib.suppress(Exception):
        from huggingface_hub import HfApi

        return f"hub:{model_name}@{HfApi().model_info(model_name, timeout=10).sha}"
    return f"hub:{model_name}@unresolved"


@dataclass(frozen=True)
class GoldenKey:
    """What determines a golden record; its digest names the cache folder."""

    model: str
    texts_sha256: str
    texts: int
    decode_texts: int
    decode_tokens: int
    server_args: tuple[str, ...]  # the golden server's, less those that change no number
    env: tuple[tuple[str, str], ...]  # the config's env for the server
    device: str  # "cpu: <model>" or the GPU's name
    vllm: str | None
    torch: str | None
    method: str = GOLDEN_METHOD
    top_k: int = TOP_K
    probe: str = f"{PROBE} expert {TARGET_EXPERT} x {1 - PROBE_SCALE_ERROR:g}"
    format: int = GOLDEN_FORMAT

    def as_dict(self) -> dict:
        # Through JSON and back: nested tuples (env pairs) must compare equal to what golden.json holds.
        return json.loads(json.dumps(asdict(self)))

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class GoldenSpec:
    """One config's golden: its key, the server that makes it and the texts it scores."""

    key: GoldenKey
    model_path: str
    server_argv: tuple[str, ...]
    texts: tuple[str, ...]
    prompts: tuple[str, ...]  # decode prompts

    @property
    def world_size(self) -> int:
        return layout_from_server_args(list(self.server_argv)).world_size


def golden_spec(
    config: EvalConfig, data: Gsm8kData, model_path: str, device: str, memo_path: Path | None = None
) -> GoldenSpec:
    """ConfigError when the config cannot have a golden (no texts, no local questions)."""
    if config.logprob_texts == 0:
        raise ConfigError(
            f"{config.path}: key 'golden': value true needs logprob_texts > 0 (the texts it scores)"
        )
    inputs = scoring_inputs(config, data)
    if inputs is None:
        raise ConfigError(
            f"{config.path}: key 'golden': the golden gate scores GSM8K texts, and none can be had: "
            f"{data.unavailable() or 'the questions are empty'}"
        )
    texts, prompts = inputs.texts, inputs.prompts
    argv = golden_server_argv(config)
    numeric = _drop_flags(argv, _NON_NUMERIC_VALUE_FLAGS, _NON_NUMERIC_SWITCHES)
    texts_sha = hashlib.sha256(json.dumps([texts, prompts]).encode()).hexdigest()
    key = GoldenKey(
        model=model_identity(config.model_name, model_path, memo_path),
        texts_sha256=texts_sha,
        texts=len(texts),
        decode_texts=len(prompts),
        decode_tokens=config.decode_tokens,
        server_args=tuple(numeric),
        env=tuple(sorted(config.env.items())),
        device=device,
        vllm=versions()["vllm"],
        torch=versions()["torch"],
    )
    return GoldenSpec(key, model_path, tuple(argv), tuple(texts), tuple(prompts))


# --- the store -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Golden:
    key: GoldenKey
    path: Path  # the record's folder
    prefill: list[TextLogprobs]
    decode: list[TextLogprobs]
    probe: list[TextLogprobs]
    meta: dict = field(default_factory=dict)  # golden.json: made_at, made_seconds, server argv, noise, ...

    def describe(self) -> dict:
        return {
            "digest": self.key.digest,
            "path": str(self.path),
            "key": self.key.as_dict(),
            "made_at": self.meta.get("made_at"),
            "made_seconds": self.meta.get("made_seconds"),
            "noise": self.meta.get("noise"),
        }


class GoldenStore:
    """Records under `root/<digest>/`: golden.json (key, files' sha256, how it was made) and FILES."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def folder(self, key: GoldenKey) -> Path:
        return self.root / key.digest

    def load(self, key: GoldenKey) -> Golden | None:
        """The record for `key`; None when there is none. ConfigError naming the file when one is there
        but corrupt or made for another key: never silently reused, never silently replaced. A record that
        a `--refresh` swapped while it was being read is read again, not called corrupt."""
        folder = self.folder(key)
        try:
            before = folder.stat().st_ino
        except FileNotFoundError:
            return None
        try:
            return self._load_once(key)
        except ConfigError:
            try:
                swapped = folder.stat().st_ino != before
            except FileNotFoundError:
                return None  # gone mid-read (a refresh between its two renames): the caller makes it, locked
            if not swapped:
                raise
            return self._load_once(key)

    def _load_once(self, key: GoldenKey) -> Golden | None:
        folder = self.folder(key)
        meta_path = folder / "golden.json"
        if not folder.exists():
            return None
        fix = f"delete {folder} (or run `moe-eval golden --refresh`) to make it anew"
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{meta_path}: corrupt golden record ({exc}); {fix}") from None
        if not isinstance(meta, dict) or meta.get("format") != GOLDEN_FORMAT:
            raise ConfigError(
                f"{meta_path}: golden record of format "
                f"{meta.get('format') if isinstance(meta, dict) else '?'}"
                f", this moe-eval reads format {GOLDEN_FORMAT}; {fix}"
            )
        if meta.get("key") != key.as_dict():
            diff = sorted(k for k in key.as_dict() if (meta.get("key") or {}).get(k) != key.as_dict()[k])
            raise ConfigError(
                f"{meta_path}: golden record made for another key (differs in {', '.join(diff)}); {fix}"
            )
        records = {}
        for name in FILES:
            path = folder / name
            expected = (meta.get("files") or {}).get(name)
            try:
                actual = _sha256_file(path)
            except OSError as exc:
                raise ConfigError(f"{path}: golden file unreadable ({exc.strerror or exc}); {fix}") from None
            if actual != expected:
                raise ConfigError(
                    f"{path}: golden file's sha256 {actual[:16]}... is not the {str(expected)[:16]}... "
                    f"its golden.json records (changed or cut short); {fix}"
                )
            records[name] = read_logprobs(path)
        return Golden(
            key, folder, records["prefill.jsonl"], records["decode.jsonl"], records["probe.jsonl"], meta
        )

    def save(
        self,
        key: GoldenKey,
        prefill: list[TextLogprobs],
        decode: list[TextLogprobs],
        probe: list[TextLogprobs],
        meta: dict,
    ) -> Golden:
        """Written into a temporary folder beside the target, then renamed into place: a reader sees a
        whole record or none."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{key.digest}."))
        try:
            for name, records in zip(FILES, (prefill, decode, probe)):
                write_logprobs(tmp / name, records)
            meta = {
                **meta,
                "format": GOLDEN_FORMAT,
                "key": key.as_dict(),
                "files": {name: _sha256_file(tmp / name) for name in FILES},
            }
            atomic_write_json(tmp / "golden.json", meta)
            target = self.folder(key)
            old = None
            if target.exists():  # a refresh: the old record moves aside only once the new one is whole
                old = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{key.digest}.old."))
                os.replace(target, old / "record")
            os.replace(tmp, target)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return Golden(key, self.folder(key), prefill, decode, probe, meta)

    @contextlib.contextmanager
    def lock(self, key: GoldenKey, waiting: Callable[[], None] = lambda: None) -> Iterator[None]:
        """One maker per key across processes (`run --jobs`, parallel CI steps sharing a cache)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f".{key.digest}.lock", "w") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waiting()
                fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)


# --- making one ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerPlace:
    """Where golden servers run: the hardware kind and the devices a config may use."""

    hw: str
    devices: tuple[int, ...] | None
    gpus: int  # GPUs on the machine (0 on the CPU)
    log_dir: Path  # server logs of the golden and probe servers (also copied into the record)
    progress: Callable[[str], None] = lambda _: None
    stage: Callable[[str], None] = lambda _: None


def _switch_probe(base_url: str, state: str, timeout: float, log_path: Path) -> list[dict[str, Any]]:
    """The golden server's probe on or off in every worker (moe_eval.kernels.golden_probe); the workers'
    answers, checked: a worker that reached no reference layer, or a probe no worker holds, is an error."""
    import requests  # lazy, as in logprobs: the module's other stages need no HTTP

    url = f"{base_url}/collective_rpc"
    try:
        reply = requests.post(url, json={"method": GOLDEN_PROBE_METHOD, "args": [state]}, timeout=timeout)
        reply.raise_for_status()
        answers = reply.json()["results"]
    except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
        raise InfraError(
            f"the golden server did not switch its power probe {state} ({url}): {type(exc).__name__}: {exc}; "
            f"server log {log_path}"
        ) from exc
    if not answers or any(not isinstance(a, dict) or a.get("layers", 0) < 1 for a in answers):
        raise InfraError(
            f"the golden server's workers reached no reference MoE layer when switching the probe {state}: "
            f"{answers}; server log {log_path}"
        )
    if state == "on" and not any(a.get("target_layers", 0) for a in answers):
        raise InfraError(f"no worker of the golden server holds expert {TARGET_EXPERT}: {answers}")
    return answers


def _serve_and_score(
    spec: GoldenSpec, config: EvalConfig, place: ServerPlace, log_path: Path
) -> tuple[list[TextLogprobs], list[TextLogprobs], list[TextLogprobs], dict[str, Any]]:
    """One eager server with the reference MoE: the golden's prefill and decode, then, with the probe
    switched on in place, the probe's prefill. (prefill, decode, probe, timings and the workers' answers)."""
    plan_server = server_launch(
        config,
        spec.model_path,
        hw=place.hw,
        devices=place.devices,
        run_dir=log_path.parent,
        log_path=log_path,
        moe_backend=REFERENCE_BACKEND,
        # The extension adds the probe switch's method to vLLM's worker; it changes no number.
        server_args=[*spec.server_argv, "--worker-extension-cls", GOLDEN_PROBE_EXTENSION],
        # /collective_rpc, for the probe switch; this server is local and short-lived.
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    timings: dict[str, Any] = {}
    started = time.monotonic()
    with serving(plan_server, "", place.progress) as served:
        timings["golden_server_start_seconds"] = time.monotonic() - started

        def score() -> list[TextLogprobs]:
            # Prompt log-probabilities never read vLLM's prefix cache (its SamplingParams rule, 0.26 and
            # 0.32), so the probe's pass cannot reuse the golden's KV blocks.
            return capture_prefill(config, served.base_url, spec.model_path, spec.texts)

        prefill = score()
        decode = capture_continuations(config, served.base_url, spec.model_path, spec.prompts)
        timings["golden_scoring_seconds"] = (
            time.monotonic() - started - timings["golden_server_start_seconds"]
        )
        place.stage("making the golden's power probe")
        probe_started = time.monotonic()
        timings["probe_switch"] = _switch_probe(
            served.base_url, "on", config.request_timeout_seconds, log_path
        )
        probe = score()
        _switch_probe(served.base_url, "off", config.request_timeout_seconds, log_path)
        timings["probe_seconds"] = time.monotonic() - probe_started
    return prefill, decode, probe, timings


def make_golden(spec: GoldenSpec, config: EvalConfig, place: ServerPlace, store: GoldenStore) -> Golden:
    """Serve the golden (one server: the golden's texts, then the probe's), save the record."""
    if place.hw != "cpu" and spec.world_size > place.gpus:
        raise ConfigError(
            f"{config.path}: the golden needs {spec.world_size} GPU(s) (server args "
            f"{' '.join(spec.server_argv)!r}) and this machine has {place.gpus}: set golden_server_args "
            "with a --pipeline-parallel-size that fits, or make the golden where it fits (`moe-eval golden`) "
            "and share the cache folder (--golden-cache)"
        )
    place.log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    place.stage("making the golden reference")
    place.progress(
        f"  making the golden reference {spec.key.digest} (exact fp32 MoE, "
        f"{' '.join(spec.server_argv)}); logs in {place.log_dir}"
    )
    prefill, decode, probe, timings = _serve_and_score(
        spec, config, place, place.log_dir / "golden-server.log"
    )
    meta = {
        "made_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "made_seconds": time.monotonic() - started,
        **timings,
        "server_argv": list(spec.server_argv),
        "model_path": spec.model_path,
        "config": str(config.path),
        "versions": versions(),
        "probe": {
            "mutation": PROBE,
            "expert": TARGET_EXPERT,
            "scale_error": PROBE_SCALE_ERROR,
            "how": "switched on in place in the golden's server after its texts (kernels/golden_probe.py)",
        },
    }
    golden = store.save(spec.key, prefill, decode, probe, meta)
    with contextlib.suppress(OSError):
        shutil.copy(place.log_dir / "golden-server.log", golden.path / "golden-server.log")
    place.progress(f"  golden reference made in {meta['made_seconds']:.0f} s: {golden.path}")
    return golden


def ensure_golden(
    spec: GoldenSpec, config: EvalConfig, place: ServerPlace, store: GoldenStore, refresh: bool = False
) -> tuple[Golden, bool]:
    """The cached record, or a new one made now. (golden, made_now)."""
    if not refresh:
        found = store.load(spec.key)
        if found is not None:
            return found, False

    def waiting() -> None:
        place.progress(f"  waiting for another process making golden {spec.key.digest}")
        place.stage("waiting for the golden reference")

    with store.lock(spec.key, waiting):
        found = None if refresh else store.load(spec.key)  # made by another process while we waited
        if found is not None:
            return found, False
        try:
            return make_golden(spec, config, place, store), True
        except InfraError as exc:
            raise InfraError(f"making the golden reference for {config.path}: {exc}") from None


def describe_key(key: GoldenKey) -> dict[str, Any]:
    return {"digest": key.digest, **key.as_dict()}
