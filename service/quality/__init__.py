"""Answer quality of stitched KV against the naive baseline: QA data sets, metrics, the eval, block fine-tuning.

Uses the engine only through its public API; nothing here imports the HTTP layer, the KV store or the workers.
"""
