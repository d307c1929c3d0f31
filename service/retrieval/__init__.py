"""Retrieval: token-aware chunking, sentence embeddings and the Qdrant chunk collection.

Nothing in this package imports the HTTP layer; the gateway and the ingest worker both drive it.
"""
