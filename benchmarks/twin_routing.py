"""How many distinct experts one decode MoE call of the Qwen3-30B-A3B twin touches, against a uniform draw.

Why: the served calls of the twin's CUDA-graph rows (H200, docs/perf.md "Run 3 and the Qwen3-30B-A3B twin")
took 16-24 % less than the kernel benchmark's at the same M, and at those sizes a call is weight-read bound:
its time follows the experts it hits. The benchmark draws routes uniformly; the twin routes through its own
(random-weight) router. This replays the sweep's decode workload on the CPU with transformers: the harness's
prompt pool (`scoring_texts`, `layer_sweep.TokenPool`, DECODE_PROMPT_TOKENS-token prompts), greedy decoding of
DECODE_TOKENS tokens, each layer's router hooked (softmax in fp32, then top-8), and counts distinct experts
over random sets of B sequences at one step (one decode call of batch B).

    python benchmarks/twin_routing.py --gsm8k-dir DIR [--prompts 300] [--out routes.npz]

Not the served run: transformers on the CPU (bf16) may break near-ties among top-8 choices otherwise than
CUDA vLLM, and the served batches are the sweep's own concurrent prompts, not random sets.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from moe_eval.evaluate.layer_sweep import DECODE_PROMPT_TOKENS, DECODE_TOKENS, TokenPool
from moe_eval.evaluate.logprobs import read_rows, scoring_texts
from moe_eval.models.builtin import resolve_model

EXPERTS, TOP_K = 128, 8
BATCHES = (8, 12, 40, 42, 100)
SETS = 50  # random sets of B sequences per (step, B)


def uniform_expectation(batch: int) -> float:
    return EXPERTS * (1 - (1 - 1 / EXPERTS) ** (TOP_K * batch))


def decode_routes(model, prompts: torch.Tensor, chunk: int = 50) -> dict[int, np.ndarray]:
    """Per layer: (steps, sequences, TOP_K) expert ids; step 0 is each prompt's last position (it routes the
    step that makes the first token), steps 1.. feed the generated tokens."""
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(model.model.layers))}

    def hook(index: int):
        def record(module, inputs, outputs):
            seen[index].append(outputs[2].detach().clone())  # Qwen3MoeTopKRouter: router indices

        return record

    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(hook(i))
    steps: dict[int, list[torch.Tensor]] = {i: [] for i in seen}
    with torch.no_grad():
        for start in range(0, prompts.shape[0], chunk):
            ids = prompts[start : start + chunk]
            per: dict[int, list[torch.Tensor]] = {i: [] for i in seen}
            past = None
            for _ in range(DECODE_TOKENS):
                for records in seen.values():
                    records.clear()
                out = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                for i in seen:  # the routes of each sequence's newest position
                    per[i].append(seen[i][0].view(ids.shape[0], -1, TOP_K)[:, -1])
                ids = out.logits[:, -1].argmax(-1, keepdim=True)
            for i in seen:
                steps[i].append(torch.stack(per[i]))
    return {i: torch.cat(parts, 1).numpy() for i, parts in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gsm8k-dir", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--fewshot", type=int, default=5, help="the twin configs' num_fewshot")
    parser.add_argument("--out", type=Path, help="save the expert ids (npz)")
    args = parser.parse_args()
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    path = resolve_model("builtin:twin-qwen3-30b-a3b")
    tokenizer = AutoTokenizer.from_pretrained(path)
    train, test = read_rows(args.gsm8k_dir / "train.jsonl"), read_rows(args.gsm8k_dir / "test.jsonl")
    texts = scoring_texts(train, test, args.fewshot, min(16, len(test)))  # sweep_target's texts
    pool = TokenPool(tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"])
    prompts = torch.tensor([pool.prompt(DECODE_PROMPT_TOKENS, i + 1) for i in range(args.prompts)])
    started = time.time()
    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    routes = decode_routes(model, prompts)
    seconds = time.time() - started
    print(f"{args.prompts} prompts of {DECODE_PROMPT_TOKENS} tokens, {DECODE_TOKENS} steps: {seconds:.0f} s")
    if args.out:
        np.savez(args.out, **{f"layer{i}": r for i, r in routes.items()})
    rng = np.random.default_rng(0)
    print("| layer | positions | " + " | ".join(f"B={b}" for b in BATCHES) + " |")
    print("|---|---|" + "---:|" * len(BATCHES))
    print("| - | uniform draw | " + " | ".join(f"{uniform_expectation(b):.1f}" for b in BATCHES) + " |")
    for layer, r in routes.items():
        for label, selected in (("prompt's last", [0]), ("decode steps", range(1, DECODE_TOKENS))):
            cells = []
            for batch in BATCHES:
                counts = np.array(
                    [
                        len(np.unique(r[step, rng.choice(r.shape[1], batch, replace=False)]))
                        for step in selected
                        for _ in range(SETS)
                    ]
                )
                cells.append(f"{counts.mean():.1f} ({counts.min()}-{counts.max()})")
            print(f"| {layer} | {label} | " + " | ".join(cells) + " |")
        share = np.sort(np.bincount(r[1:].ravel(), minlength=EXPERTS))[::-1]
        top = share[:16].sum() / share.sum()
        print(f"layer {layer}: the top 16 experts take {top:.0%} of the decode slots (uniform: 12.5 %)")


if __name__ == "__main__":
    main()
