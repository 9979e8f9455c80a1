"""The backends: how a worker group forms (and ends) its process group."""
