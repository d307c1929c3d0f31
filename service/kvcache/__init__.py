"""The KV cache: block keys, the on-disk block format and the index of stored blocks.

Nothing here knows about HTTP; the worker and the CLI drive it.
"""
