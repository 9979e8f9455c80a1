"""Driver side, Lightning facing: the strategy's driver half, its launcher, the checks before a launch,
the run's state while it runs, and the results brought back after it."""
