"""Driver side: the executor joins a worker group and a backend; the run controller restarts it; the pool keeps it warm."""
