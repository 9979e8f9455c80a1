"""Driver side, Lightning facing: the strategy, its launcher, the checks before a launch and the recovery after it."""
