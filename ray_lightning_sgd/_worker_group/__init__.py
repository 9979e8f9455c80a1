"""A gang of Ray actors: its configuration, ranks, placement, the worker actor and its context, and its errors."""
