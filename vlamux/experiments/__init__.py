"""Experiments built from job specs: the multi-tenant workload of the main job and its benchmark."""
