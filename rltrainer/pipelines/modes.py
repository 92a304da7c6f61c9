"""The pipeline objects a Trainer takes (``Trainer(pipeline=AsyncPipeline(max_staleness=2))``, or
a name as shorthand): each holds and checks its own settings at construction, names the push mode
its steps use (:class:`~rltrainer.weights.sync.WeightSync`) and makes the running state of
one ``fit`` (:meth:`SyncPipeline.start`), so a Trainer can fit more than once."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from rltrainer.pipelines.runs import AsyncRun, OneStepOffRun, SyncRun
from rltrainer.values import check_int

if TYPE_CHECKING:
    from rltrainer.loop import FitContext

STALENESS_POLICIES = ("wait", "drop")
#: A sync pipeline's push: wait for it at the end of the step, or run it in the background.
SYNC_PUSH_MODES = ("wait", "background")


class Pipeline:
    """What every pipeline object answers: its ``mode`` (the name a checkpoint's ``pipeline.mode``
    records), the weight-push mode of its steps, whether it runs with a rollout's placement, and the running
    state of one ``fit``."""

    mode = ""
    push_mode = "wait"  #: :data:`~rltrainer.weights.sync.PUSH_MODES`

    def check_rollout(self, rollout: Any) -> None:
        """Raise if this pipeline cannot run with ``rollout``'s placement (a
        :class:`~rltrainer.rollout.rollout.Rollout`): generating while the policy trains needs the
        engines in processes of their own."""
        if self.mode != "sync" and rollout.placement != "split":
            raise ValueError(
                f"pipeline={self.mode!r} generates while the policy trains, so the rollout engines need processes "
                f"of their own; the rollout runs them {rollout.placement}. Use e.g. "
                "Trainer(strategy=FSDP2Strategy(), rollout=Rollout(engine=..., placement='split')), or pipeline='sync'."
            )

    def start(self, fit: FitContext, prompt_batches: Iterable[tuple[int, int, Any]]) -> SyncRun:
        """The running state of one ``fit`` (iterate it for the batches to train on), from the
        prompt batches ``(epoch, index, raw batch)`` in order."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        """Equal to a pipeline of the same class and settings (compare ``pipeline.mode`` to a name)."""
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class SyncPipeline(Pipeline):
    """``"sync"``: generate a batch with the current weights, then train on it.

    Args:
        push_mode: ``"wait"`` (push new weights at the end of each step and wait) or ``"background"``
            (push in a background thread; logging, callbacks and loading the next prompts overlap
            with it, and the next rollout, validation or checkpoint waits for it): the
            :data:`~rltrainer.weights.sync.PUSH_MODES` a sync step may use.
    """

    mode = "sync"

    def __init__(self, push_mode: str = "wait") -> None:
        if push_mode not in SYNC_PUSH_MODES:
            raise ValueError(f"push_mode must be 'wait' or 'background', got {push_mode!r}")
        self.push_mode = push_mode

    def start(self, fit: FitContext, prompt_batches: Iterable[tuple[int, int, Any]]) -> SyncRun:
        return SyncRun(fit, prompt_batches)

    def __repr__(self) -> str:
        return f"SyncPipeline(push_mode={self.push_mode!r})"


class OneStepOffPipeline(Pipeline):
    """``"one_step_off"``: generate batch ``t + 1`` with the previous weights while training on batch
    ``t``. Needs the engines in processes of their own (``Rollout(placement="split")``)."""

    mode = "one_step_off"
    push_mode = "overlap"

    def start(self, fit: FitContext, prompt_batches: Iterable[tuple[int, int, Any]]) -> SyncRun:
        return OneStepOffRun(fit, prompt_batches)


class AsyncPipeline(Pipeline):
    """``"async"``: engines stream finished groups into a buffer; the trainer takes rows at most
    ``max_staleness`` policy versions old. Needs ``Rollout(placement="split")``.

    Args:
        max_staleness: how many policy versions a trained row may lag.
        staleness_policy: ``"wait"`` (train on the oldest requests first, never exceed the bound) or
            ``"drop"`` (train on what finished first; drop rows that fell behind the bound, count
            them and generate their prompts again).
        deterministic: ``True`` (the default with ``"wait"``): the prompts of step ``s`` are
            generated with policy version ``max(0, s - max_staleness)`` exactly, whatever the timing,
            so a seeded run is reproducible and resumes bit for bit; a row is always exactly
            ``max_staleness`` versions old once the run is past its first steps. ``False`` (the only
            choice with ``"drop"``): each request generates with the newest version the engine holds
            when it starts (at most ``max_staleness`` old), which depends on timing.
    """

    mode = "async"
    push_mode = "overlap"

    def __init__(self, max_staleness: int = 1, staleness_policy: str = "wait",
                 deterministic: bool | None = None) -> None:
        max_staleness = check_int("max_staleness", max_staleness, at_least=0, owner="AsyncPipeline",
                                  meaning="policy versions a row may lag")
        if staleness_policy not in STALENESS_POLICIES:
            raise ValueError(f"staleness_policy={staleness_policy!r}; choose from {', '.join(STALENESS_POLICIES)}")
        if deterministic is not None and not isinstance(deterministic, bool):
            raise ValueError(f"deterministic must be True, False or None (True with staleness_policy='wait'), "
                             f"got {deterministic!r}")
        if deterministic and staleness_policy == "drop":
            raise ValueError("deterministic=True needs staleness_policy='wait': 'drop' trains on whichever groups "
                             "finished first, which is timing. Use staleness_policy='wait' for a reproducible run, "
                             "or deterministic=False with 'drop'")
        self.max_staleness, self.staleness_policy = max_staleness, staleness_policy
        self.deterministic = staleness_policy == "wait" if deterministic is None else deterministic

    def start(self, fit: FitContext, prompt_batches: Iterable[tuple[int, int, Any]]) -> SyncRun:
        return AsyncRun(fit, prompt_batches, self.max_staleness, self.staleness_policy, self.deterministic)

    def __repr__(self) -> str:  # what one would type: deterministic only where it is not the policy's default
        chosen = f", deterministic={self.deterministic!r}" * (self.deterministic != (self.staleness_policy == "wait"))
        return (f"AsyncPipeline(max_staleness={self.max_staleness!r}, "
                f"staleness_policy={self.staleness_policy!r}{chosen})")


#: The shorthand names ``Trainer(pipeline=...)`` takes.
PIPELINES: dict[str, type[Pipeline]] = {"sync": SyncPipeline, "one_step_off": OneStepOffPipeline,
                                            "async": AsyncPipeline}


def resolve_pipeline(pipeline: str | Pipeline) -> Pipeline:
    """A pipeline object from ``pipeline``: an object as is, or a name of :data:`PIPELINES` (the
    pipeline with its defaults)."""
    if isinstance(pipeline, Pipeline):
        return pipeline
    if not isinstance(pipeline, str) or pipeline not in PIPELINES:
        raise ValueError(f"pipeline={pipeline!r}; choose from {', '.join(PIPELINES)} (or pass a pipeline object, "
                         "e.g. AsyncPipeline(max_staleness=2))")
    return PIPELINES[pipeline]()


def check_module_pipeline(module: Any, pipeline: str | Pipeline) -> None:
    """Raise before setup if ``module`` cannot run under ``pipeline`` (its ``supported_pipelines``)."""
    mode = pipeline.mode if isinstance(pipeline, Pipeline) else pipeline
    supported = getattr(module, "supported_pipelines", None)
    if supported is not None and mode not in supported:
        raise ValueError(f"{type(module).__name__} runs with pipeline in {', '.join(map(repr, supported))}, got "
                         f"Trainer(pipeline={mode!r}). {getattr(module, 'pipeline_reason', '')}".rstrip())


def prompt_batches(loader: Iterable[Any], epoch: int, start: int,
                   max_epochs: int | None) -> Iterator[tuple[int, int, Any]]:
    """``(epoch, index, raw batch)`` from ``(epoch, start)`` on, epoch after epoch, until
    ``max_epochs`` (forever without it: ``max_steps`` ends the run)."""
    while max_epochs is None or epoch < max_epochs:
        if hasattr(getattr(loader, "sampler", None), "set_epoch"):
            loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        got_any = False
        for i, raw in enumerate(loader):
            got_any = True
            if i >= start:
                yield epoch, i, raw
        if not got_any:
            raise ValueError("The train dataloader yielded no batches (is the dataset empty after filtering?)")
        epoch, start = epoch + 1, 0
