"""Shape twins: random-weight checkpoints with a real model's MoE and attention shapes, built here.

The GPU lists name real checkpoints (Qwen3-30B-A3B, Mixtral-8x7B, Llama-4-Scout) that cannot be
downloaded everywhere. A twin has the seed model's per-layer shapes and routing semantics exactly
(experts, top-k, hidden and expert sizes, heads, KV heads, head_dim, router placement, shared expert,
attention kinds) with few layers, a tokenizer of our own and random weights at the seed's
initialisation scale (normal, std = initializer_range; norms at one). vLLM serves it through the same
model class as the seed, so the bundled kernels run inside the server at the real shapes: the tile
configurations, launch plans, alignment variants and EP splits that the real model selects.

Deterministic: every tensor is drawn from numpy's PCG64, seeded by (twin seed, tensor name, slice), so the
same bytes come out on every machine, thread count and CPU; built once into the model cache. Usage:

    model_dir = resolve_model("builtin:twin-qwen3-30b-a3b")    # moe_eval.models.builtin dispatches here

The shapes are the builder's own constants (TWINS); tests/twins checks them against committed copies of
the seed models' published config.json (tests/twins/seed_configs/, with their revisions).
Weight names follow the seed checkpoints' files (per-expert tensors for Qwen3 and Mixtral, Llama-4's fused
expert tensors), which is what vLLM's loaders read from the real models.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TWIN_PREFIX = "twin-"
# Shapes read with this tokenizer's vocabulary: the twins' embeddings are small, their MoE layers real-sized.
TWIN_VOCAB = 2048
TWIN_MAX_TOKENS_TRAINED = 8192  # the tokenizer's model_max_length


@dataclass(frozen=True)
class TwinSpec:
    """One seed model's twin: transformers config fields copied from the seed (shape and semantics), the
    twin's own depth, and which weight layout its checkpoint uses."""

    name: str  # builtin:twin-<name>
    seed_model: str  # hub id of the model it stands in for
    architecture: str  # transformers / vLLM architecture name
    model_type: str
    layers: int
    fields: dict[str, Any] = field(default_factory=dict)  # config.json fields taken from the seed
    seed: int = 0
    version: int = 1  # bump when the builder's output changes, so caches rebuild

    @property
    def head_dim(self) -> int:
        """Mixtral's file has no head_dim: its model classes take hidden_size / heads."""
        return self.fields.get("head_dim") or self.fields["hidden_size"] // self.fields["num_attention_heads"]

    @property
    def cache_name(self) -> str:
        return f"{TWIN_PREFIX}{self.name}-v{self.version}-L{self.layers}-s{self.seed}"

    def config_dict(self, vocab_size: int, eos_token_id: int) -> dict[str, Any]:
        """config.json as written into the checkpoint (before transformers normalises it)."""
        extra = {
            "num_hidden_layers": self.layers,
            "vocab_size": vocab_size,
            "eos_token_id": eos_token_id,
            "pad_token_id": eos_token_id,
            "bos_token_id": None,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
        }
        if self.model_type == "llama4_text":
            # One RoPE layer (chunked local attention) and one NoPE layer (global attention, temperature
            # tuning), the two kinds Scout's text model interleaves (every 4th layer NoPE); 1 = RoPE.
            extra["no_rope_layers"] = [1, 0][: self.layers] + [1] * max(0, self.layers - 2)
            extra["moe_layers"] = list(range(self.layers))  # Scout: every layer MoE (interleave step 1)
        return {"architectures": [self.architecture], "model_type": self.model_type, **self.fields, **extra}


QWEN3_30B_A3B = TwinSpec(
    name="qwen3-30b-a3b",
    seed_model="Qwen/Qwen3-30B-A3B",
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    layers=2,
    fields={
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "initializer_range": 0.02,
        "use_sliding_window": False,
        "sliding_window": None,
        "router_aux_loss_coef": 0.001,
    },
)
MIXTRAL_8X7B = TwinSpec(
    name="mixtral-8x7b",
    seed_model="mistralai/Mixtral-8x7B-v0.1",
    architecture="MixtralForCausalLM",
    model_type="mixtral",
    layers=2,
    fields={
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "initializer_range": 0.02,
        "router_aux_loss_coef": 0.02,
    },
)
LLAMA_4_SCOUT = TwinSpec(
    name="llama-4-scout",
    seed_model="meta-llama/Llama-4-Scout-17B-16E-Instruct",
    architecture="Llama4ForCausalLM",
    model_type="llama4_text",
    layers=2,
    fields={
        "hidden_size": 5120,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 16.0,
            "high_freq_factor": 1.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "max_position_embeddings": 10485760,
        "use_qk_norm": True,
        "attention_chunk_size": 8192,
        "attention_bias": False,
        "initializer_range": 0.02,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        # Scout's file leaves attn_temperature_tuning, floor_scale and attn_scale to the config class's
        # defaults (the NoPE layers' temperature tuning); so does the twin.
    },
)
TWINS = {spec.name: spec for spec in (QWEN3_30B_A3B, MIXTRAL_8X7B, LLAMA_4_SCOUT)}


# --- the weights -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorPlan:
    """One checkpoint tensor: its name, shape, and how it is drawn ('normal' at the init scale, or 'ones')."""

    name: str
    shape: tuple[int, ...]
    init: str = "normal"


def weight_plan(spec: TwinSpec, vocab_size: int) -> list[TensorPlan]:
    """Every tensor of the twin's checkpoint, named as in the seed's checkpoint files."""
    f = spec.fields
    d, heads, kv, hd = f["hidden_size"], f["num_attention_heads"], f["num_key_value_heads"], spec.head_dim
    plan = [TensorPlan("model.embed_tokens.weight", (vocab_size, d))]
    for i in range(spec.layers):
        p = f"model.layers.{i}"
        plan += [
            TensorPlan(f"{p}.self_attn.q_proj.weight", (heads * hd, d)),
            TensorPlan(f"{p}.self_attn.k_proj.weight", (kv * hd, d)),
            TensorPlan(f"{p}.self_attn.v_proj.weight", (kv * hd, d)),
            TensorPlan(f"{p}.self_attn.o_proj.weight", (d, heads * hd)),
            TensorPlan(f"{p}.input_layernorm.weight", (d,), "ones"),
            TensorPlan(f"{p}.post_attention_layernorm.weight", (d,), "ones"),
        ]
        plan += list(_moe_tensors(spec, p))
    plan += [TensorPlan("model.norm.weight", (d,), "ones"), TensorPlan("lm_head.weight", (vocab_size, d))]
    return plan


def _moe_tensors(spec: TwinSpec, p: str) -> Iterator[TensorPlan]:
    f = spec.fields
    d = f["hidden_size"]
    if spec.model_type == "qwen3_moe":
        hd, n, ff = spec.head_dim, f["num_experts"], f["moe_intermediate_size"]
        yield TensorPlan(f"{p}.self_attn.q_norm.weight", (hd,), "ones")
        yield TensorPlan(f"{p}.self_attn.k_norm.weight", (hd,), "ones")
        yield TensorPlan(f"{p}.mlp.gate.weight", (n, d))
        for j in range(n):
            yield TensorPlan(f"{p}.mlp.experts.{j}.gate_proj.weight", (ff, d))
            yield TensorPlan(f"{p}.mlp.experts.{j}.up_proj.weight", (ff, d))
            yield TensorPlan(f"{p}.mlp.experts.{j}.down_proj.weight", (d, ff))
    elif spec.model_type == "mixtral":
        n, ff = f["num_local_experts"], f["intermediate_size"]
        yield TensorPlan(f"{p}.block_sparse_moe.gate.weight", (n, d))
        for j in range(n):  # w1 gate, w3 up, w2 down (Mixtral's checkpoint names)
            yield TensorPlan(f"{p}.block_sparse_moe.experts.{j}.w1.weight", (ff, d))
            yield TensorPlan(f"{p}.block_sparse_moe.experts.{j}.w2.weight", (d, ff))
            yield TensorPlan(f"{p}.block_sparse_moe.experts.{j}.w3.weight", (ff, d))
    elif spec.model_type == "llama4_text":
        # Llama-4's checkpoint stores the experts fused and transposed: gate_up (E, D, 2F), down (E, F, D);
        # the
        # router scores on the input and a shared expert runs beside the routed one.
        n, ff = f["num_local_experts"], f["intermediate_size"]
        yield TensorPlan(f"{p}.feed_forward.router.weight", (n, d))
        yield TensorPlan(f"{p}.feed_forward.experts.gate_up_proj", (n, d, 2 * ff))
        yield TensorPlan(f"{p}.feed_forward.experts.down_proj", (n, ff, d))
        yield TensorPlan(f"{p}.feed_forward.shared_expert.gate_proj.weight", (ff, d))
        yield TensorPlan(f"{p}.feed_forward.shared_expert.up_proj.weight", (ff, d))
        yield TensorPlan(f"{p}.feed_forward.shared_expert.down_proj.weight", (d, ff))
    else:
        raise ValueError(f"twin {spec.name}: no weight layout for model_type {spec.model_type}")


def _stream_seed(spec_seed: int, name: str, part: int) -> int:
    """A seed per (twin, tensor, slice): independent of draw order, so slices can be drawn in parallel."""
    return int.from_bytes(hashlib.sha256(f"{spec_seed}/{name}/{part}".encode()).digest()[:8], "little")


def draw(plan: TensorPlan, std: float, spec_seed: int):
    """The tensor as bf16: normal(0, std) drawn slice by slice along dim 0 (fp32, then rounded), or ones."""
    import numpy as np
    import torch

    if plan.init == "ones":
        return torch.ones(plan.shape, dtype=torch.bfloat16)
    out = torch.empty(plan.shape, dtype=torch.bfloat16)
    rows = out.view(plan.shape[0], -1)
    for part in range(plan.shape[0] if out.dim() == 3 else 1):  # a 3-D expert tensor: one stream per expert
        rng = np.random.Generator(np.random.PCG64(_stream_seed(spec_seed, plan.name, part)))
        target = rows[part] if out.dim() == 3 else rows
        values = rng.standard_normal(target.numel(), dtype=np.float32)
        values *= np.float32(std)
        target.copy_(torch.from_numpy(values).view(target.shape))
    return out


def build_twin(spec: TwinSpec, out_dir: Path, threads: int | None = None) -> None:
    """Write the twin's checkpoint (config.json, tokenizer, model-*.safetensors + index) into out_dir."""
    import torch
    from safetensors.torch import save_file

    from moe_eval.models.tokenizer import bpe_tokenizer, tokenizer_corpus

    out_dir.mkdir(parents=True)
    tokenizer = bpe_tokenizer(tokenizer_corpus(spec.seed), TWIN_VOCAB, TWIN_MAX_TOKENS_TRAINED)
    tokenizer.save_pretrained(out_dir)
    vocab = len(tokenizer)
    (out_dir / "config.json").write_text(
        json.dumps(spec.config_dict(vocab, tokenizer.eos_token_id), indent=2) + "\n"
    )
    (out_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.eos_token_id}, indent=2)
        + "\n"
    )
    std = spec.fields["initializer_range"]
    workers = threads or max(1, min(8, os.cpu_count() or 1))
    weight_map: dict[str, str] = {}
    # One file per layer (plus one for embeddings and head): memory stays at one layer's tensors.
    plans = weight_plan(spec, vocab)
    groups: dict[str, list[TensorPlan]] = {}
    for plan in plans:
        layer = plan.name.split(".")[2] if plan.name.startswith("model.layers.") else "rest"
        groups.setdefault(layer, []).append(plan)
    names = sorted(groups, key=lambda g: (g == "rest", int(g) if g != "rest" else 0))
    for index, group in enumerate(names, start=1):
        filename = f"model-{index:05d}-of-{len(names):05d}.safetensors"
        with ThreadPoolExecutor(workers) as pool:  # numpy draws release the GIL; seeds fix every value
            tensors = dict(
                zip(
                    (p.name for p in groups[group]),
                    pool.map(lambda p: draw(p, std, spec.seed), groups[group]),
                    strict=True,
                )
            )
        save_file(tensors, str(out_dir / filename), metadata={"format": "pt"})
        weight_map.update({name: filename for name in tensors})
        del tensors
    total = sum(2 * _numel(p.shape) for p in plans)
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    (out_dir / "moe_eval_twin.json").write_text(
        json.dumps(
            {
                "twin_of": spec.seed_model,
                "name": spec.name,
                "version": spec.version,
                "seed": spec.seed,
                "layers": spec.layers,
                "torch": torch.__version__,
            },
            indent=2,
        )
        + "\n"
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
