"""Logit error of stitching from 8-bit stored KV (int8, fp8) against the bf16 blocks, the gate's way.

    python -m loadtest.gate_quant [--device cpu --model DIR]

On a Qwen2-7B-shaped random model (GPU) by default: chunks of the gate's lengths in two orders, both position
modes, a 9-token question. Each precomputed block goes through `quant.quantize` and `quant.dequantize` (the same
functions the disk tier's write and fetch use; the file bytes in between are a lossless copy), then is stitched.
Reported per case, max |logit diff| of: stitched-8bit vs stitched-bf16, stitched-8bit vs reference-bf16 (what
the gate measures), stitched-bf16 vs reference-bf16 (the gate's own bf16 noise), and stitched-8bit and
stitched-bf16 vs an fp32 reference (the truth), with the largest |logit|.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

import torch

from loadtest.bench_prefill import build_engine
from service.engine.gate import gate_cases
from service.engine.kv_layout import KVBlock
from service.engine.model import LoadedModel
from service.engine.reference import prompt_reference_logits
from service.kvcache import quant


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder; default: random Qwen2-7B shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-fp32", action="store_true", help="skip the fp32 reference (it needs fp32 weights)")
    args = parser.parse_args(argv)
    engine = build_engine(args.model, torch.device(args.device))
    cases: list[dict[str, Any]] = []
    for order, mode, chunks, question in gate_cases(engine):
        prompt = engine.template.prompt(chunks, question)
        kv = engine.precompute(prompt.blocks)
        stitched = engine.prefill_stitched(kv, prompt.question, mode, all_logits=True)[1].float()
        ref16 = prompt_reference_logits(engine.model, prompt, mode)[-len(prompt.question) :]
        row: dict[str, Any] = {"order": order, "mode": mode.value, "prompt": prompt, "stitched16": stitched}
        row["stitched16_vs_ref16"] = float((stitched - ref16).abs().max())
        row["max_abs_logit"] = float(ref16.abs().max())
        for fmt in quant.QUANT_FORMATS:
            blocks = [KVBlock(b.token_ids, quant.dequantize(quant.quantize(b.kv, fmt))) for b in kv]
            logits = engine.prefill_stitched(blocks, prompt.question, mode, all_logits=True)[1].float()
            row[f"stitched_{fmt}"] = logits
            row[f"{fmt}_vs_stitched16"] = float((logits - stitched).abs().max())
            row[f"{fmt}_vs_ref16"] = float((logits - ref16).abs().max())
        cases.append(row)
    if not args.no_fp32:
        hf32 = engine.model.hf.float()
        spec32 = dataclasses.replace(engine.spec, dtype=torch.float32)
        model32 = LoadedModel(hf32, engine.tokenizer, spec32, "fp32")
        for row in cases:
            n = len(row["prompt"].question)
            ref32 = prompt_reference_logits(model32, row["prompt"], row["mode"])[-n:]
            row["stitched16_vs_ref32"] = float((row["stitched16"] - ref32).abs().max())
            for fmt in quant.QUANT_FORMATS:
                row[f"{fmt}_vs_ref32"] = float((row[f"stitched_{fmt}"] - ref32).abs().max())
    plain = [{k: v for k, v in row.items() if not isinstance(v, torch.Tensor) and k != "prompt"} for row in cases]
    sys.stdout.write(json.dumps(plain, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
