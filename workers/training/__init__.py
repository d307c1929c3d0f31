"""Offline training of a served model (block fine-tuning, pre-training from scratch): outside the serving path."""
