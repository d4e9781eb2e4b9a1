"""Stage 3, traffic: routing, the Pattern (every [src][dst] count), per-rank plans, link classes, payloads.

``routing`` (with the ``race`` sampler) routes one rank's tokens; ``pattern`` counts what every rank sends
(``rank_counts``) into the one Pattern; ``plan`` lays one rank's rows out with the same counts; ``links``
splits byte matrices by link class; ``payload`` encodes and verifies the rows.
"""
