"""What the training side is asked to do: one typed operation per training request, named in the Tinker
vocabulary, for one run (model_id) with its rendered input.

Routes build these; the scheduler orders them (each run's in seq_id order, runs fairly against each
other) and hands them to the executor (training/executor.py), which runs the forward_backward and
forward operations of several runs in one pass. Plain data: nothing here runs anything.
"""

from dataclasses import dataclass
from pathlib import Path

from server.rendering.training import TrainingExample
from server.wire.models import LoraConfig
from server.wire.training import AdamParams


@dataclass(frozen=True)
class CreateModel:
    """Start a run with a freshly initialised adapter."""

    model_id: str
    lora_config: LoraConfig
    seed: int | None = None
    """The adapter's initialisation seed; None: the LoraConfig's, else a random one (which the trainer fixes
    before it sends the operation to its other ranks, so that every rank starts from the same adapter)."""


@dataclass(frozen=True)
class LoadState:
    """Load a checkpoint's adapter (and optimizer moments) into a run, or start a run from it (`create`)."""

    model_id: str
    directory: Path
    with_optimizer: bool
    create: bool


@dataclass(frozen=True)
class ForwardBackward:
    """The loss on a batch and, unless forward_only, its gradient added to the run's accumulators.

    One operation may run over several passes (a slice of its datums each, see the scheduler), and
    several runs' operations may share a pass: the gradients are sums, so neither changes them.
    """

    model_id: str
    examples: list[TrainingExample] | None
    """None on the training ranks other than 0 (their datums travel separately)."""
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    forward_only: bool

    def datum_tokens(self) -> list[int]:
        return [len(example.input_ids) for example in self.examples]


@dataclass(frozen=True)
class OptimStep:
    """One AdamW step with every AdamParams field, then clear the gradients."""

    model_id: str
    params: AdamParams


@dataclass(frozen=True)
class SaveState:
    """Copy the adapter (with the optimizer moments for a training checkpoint) to host memory; the
    copy is written to disk off the training thread."""

    model_id: str
    with_optimizer: bool


@dataclass(frozen=True)
class Snapshot:
    """A frozen copy of the adapter on the training device, for an ephemeral sampling session."""

    model_id: str


@dataclass(frozen=True)
class Unload:
    """Take the run out of memory (its session ended)."""

    model_id: str


Operation = CreateModel | LoadState | ForwardBackward | OptimStep | SaveState | Snapshot | Unload

RankCommand = CreateModel | LoadState | OptimStep | Unload | list[ForwardBackward]
"""What rank 0 sends the other training ranks to run with it: an operation, or a pass (its operations
without their datums, which travel separately)."""
