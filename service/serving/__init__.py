"""The serving process: the facade's implementation, its composition root, the engine loop and answer sessions."""
