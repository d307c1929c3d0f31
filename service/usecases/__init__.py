"""The use cases: answering a question (retrieve, prompt, done event) and ingesting or deleting documents."""
