"""Runs on each worker: the entry point of a Trainer call, the strategies' worker half, and the callbacks
this package adds there (hidden from the user's ``trainer.callbacks``)."""
