"""Fabric stage: the link model (model), EP-group traffic at scale (ep_groups) and its calibration."""
