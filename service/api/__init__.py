"""The HTTP layer: FastAPI app, request schemas, routes and the chat page. Only entry points import it."""
