"""The canary's answers with its experts computed by each bundled kernel, in-process (no vLLM).

Loads the canary checkpoint with transformers, replaces every MoE layer's expert computation by
a bundled kernel (torch path, then Triton), greedily answers the same few-shot prompts, and
reports each kernel's accuracy and how often the two kernels give the same final answer. Usage
(on a GPU; the Triton kernel needs CUDA):

    python -m moe_eval.canary.agreement --model moe_eval/canary/checkpoint --questions 300 --out
    agreement.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

from moe_eval.canary.train import doc_text, fewshot_context
from moe_eval.evaluate.canary_task import canary_splits
from moe_eval.gates.answers import INVALID

ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm-eval gsm8k's strict-match pattern


def use_kernel(model: torch.nn.Module, kernel) -> int:
    """Route every experts module (gate_up_proj [E, 2F, D] gate rows first, down_proj [E, D, F]) to
    `kernel`."""
    patched = 0
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):

            def forward(hidden, top_k_index, top_k_weights, _m=module):
                return kernel(
                    hidden.contiguous(),
                    _m.gate_up_proj,
                    _m.down_proj,
                    top_k_weights.float().contiguous(),
                    top_k_index.to(torch.int32).contiguous(),
                )

            module.forward = forward
            patched += 1
    return patched


@torch.no_grad()
def answers(model, tokenizer, prompts: list[str], max_new_tokens: int, batch: int) -> list[str]:
    out = []
    for i in range(0, len(prompts), batch):
        enc = tokenizer(
            prompts[i : i + batch], return_tensors="pt", padding=True, add_special_tokens=False
        ).to(model.device)
        gen = model.generate(
            **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        texts = tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        for text in texts:
            text = text.split("Question:")[0]  # the server cuts here too (lm-eval's stop sequence)
            match = ANSWER.search(text)
            out.append(match.group(1) if match else INVALID)
    return out


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_eval.kernels.fused_moe import fused_moe
    from moe_eval.kernels.torch_moe import torch_moe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    train, test = canary_splits()
    context = fewshot_context(train[:5])
    prompts = [context + doc_text(item)[0] for item in test[: args.questions]]
    targets = [item["answer"].rsplit("#### ", 1)[1] for item in test[: args.questions]]
    result = {"questions": len(prompts), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    got = {}
    for name, kernel in (("torch", torch_moe), ("triton", fused_moe)):
        layers = use_kernel(model, kernel)
        started = time.time()
        got[name] = answers(model, tokenizer, prompts, max_new_tokens=64, batch=args.batch)
        accuracy = sum(a == t for a, t in zip(got[name], targets)) / len(targets)
        result[name] = {"layers_patched": layers, "accuracy": accuracy, "seconds": time.time() - started}
        print(f"{name}: {layers} MoE layers, accuracy {accuracy:.4f}", flush=True)
    agree = sum(a == b for a, b in zip(got["torch"], got["triton"])) / len(targets)
    result["agreement"] = agree
    print(f"torch vs triton: same final answer on {agree:.4f} of {len(targets)} questions", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
