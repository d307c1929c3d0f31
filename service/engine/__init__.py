"""The stitching engine: torch lives here. Nothing in this package imports the HTTP layer."""
