"""Answer quality of stitched KV against the naive baseline: QA data sets, metrics, the eval, block fine-tuning,
and a base model trained from scratch for the demonstration.

Uses the engine only through its public API. Only the eval's corpus form (`corpus_eval`) reaches further: it opens
the runtime's retrieval pieces (embedder, collection) and shares the server's context fit (`answer.fit_context`);
nothing here imports the HTTP layer or the workers.
"""
