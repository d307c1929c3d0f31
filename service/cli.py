"""The `kvstitch` command line: verify | tiny-model (serve, worker, ingest and ask arrive with their issues)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstitch", description="RAG serving with stitched chunk KV caches")
    commands = parser.add_subparsers(dest="command", required=True)

    verify = commands.add_parser("verify", help="run the correctness gate on a model and print the largest diff")
    verify.add_argument("--model", required=True, help="HF model folder or hub id")
    verify.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    verify.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on CPU, bf16 on CUDA")
    verify.add_argument(
        "--tolerance", type=float, default=None, help="default: 1e-4 in fp32; in bf16 10%% of the largest logit"
    )
    verify.add_argument("--seed", type=int, default=0)

    tiny = commands.add_parser("tiny-model", help="write a tiny random-weight model folder (tests, offline demo)")
    tiny.add_argument("out_dir")
    tiny.add_argument("--arch", choices=("llama", "qwen2", "mistral"), default="qwen2")
    tiny.add_argument("--seed", type=int, default=0)
    return parser


def _verify(args: argparse.Namespace) -> int:
    from service.engine.engine import StitchEngine
    from service.engine.gate import run_gate
    from service.engine.model import UnsupportedModelError, load_model

    try:
        model = load_model(args.model, device=args.device, dtype=DTYPES.get(args.dtype or ""))
    except (UnsupportedModelError, OSError, ValueError) as exc:
        print(f"error: cannot load {args.model}: {exc}", file=sys.stderr)
        return 2
    result = run_gate(StitchEngine(model), tolerance=args.tolerance, seed=args.seed)
    for case in result.cases:
        order = ",".join(str(i) for i in case.order)
        print(f"order={order} positions={case.positions.value} max_abs_logit_diff={case.max_abs_logit_diff:.3e}")
    verdict = "pass" if result.passed else "FAIL"
    print(
        f"gate {verdict}: tolerance={result.tolerance:.1e} largest_logit={result.logit_scale:.2f} "
        f"dtype={model.spec.dtype} device={model.spec.device}"
    )
    print(f"max_abs_logit_diff={result.max_abs_logit_diff:.6e}")
    return 0 if result.passed else 1


def _tiny_model(args: argparse.Namespace) -> int:
    from service.devtools.tiny_model import build_tiny_model

    path = build_tiny_model(args.arch, args.out_dir, seed=args.seed)
    print(f"wrote a tiny random-weight {args.arch} model to {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvstitch` console script."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    handlers = {"verify": _verify, "tiny-model": _tiny_model}
    return handlers[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
