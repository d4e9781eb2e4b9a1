"""Analyses of a results frame: spread over windows, soak drift, what EPLB replicas buy."""
