"""Inputs stage: what users give commbench (model presets and files, --skew and traces, system specs, the
rank layout), each read safely (``userfiles``) and checked before anything is launched."""
