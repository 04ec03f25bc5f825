"""Workflows: what a job does, written over the services' small API (SFT, RL, evaluation)."""
