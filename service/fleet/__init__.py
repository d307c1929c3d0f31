"""Several engines behind one gateway (issue 28): where each engine's chunk KV is, and which engine a question goes to.

`tier_events.py` is the engine's side (its KV store's tier moves published to Redis), `placement.py` the gateway's
(a view of every engine's tiers rebuilt from Redis and kept current), `routing.py` the choice itself, a pure function
of the view and the engines' load. The package imports the KV cache's tier and key types, never the engine or the
serving layer.
"""
