"""Train the canary MoE (plain PyTorch, deterministic seed) and write its checkpoint.

The model is transformers' Qwen3-MoE (so vLLM serves it unchanged) at a size that ships in the
package; its tokenizer, trained here, splits every digit into its own token. Training text is
the task's documents in lm-eval's few-shot layout ("Question: ...\\nAnswer: ...", joined by
blank lines), packed into sequences; the loss covers the answers only. Accuracy is measured as
the fraction of held-out questions whose every answer token is the model's argmax under teacher
forcing, after a bf16 cast: exactly the questions greedy decoding answers right. Usage:

    python -m moe_eval.canary.train --out moe_eval/canary/checkpoint --device cuda --steps 6000 \
        --batch 64 --seq-len 384 --lr 2e-3 --eval-every 250 --eval-questions 200 --stop-after-step 2185

(the shipped checkpoint's command; docs/canary.md)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moe_eval.evaluate.canary_task import SPLIT_SEED, canary_splits, make_problem
from moe_eval.evaluate.logprobs import FEWSHOT_DELIMITER, TARGET_DELIMITER
from moe_eval.models.builtin import qwen3_moe_config
from moe_eval.models.tokenizer import bpe_tokenizer


@dataclass(frozen=True)
class CanarySpec:
    vocab_size: int = 512
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    max_position_embeddings: int = 2048
    seed: int = 0
    task_seed: int = SPLIT_SEED


def doc_text(item: dict) -> tuple[str, str]:
    return f"Question: {item['question']}\nAnswer:", TARGET_DELIMITER + item["answer"]


def fewshot_context(shots: list[dict]) -> str:
    """The few-shot documents as lm-eval lays them out before a question, blank line after each."""
    return FEWSHOT_DELIMITER.join(p + a for p, a in map(doc_text, shots)) + FEWSHOT_DELIMITER


def train_tokenizer(spec: CanarySpec, corpus: list[str]):
    # Digits one by one: the model then sees place value, as arithmetic needs.
    return bpe_tokenizer(corpus, spec.vocab_size, spec.max_position_embeddings, split_digits=True)


def build_model(spec: CanarySpec, tokenizer):
    from transformers import Qwen3MoeForCausalLM

    config = qwen3_moe_config(
        spec, tokenizer, "bfloat16", router_aux_loss_coef=0.01, output_router_logits=False
    )
    return Qwen3MoeForCausalLM(config)


class Packer:
    """Endless stream of packed sequences: documents joined by blank lines, loss on answers only."""

    def __init__(self, tokenizer, seed: int, seq_len: int, exclude: set[str]):
        self.tok, self.rng, self.seq_len, self.exclude = tokenizer, random.Random(seed), seq_len, exclude

    def _doc(self) -> tuple[list[int], list[int]]:
        while True:
            item = make_problem(self.rng)
            if item["question"] not in self.exclude:  # never train on a test question
                break
        prompt, answer = doc_text(item)
        p = self.tok(prompt, add_special_tokens=False)["input_ids"]
        a = self.tok(answer + FEWSHOT_DELIMITER, add_special_tokens=False)["input_ids"]
        return p + a, [0] * len(p) + [1] * len(a)

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = [], []
        for _ in range(size):
            row, row_mask = [], []
            while len(row) < self.seq_len:
                d, m = self._doc()
                row += d
                row_mask += m
            ids.append(row[: self.seq_len])
            mask.append(row_mask[: self.seq_len])
        return torch.tensor(ids), torch.tensor(mask)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, test: list[dict], shots: list[dict], device: str, limit: int) -> float:
    """Fraction of questions whose answer tokens are all argmax under teacher forcing (= greedy right)."""
    model.eval()
    context = fewshot_context(shots)
    right = 0
    for item in test[:limit]:
        prompt, answer = doc_text(item)
        p = tokenizer(context + prompt, add_special_tokens=False)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p + a], device=device)
        logits = model(input_ids=ids).logits[0, len(p) - 1 : -1]
        right += int(torch.equal(logits.argmax(-1).cpu(), torch.tensor(a)))
    model.train()
    return right / min(limit, len(test))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--eval-questions", type=int, default=300)
    parser.add_argument(
        "--max-seconds", type=float, default=None, help="stop (and save) after this much training time"
    )
    parser.add_argument(
        "--stop-after-step",
        type=int,
        default=None,
        help="stop (and save) after this step; the learning-rate schedule still spans --steps",
    )
    parser.add_argument(
        "--stop-at", type=float, default=0.995, help="stop early once fp32 greedy accuracy reaches this"
    )
    args = parser.parse_args()
    spec = CanarySpec()
    torch.manual_seed(spec.seed)
    started = time.time()

    train_items, test_items = canary_splits(spec.task_seed)
    corpus = [p + a for p, a in map(doc_text, train_items)]
    tokenizer = train_tokenizer(spec, corpus)
    model = build_model(spec, tokenizer).to(args.device)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"canary: {params / 1e6:.2f} M parameters, vocab {len(tokenizer)}, device {args.device}", flush=True
    )

    packer = Packer(
        tokenizer, seed=spec.seed + 1, seq_len=args.seq_len, exclude={t["question"] for t in test_items}
    )
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(args.steps // 20, 1)
    # Linear warm-up, then cosine decay to 5% of the peak.
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim,
        lambda s: min(
            (s + 1) / warmup, 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(s / args.steps, 1.0)))
        ),
    )
    shots = train_items[:5]
    history = []
    for step in range(1, args.steps + 1):
        ids, mask = packer.batch(args.batch)
        ids, mask = ids.to(args.device), mask.to(args.device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=args.device.startswith("cuda")):
            logits = model(input_ids=ids).logits.float()
        loss_tok = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        )
        m = mask[:, 1:].reshape(-1).float()
        loss = (loss_tok * m).sum() / m.sum()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f} {time.time() - started:.0f}s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            acc = greedy_accuracy(model, tokenizer, test_items, shots, args.device, args.eval_questions)
            history.append(
                {
                    "step": step,
                    "loss": loss.item(),
                    "greedy_accuracy_fp32": acc,
                    "seconds": time.time() - started,
                }
            )
            print(
                f"step {step} greedy accuracy (fp32, {args.eval_questions} test questions): {acc:.3f}",
                flush=True,
            )
            if acc >= args.stop_at:
                break
        out_of_time = args.max_seconds is not None and time.time() - started > args.max_seconds
        if out_of_time or step == args.stop_after_step:
            acc = greedy_accuracy(model, tokenizer, test_items, shots, args.device, args.eval_questions)
            history.append(
                {
                    "step": step,
                    "loss": loss.item(),
                    "greedy_accuracy_fp32": acc,
                    "seconds": time.time() - started,
                    "stopped": "max_seconds" if out_of_time else "stop_after_step",
                }
            )
            print(f"step {step}: stopped; greedy accuracy (fp32) {acc:.3f}", flush=True)
            break

    model = model.to(torch.bfloat16)
    acc_bf16 = greedy_accuracy(model, tokenizer, test_items, shots, args.device, args.eval_questions)
    print(f"final greedy accuracy (bf16): {acc_bf16:.3f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    record = {
        "spec": asdict(spec),
        "args": {k: str(v) for k, v in vars(args).items()},
        "parameters": params,
        "history": history,
        "final_greedy_accuracy_bf16": acc_bf16,
        "seconds": time.time() - started,
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
