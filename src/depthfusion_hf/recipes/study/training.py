"""One run of a study: the causal-LM recipe's ``train_one`` (no second training loop), timed by the wall clock and
the process's CPU time with evaluation excluded, optionally with a separate learning rate for new parameters."""

from __future__ import annotations

import copy
import functools
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedModel, TrainerCallback

from ..clm import DepthFusionTrainer, TrainSettings, train_one, training_arguments
from .data import StudyData

# The clocks a run is timed with: curve key -> timer. ``seconds``: wall-clock; ``cpu_seconds``: this process's CPU
# time (all its threads), which other jobs on a shared machine disturb far less.
CLOCKS: dict[str, Callable[[], float]] = {"seconds": time.perf_counter, "cpu_seconds": time.process_time}


class WallClock(TrainerCallback):
    """Records every evaluation as ``{"step", "seconds", "cpu_seconds", "eval_loss"}``: training time so far by the
    wall clock and by the process's CPU time, evaluation time excluded from both; at the end, the totals by each
    clock (``totals["seconds"]``, ``totals["cpu_seconds"]``).

    A second evaluation at a step already recorded (``train_one``'s final ``evaluate``) is not recorded again.
    """

    def __init__(self) -> None:
        self.curve: list[dict] = []
        self.totals = {name: float("nan") for name in CLOCKS}
        self._begin = dict.fromkeys(CLOCKS, 0.0)
        self._mark = dict.fromkeys(CLOCKS, 0.0)
        self._eval = dict.fromkeys(CLOCKS, 0.0)

    @staticmethod
    def _now() -> dict[str, float]:
        return {name: timer() for name, timer in CLOCKS.items()}

    def on_train_begin(self, args, state, control, **kwargs):
        """Start the clocks."""
        self._begin = self._now()
        self._mark = dict(self._begin)

    def on_step_end(self, args, state, control, **kwargs):
        """Mark the end of an optimiser step (an evaluation, if any, starts now)."""
        self._mark = self._now()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        """Record the evaluation (train time up to the step it follows) and discount its duration."""
        now = self._now()
        if metrics is None or "eval_loss" not in metrics:
            return
        if not self.curve or self.curve[-1]["step"] != state.global_step:
            point = {"step": state.global_step}
            point |= {name: self._mark[name] - self._begin[name] - self._eval[name] for name in CLOCKS}
            self.curve.append(point | {"eval_loss": float(metrics["eval_loss"])})
        for name in CLOCKS:
            self._eval[name] += now[name] - self._mark[name]
        self._mark = now

    def on_train_end(self, args, state, control, **kwargs):
        """Total training time without evaluation, by each clock."""
        self.totals = {name: self._mark[name] - self._begin[name] - self._eval[name] for name in CLOCKS}


@dataclass
class RunOutcome:
    """One finished run: the ``train_one`` result plus the wall-clock curve."""

    eval_loss: float
    train_loss: float
    parameters: int
    train_seconds: float
    train_cpu_seconds: float
    tokens_per_second: float
    curve: list
    extra: dict = field(default_factory=dict)


def train_recorded(
    model: PreTrainedModel,
    data: StudyData,
    settings: TrainSettings,
    name: str = "run",
    new_names: Sequence[str] = (),
    new_param_lr_scale: float = 1.0,
    output_dir: str | os.PathLike | None = None,
    test: bool = False,
) -> RunOutcome:
    """Train ``model`` with ``train_one`` (evaluating at step 0 and every ``settings.eval_steps``) and time it.

    Args:
        new_names: parameter names that train at ``new_param_lr_scale`` × the learning rate.
        output_dir: where ``train_one`` saves ``final``; a temporary folder (deleted afterwards) when ``None``.
        test: also evaluate the final model on ``data.test`` (``extra["test_loss"]``).
    Returns:
        the final validation loss, parameters, training wall-clock and CPU seconds without evaluation, train
        tokens/s (wall-clock), and the curve ``[{"step", "seconds", "cpu_seconds", "eval_loss"}]`` from step 0.
    """
    clock = WallClock()
    settings = copy.deepcopy(settings)
    settings.extra = dict(settings.extra, eval_on_start=True, disable_tqdm=True)
    trainer_class = functools.partial(DepthFusionTrainer, callbacks=[clock], new_names=tuple(new_names),
                                      new_param_lr_scale=new_param_lr_scale)
    with tempfile.TemporaryDirectory(prefix="study-run-") as scratch:
        out = Path(output_dir) if output_dir is not None else Path(scratch)
        result = train_one(name, model, data.train, data.validation, out, settings, data.tokenizer,
                           trainer_class=trainer_class)
    tokens = settings.max_steps * settings.batch_size * settings.gradient_accumulation_steps
    tokens *= len(data.train[0]["input_ids"])
    extra = {"trainer_train_seconds": result.train_seconds}
    if test:
        extra["test_loss"] = evaluate_loss(model, data.test, settings)
    return RunOutcome(eval_loss=result.eval_loss, train_loss=result.train_loss, parameters=result.parameters,
                      train_seconds=clock.totals["seconds"], train_cpu_seconds=clock.totals["cpu_seconds"],
                      tokens_per_second=tokens / max(clock.totals["seconds"], 1e-9),
                      curve=clock.curve, extra=extra)


def evaluate_loss(model: PreTrainedModel, dataset, settings: TrainSettings) -> float:
    """The Trainer's evaluation loss of ``model`` on ``dataset`` (as in training: same batching, same loss)."""
    with tempfile.TemporaryDirectory(prefix="study-eval-") as scratch:
        trainer = DepthFusionTrainer(model=model, args=training_arguments(Path(scratch), settings),
                                     eval_dataset=dataset)
        return float(trainer.evaluate()["eval_loss"])


__all__ = ["CLOCKS", "RunOutcome", "WallClock", "evaluate_loss", "train_recorded"]
