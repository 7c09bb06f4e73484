"""Models that moe-eval builds itself, so the embedded default needs no hub.

`builtin:tiny-qwen3-moe` is a Qwen3-MoE checkpoint (transformers' own model class, so vLLM
serves it unchanged) with random weights from a fixed seed and a byte-level BPE tokenizer
trained locally on generated text. It is built on first use into the cache and reused. Usage:

    model_dir = resolve_model("builtin:tiny-qwen3-moe")   # -> Path to an HF checkpoint folder
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from moe_eval.core.errors import ConfigError
from moe_eval.models.tokenizer import bpe_tokenizer, tokenizer_corpus

BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class TinyMoeSpec:
    """Shape of a tiny Qwen3-MoE; small enough to serve on 2 CPU cores in seconds."""

    vocab_size: int = 2048
    hidden_size: int = 128
    moe_intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 8192
    dtype: str = "bfloat16"
    seed: int = 0
    version: int = 1  # bump when the builder's output changes, so caches rebuild

    @property
    def cache_name(self) -> str:
        return (
            f"tiny-qwen3-moe-v{self.version}-E{self.num_experts}K{self.num_experts_per_tok}"
            f"-D{self.hidden_size}F{self.moe_intermediate_size}-{self.dtype}-s{self.seed}"
        )


BUILTIN_MODELS = {"tiny-qwen3-moe": TinyMoeSpec()}
# Shipped, not built: trained by `python -m moe_eval.canary.train` (docs/canary.md).
CANARY_NAME = "canary-qwen3-moe"
CANARY_DIR = Path(__file__).resolve().parents[1] / "canary" / "checkpoint"


def cache_root() -> Path:
    return Path(os.environ.get("MOE_EVAL_CACHE", Path.home() / ".cache" / "moe-eval"))


def resolve_model(model_name: str) -> str:
    """A hub id or local dir passes through; builtin:<name> is built (once) and its folder returned."""
    if not model_name.startswith(BUILTIN_PREFIX):
        return model_name
    name = model_name[len(BUILTIN_PREFIX) :]
    if name == CANARY_NAME:
        if not (CANARY_DIR / "model.safetensors").exists():
            raise ConfigError(
                f"model_name: value '{model_name}': the canary checkpoint is missing from {CANARY_DIR}"
            )
        return str(CANARY_DIR)
    from moe_eval.models.twins import TWIN_PREFIX, TWINS, build_twin

    if name.startswith(TWIN_PREFIX) and name[len(TWIN_PREFIX) :] in TWINS:
        spec = TWINS[name[len(TWIN_PREFIX) :]]
        return str(ensure_built(cache_root() / "models", spec.cache_name, lambda out: build_twin(spec, out)))
    if name not in BUILTIN_MODELS:
        known = [*BUILTIN_MODELS, CANARY_NAME, *(TWIN_PREFIX + t for t in TWINS)]
        raise ConfigError(
            f"model_name: value '{model_name}' names no builtin model; "
            f"known: {', '.join(BUILTIN_PREFIX + n for n in known)}"
        )
    return str(ensure_tiny_moe(BUILTIN_MODELS[name], cache_root() / "models"))


def ensure_tiny_moe(spec: TinyMoeSpec, root: Path) -> Path:
    """Build the checkpoint unless the cache has it; safe against concurrent builders."""
    return ensure_built(root, spec.cache_name, lambda out: build_tiny_moe(spec, out))


def ensure_built(root: Path, cache_name: str, build: Callable[[Path], None]) -> Path:
    """root/cache_name, built by `build(staging_dir)` unless the cache has it; safe against concurrent
    builders (a lock file), and atomic: readers see a whole checkpoint or none."""
    target = root / cache_name
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{cache_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            staging = root / f".{cache_name}.building-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            try:
                build(staging)
            except BaseException:
                shutil.rmtree(
                    staging, ignore_errors=True
                )  # a killed or failed build leaves no half checkpoint
                raise
            os.replace(staging, target)
    return target


def qwen3_moe_config(spec: Any, tokenizer: Any, dtype: str, **extra: Any):
    """transformers' Qwen3MoeConfig in the shape of `spec` (TinyMoeSpec's shape fields): every layer MoE,
    top-k weights renormalised, untied embeddings, the tokenizer's vocabulary, EOS and pad; `extra`: more
    Qwen3MoeConfig arguments."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.moe_intermediate_size * 2,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype=dtype,
        **extra,
    )


def build_tiny_moe(spec: TinyMoeSpec, out_dir: Path) -> None:
    import torch
    from transformers import Qwen3MoeForCausalLM

    out_dir.mkdir(parents=True)
    fast = bpe_tokenizer(tokenizer_corpus(spec.seed), spec.vocab_size, spec.max_position_embeddings)
    fast.save_pretrained(out_dir)

    torch.manual_seed(spec.seed)
    config = qwen3_moe_config(spec, fast, spec.dtype)
    model = Qwen3MoeForCausalLM(config).to(getattr(torch, spec.dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "moe_eval_spec.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")


@dataclass(frozen=True)
class MoeShape:
    """What a mutation's target must name: the model's layers (indices 0..layers-1) and global experts."""

    layers: int
    experts: int


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # as the families name it


def moe_shape(model_name: str) -> MoeShape | None:
    """The model's layer and expert counts without building or downloading it: a builtin's spec, the canary's
    or a local checkpoint's config.json; None where only the server will know (a hub id)."""
    name = model_name.removeprefix(BUILTIN_PREFIX)
    if model_name.startswith(BUILTIN_PREFIX):
        from moe_eval.models.twins import TWIN_PREFIX, TWINS

        if name in BUILTIN_MODELS:
            spec = BUILTIN_MODELS[name]
            return MoeShape(spec.num_hidden_layers, spec.num_experts)
        if name.startswith(TWIN_PREFIX) and name[len(TWIN_PREFIX) :] in TWINS:
            twin = TWINS[name[len(TWIN_PREFIX) :]]
            return _shape_of(twin.fields | {"num_hidden_layers": twin.layers})
        path = CANARY_DIR / "config.json" if name == CANARY_NAME else None
    else:
        path = Path(model_name) / "config.json"
    if path is None or not path.is_file():
        return None
    try:
        return _shape_of(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _shape_of(config: dict[str, Any]) -> MoeShape | None:
    experts = next((config[k] for k in EXPERT_COUNT_KEYS if isinstance(config.get(k), int)), None)
    layers = config.get("num_hidden_layers")
    if experts is None or not isinstance(layers, int):
        return None
    return MoeShape(layers, experts)
