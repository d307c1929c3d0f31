"""The server's batching defaults, in one place without imports: `Settings` gives them to `kvstitch serve`, and
the engine benchmarks (`loadtest/bench_tables.py`) build their scheduler with them on a GPU image that has torch
but not pydantic."""

MAX_BATCH = 32  # answers decoded together in one batched step, at most
PREFILL_CHUNK = 1024  # naive prompts prefilled this many tokens per step, between decode steps (0: whole)
BATCH_PREFILL_MIN = 3  # turbo questions admitted in one step prefilled in one forward from this many on (0: never)
