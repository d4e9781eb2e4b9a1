"""Judging a run: the verdict, its rules (outliers, baseline, pairwise, preflight) and junit.xml."""
