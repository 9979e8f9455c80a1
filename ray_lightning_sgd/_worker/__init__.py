"""Runs inside each worker: the entry point of a Trainer call, and the callbacks this package adds there."""
