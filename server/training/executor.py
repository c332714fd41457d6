"""Runs the scheduler's typed operations on the trainer: one at a time, or the forward_backward /
forward operations of several runs together in one pass.

The one place where a training request meets the trainer. Called from the scheduler's training
thread only. Knows nothing about HTTP, futures or the database: results go back to the caller,
who turns them into responses.
"""

from server.errors import TinkerServerError, TrainingRankLost
from server.lora.checkpoint_io import AdapterState
from server.lora.layers import LoraAdapter
from server.training.losses import resolve_loss
from server.training.operations import (CreateModel, ForwardBackward, LoadState, Operation, OptimStep, SaveState,
                                        Snapshot, Unload)
from server.training.trainer import ForwardBackwardResult, Trainer
from server.wire.models import LoraConfig

Result = ForwardBackwardResult | dict[str, float] | AdapterState | LoraAdapter | LoraConfig | None
"""What each operation gives: forward_backward its outputs, optim_step its metrics, save_state the host
copy to write, snapshot the frozen adapter, load_state the run's LoRA config, the others nothing."""


# How long a failed collective waits to learn whether a rank died (a bound, not a delay: a death is seen at once).
_LOST_RANK_WAIT_SECONDS = 10.0


class TrainingExecutor:
    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def run(self, operation: Operation) -> Result:
        """Run one operation that is not a forward_backward."""
        try:
            self._check_group()
            return self._run(operation)
        except Exception as error:
            explained = self._explained(error)
            if explained is error:
                raise
            raise explained from error

    def _run(self, operation: Operation) -> Result:
        trainer = self.trainer
        match operation:
            case CreateModel(model_id, lora_config, seed):
                trainer.create_model(model_id, lora_config, seed)
                return None
            case LoadState(model_id, directory, with_optimizer, create=True):
                return trainer.create_model_from_checkpoint(model_id, directory, with_optimizer)
            case LoadState(model_id, directory, with_optimizer, create=False):
                trainer.load_state(model_id, directory, with_optimizer)
                return trainer.get(model_id).lora_config
            case OptimStep(model_id, params):
                return trainer.optim_step(model_id, params)
            case SaveState(model_id, with_optimizer):
                return trainer.copy_state(model_id, with_optimizer)
            case Snapshot(model_id):
                return trainer.snapshot(model_id)
            case Unload(model_id):
                trainer.unload(model_id)
                return None
        raise TypeError(f"not an operation the executor runs alone: {operation!r}")

    def run_pass(self, operations: list[ForwardBackward]) -> list[ForwardBackwardResult | Exception]:
        """forward_backward operations (all forward_only or none, of one run or several) in one pass.

        An operation that cannot run (its run was unloaded, its loss is unknown) fails alone and the
        others go on; an error in the pass itself fails every operation in it.
        """
        outcomes: list[ForwardBackwardResult | Exception | None] = [None] * len(operations)
        ready = []
        for index, operation in enumerate(operations):
            try:
                self.trainer.get(operation.model_id)
                resolve_loss(operation.loss_fn, operation.loss_fn_config)
                ready.append(index)
            except TinkerServerError as error:
                outcomes[index] = error
        if ready:
            try:
                self._check_group()
                results = self.trainer.forward_backward_pass([operations[index] for index in ready])
            except Exception as error:
                results = [self._explained(error)] * len(ready)
            for index, result in zip(ready, results):
                outcomes[index] = result
        return outcomes

    def _check_group(self) -> None:
        """Refuse to start collectives that a dead rank would never join."""
        lifelines = self.trainer.group.lifelines
        if lifelines is not None and lifelines.lost.is_set():
            raise TrainingRankLost(lifelines.lost_rank, ran=False)

    def _explained(self, error: Exception) -> Exception:
        """`error`, or the death of a training rank if that is what broke the operation's collectives."""
        lifelines = self.trainer.group.lifelines
        if lifelines is None or isinstance(error, TinkerServerError):
            return error
        # The dead rank's lifeline was closed with its other connections: its end is here or on its way.
        if lifelines.lost.wait(_LOST_RANK_WAIT_SECONDS):
            return TrainingRankLost(lifelines.lost_rank, ran=True)
        return error
