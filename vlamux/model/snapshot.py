"""A tenant's policy at one version, as the control plane moves it: from the training service's slot
to every inference replica (vlamux.services.control), to a policy file and back."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlamux.model.heads import HeadSpec


@dataclass(frozen=True)
class PolicySnapshot:
    """An immutable copy of a tenant's policy at one version: the control plane's unit."""

    tenant: str
    version: int
    backbone_id: str
    head_spec: HeadSpec
    tensors: dict  # "head.*" weights and "stats.*" statistics, on the host
    stats_modes: dict
    # On CUDA: an event marking `tensors` complete (they are filled asynchronously); None when they are.
    done: object = field(default=None, compare=False, repr=False)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def ready(self) -> PolicySnapshot:
        """Wait until `tensors` hold the version (a host reader's duty; device readers wait on `done`)."""
        if self.done is not None:
            self.done.synchronize()
        return self

    def __getstate__(self):  # to another process (Ray): the tensors complete, no CUDA event
        self.ready()
        return {**self.__dict__, "done": None}

    def __setstate__(self, state):
        for k, v in state.items():
            object.__setattr__(self, k, v)
