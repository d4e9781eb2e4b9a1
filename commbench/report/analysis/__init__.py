"""Analyses of a results frame: the range over repeats, soak drift, what EPLB replicas buy."""
