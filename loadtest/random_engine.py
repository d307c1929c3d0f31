"""`kvstitch engine` over a random-weight model of a real shape, for fleet benchmarks without a model folder on disk.

    CUDA_VISIBLE_DEVICES=1 KVSTITCH_GPU_CACHE_MB=2048 python -m loadtest.random_engine --port 8101

Builds the model as `serve_random` does (`bench_prefill.build_engine`: random bf16 Qwen2-7B weights drawn on the
device, Qwen's vocabulary where installed; `--model DIR` loads a folder instead), silences the LM-head rows that
cannot stream text (`serve_random.stream_in_vocab`), and serves the engine's internal API with
`service.commands.engine.run_engine` over it: the same app, start-up, gate and metrics as `kvstitch engine`. Every
other setting comes from the environment (`KVSTITCH_*`), as for `kvstitch engine`.

`BENCH_ENGINE_CONSTANTS` (optional, for A/B runs: `serve_fleet --engine-env-b BENCH_ENGINE_CONSTANTS=...`) sets
module constants of `service.engine` in the engine's process before it starts, e.g.
`segment_launch.PARTIALS_MAXNREG=128,kv_write.FUSED_KV_WRITE=true` (pairs apart by commas or spaces; an int, true,
false or none each); a name the module does not have is an error, not a silent no-op.

The random model names its fingerprint (`bench_prefill.random_fingerprint`), so engines built on the same kind of
device and a gateway holding `bench_prefill.random_qwen2_7b_shell` share one key space.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

import torch

from loadtest.bench_prefill import build_engine
from loadtest.serve_random import chosen_vocabulary, stream_in_vocab
from service.commands.engine import DEFAULT_ENGINE_HOST, DEFAULT_ENGINE_PORT, run_engine
from service.settings import Settings

log = logging.getLogger("random_engine")

CONSTANTS_ENV = "BENCH_ENGINE_CONSTANTS"


def set_engine_constants(text: str) -> dict[str, object]:
    """Set `module.NAME=value` pairs (apart by commas or spaces) on modules of `service.engine`; what was set."""
    done: dict[str, object] = {}
    for pair in text.replace(",", " ").split():
        name, _, raw = pair.partition("=")
        module_name, _, attribute = name.rpartition(".")
        if not (module_name and attribute and raw):
            raise ValueError(f"{CONSTANTS_ENV}: {pair!r} is not module.NAME=value")
        module = importlib.import_module(f"service.engine.{module_name}")
        if not hasattr(module, attribute):
            raise ValueError(f"{CONSTANTS_ENV}: service.engine.{module_name} has no {attribute}")
        value = _constant(raw)
        setattr(module, attribute, value)
        done[name] = value
    return done


def _constant(raw: str) -> object:
    """An int, True, False or None from its text."""
    words: dict[str, object] = {"true": True, "false": False, "none": None}
    if raw.lower() in words:
        return words[raw.lower()]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{CONSTANTS_ENV}: {raw!r} is not an int, true, false or none") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder; default: random Qwen2-7B shape")
    parser.add_argument("--vocabulary", default="auto", choices=["auto", "qwen", "stand-in"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--host", default=DEFAULT_ENGINE_HOST)
    parser.add_argument("--port", type=int, default=DEFAULT_ENGINE_PORT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if os.environ.get(CONSTANTS_ENV):
        log.info("engine constants set: %s", set_engine_constants(os.environ[CONSTANTS_ENV]))
    if args.device == "cuda" and not torch.cuda.is_available():
        log.error("no CUDA device: pass --device cpu --model DIR for a smoke run")
        return 2
    engine = build_engine(args.model, torch.device(args.device), chosen_vocabulary(args.vocabulary))
    if args.model is None:
        log.info("zeroed %d LM-head rows the tokenizer cannot decode", stream_in_vocab(engine))
    settings = Settings(model=engine.model.source, device=args.device)
    return run_engine(settings, args.host, args.port, engine)


if __name__ == "__main__":
    sys.exit(main())
