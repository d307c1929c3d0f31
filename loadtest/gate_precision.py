"""How far bf16 stitching and the bf16 reference each sit from an fp32 reference (sets the bf16 gate bound).

    python -m loadtest.gate_precision

On a Qwen2-7B-shaped random model (GPU): for both position modes and two chunk orders, the max |logit diff| of
stitched-bf16 vs reference-bf16 (what the gate measures), of each of them vs reference-fp32 (the truth), and of a
deliberately broken stitch (positions off by one) vs reference-bf16 (what the gate must catch).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import torch

import service.engine.engine as engine_module
from loadtest.bench_prefill import random_qwen2_7b
from service.engine.engine import StitchEngine
from service.engine.gate import gate_cases
from service.engine.model import LoadedModel
from service.engine.reference import prompt_reference_logits
from service.engine.stitch import StitchPlan, plan_positions


def off_by_one(mode: str, lengths: list[int], chunk_start: int = 0) -> StitchPlan:
    plan = plan_positions(mode, lengths, chunk_start)
    return StitchPlan(plan.mode, plan.lengths, plan.slots, tuple(s + 1 for s in plan.starts))


def main() -> int:
    engine = StitchEngine(random_qwen2_7b(torch.device("cuda")))
    cases: list[dict[str, Any]] = []
    for order, mode, chunks, question in gate_cases(engine):
        prompt = engine.template.prompt(chunks, question)
        kv = engine.precompute(prompt.blocks)
        stitched = engine.prefill_stitched(kv, prompt.question, mode, all_logits=True)[1]
        engine_module.plan_positions = off_by_one  # type: ignore[attr-defined,assignment]  # deliberate break
        broken = engine.prefill_stitched(kv, prompt.question, mode, all_logits=True)[1]
        engine_module.plan_positions = plan_positions  # type: ignore[attr-defined]
        ref16 = prompt_reference_logits(engine.model, prompt, mode)[-len(prompt.question) :]
        cases.append(
            {
                "order": order,
                "mode": mode.value,
                "stitched": stitched,
                "broken": broken,
                "ref16": ref16,
                "prompt": prompt,
                "positions": mode,
            }
        )
    hf32 = engine.model.hf.float()
    model32 = LoadedModel(hf32, engine.tokenizer, dataclasses.replace(engine.spec, dtype=torch.float32), "fp32")
    rows = []
    for case in cases:
        ref32 = prompt_reference_logits(model32, case["prompt"], case["positions"])[-len(case["ref16"]) :]
        rows.append(
            {
                "order": case["order"],
                "mode": case["mode"],
                "stitched16_vs_ref16": float((case["stitched"] - case["ref16"]).abs().max()),
                "stitched16_vs_ref32": float((case["stitched"] - ref32).abs().max()),
                "ref16_vs_ref32": float((case["ref16"] - ref32).abs().max()),
                "broken16_vs_ref16": float((case["broken"] - case["ref16"]).abs().max()),
                "max_abs_logit": float(ref32.abs().max()),
            }
        )
    sys.stdout.write(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
