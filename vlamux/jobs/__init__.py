"""Job specs (what a tenant asks for) and the Master Service that runs them."""

from vlamux.jobs.spec import EvalSpec, JobSpec, JobSpecError, load_spec

__all__ = ["EvalSpec", "JobSpec", "JobSpecError", "load_spec"]
