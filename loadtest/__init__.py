"""Load generators and benchmark scripts (not part of the served package)."""
