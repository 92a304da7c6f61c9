"""``Trainer``: validates its arguments, wires module, strategy and engine, and drives ``fit()``.
It coordinates and never computes; the step itself is in :mod:`rltrainer.loop`, the running
pipeline in :mod:`rltrainer.pipelines`, the checkpoint in :mod:`rltrainer.training_checkpoint`."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from rltrainer.call import call_callback_hooks, call_hooks, call_module_hook
from rltrainer.callbacks import Callback, with_defaults
from rltrainer.callbacks.checkpoint import resolve_ckpt_path
from rltrainer.checkpoints import read_trainer_state, seed_controller
from rltrainer.controller.watchdog import Watchdog
from rltrainer.data.loader import check_prompt_lengths, estimate_training_steps, resolve_dataloaders
from rltrainer.generations import LogGenerations
from rltrainer.hf_export import save_hf
from rltrainer.interrupt import save_interrupted, stop_on_interrupt
from rltrainer.loggers import (LogFlush, build_loggers, continue_logs, hyperparameters_of, log_hyperparameters,
                               log_versions, save_loggers)
from rltrainer.loop import FitContext, batch_metrics, check_skipped_steps, training_step, validation_loop
from rltrainer.models.moe import routing_shape
from rltrainer.module import Attachment, RLModule, StepMetrics, check_hooks
from rltrainer.pipelines import Pipeline, SyncRun, check_module_pipeline, prompt_batches, resolve_pipeline
from rltrainer.plan import RunPlan, build_plan, log_plan
from rltrainer.rollout.engine import RolloutEngine, check_engine_sampling
from rltrainer.rollout.rollout import Rollout, resolve_rollout
from rltrainer.schedulers import estimate_optimizer_steps
from rltrainer.strategies.strategy import Strategy, resolve_strategy
from rltrainer.training_checkpoint import PendingCheckpoint, load_checkpoint, write_checkpoint
from rltrainer.values import check_float, check_int, named_keywords
from rltrainer.weights.sync import WeightSync

log = logging.getLogger(__name__)


class Trainer:
    """Runs RL post-training on one controller process.

    Args:
        strategy: ``"single"`` (one device, in-process), a registered preset, or a ``Strategy`` (with the
            micro-batch, packing and clipping settings: ``FSDP2Strategy(micro_batch_size=4, padding_free=True)``).
        rollout: a :class:`~rltrainer.rollout.rollout.Rollout` (``Rollout("vllm", placement="split", replicas=2)``)
            or, as shorthand, its engine: ``"hf"`` (runs anywhere), a registered engine, or a ``RolloutEngine``.
        devices: devices for training (``1`` for ``"single"``).
        num_nodes: nodes for distributed strategies.
        max_steps: stop after this many steps (``-1``: no limit).
        max_epochs: stop after this many passes over the prompts (default 1 without ``max_steps``).
        val_check_interval: validate before the first step (logged as step 0, unless ``fit`` resumes) and
            every N steps, so the log holds the start and the end (``None``: only at the end of ``fit``).
        limit_val_batches: validate on at most this many batches.
        log_every_n_steps: send metrics to the loggers every N steps.
        log_flush_s: loggers write their rows after every logged step (``0``), or at the first one
            ``log_flush_s`` seconds after the last write (:class:`~rltrainer.loggers.LogFlush`).
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"16-mixed"``.
        gradient_clip_val: clip the global gradient norm to this (``None``: no clipping).
        seed: seeds Python, numpy and torch at the start of ``fit``.
        default_root_dir: where logs and checkpoints go (default: the working directory).
        callbacks: a list of :class:`~rltrainer.callbacks.Callback`. ``ProgressBar`` (with
            ``enable_progress_bar``), ``LearningSignal`` and ``LogGenerations`` are added unless given.
        logger: ``True`` (CSV), ``False``, a name (``"csv"``, ``"tensorboard"``, ``"wandb"``, ``"mlflow"``),
            a :class:`~rltrainer.loggers.Logger` (a name with the run's project, name and id), a Lightning
            logger, or a list. Each gets the module's and the Trainer's hyperparameters when ``fit`` starts.
        fast_dev_run: run 1 step (or N if an int) and 1 validation batch, with no logger.
        enable_progress_bar: show a progress bar with the step, reward and step time.
        pipeline: when rollouts are made relative to updates: a pipeline object
            (:class:`~rltrainer.pipelines.SyncPipeline`, ``OneStepOffPipeline``, ``AsyncPipeline``)
            or its name, ``"sync"``, ``"one_step_off"`` or ``"async"``; see :mod:`rltrainer.pipelines`.
        stage_timeout_s: how long a stage the controller waits for may run before it raises, naming
            the stage, the ranks that did not answer and their stacks (:mod:`rltrainer.controller.watchdog`):
            seconds for every stage, a dict by stage, method or group name (``{"train_step": 900}``), or
            ``None``: 10x its median, >= 300 s (1800 s before it completed once); inf: none.

    ``precision`` and ``gradient_clip_val`` configure a strategy built from its name; a ``Strategy``
    carries its own, and a Trainer value changed from its default that disagrees with it raises. An
    unknown keyword raises ``TypeError`` naming the closest valid one.
    """

    @named_keywords("Trainer")
    def __init__(self, strategy: str | Strategy = "single", rollout: str | RolloutEngine | Rollout = "hf",
                 devices: int | str = 1, num_nodes: int = 1, max_steps: int = -1, max_epochs: int | None = None,
                 val_check_interval: int | None = None, limit_val_batches: int | None = None,
                 log_every_n_steps: int = 1, log_flush_s: float = 0.0, precision: str = "32-true",
                 gradient_clip_val: float | None = 1.0, seed: int = 0, default_root_dir: str | Path | None = None,
                 callbacks: list[Callback] | None = None, logger: Any = True, fast_dev_run: bool | int = False,
                 enable_progress_bar: bool = True, pipeline: Pipeline | str = "sync",
                 stage_timeout_s: float | dict[str, float] | None = None) -> None:
        for name, value, low, none in (
                ("max_epochs", max_epochs, 1, "1 without max_steps"), ("seed", seed, None, None),
                ("num_nodes", num_nodes, 1, None), ("max_steps", max_steps, 1, None),
                ("val_check_interval", val_check_interval, 1, "at the end of fit only"),
                ("limit_val_batches", limit_val_batches, 1, "all"), ("log_every_n_steps", log_every_n_steps, 1, None),
                ("fast_dev_run", fast_dev_run * 1 if isinstance(fast_dev_run, bool) else fast_dev_run, 0, None),
                ("devices", 1 if devices == "auto" else devices, 1, None)):
            check_int(name, value, at_least=low, none=none, owner="Trainer",
                      special={-1: "no limit"} if name == "max_steps" else None)
        check_float("gradient_clip_val", gradient_clip_val, above=0, none="no clipping", owner="Trainer")
        self.pipeline = resolve_pipeline(pipeline)
        self.strategy = resolve_strategy(strategy, devices=devices, num_nodes=num_nodes, precision=precision,
                                         gradient_clip_val=gradient_clip_val)
        self.watchdog = self.strategy.watchdog = Watchdog(stage_timeout_s)
        self.rollout = resolve_rollout(rollout)  # the engine, where it runs, and how weights reach it
        self.pipeline.check_rollout(self.rollout)
        self._run: SyncRun | None = None  # during fit: the pipeline's running state
        self._pipeline_state: dict[str, Any] | None = None  # restored from a checkpoint, for the next fit
        self._engine_spec = self.rollout.engine
        self.engine: RolloutEngine = self._engine_spec  # after setup: the engine the rollout connected
        self.sync: WeightSync | None = None  # after setup: pushes the strategy's weights into the engine
        self._pending_checkpoint: PendingCheckpoint | None = None  # an async save, completed later
        self.fast_dev_run = int(fast_dev_run)
        if self.fast_dev_run:
            max_steps, limit_val_batches, logger = self.fast_dev_run, 1, False
        self.max_steps = max_steps
        self.max_epochs = max_epochs if max_epochs is not None else (1 if max_steps == -1 else None)
        self.val_check_interval, self.limit_val_batches = val_check_interval, limit_val_batches
        self.log_every_n_steps, self.seed = log_every_n_steps, seed
        self.default_root_dir = str(default_root_dir or os.getcwd())
        self.callbacks: list[Callback] = with_defaults(list(callbacks or []), enable_progress_bar)
        self.loggers = build_loggers(logger, self.default_root_dir)
        self.log_flush = LogFlush(log_flush_s)
        self.module: RLModule | None = None
        self.global_step = 0
        self.should_stop = False  # a callback sets it to end fit() after this step (as in Lightning)
        self.interrupted = False  # the last fit() was stopped by Ctrl-C (and saved a checkpoint)
        self.ckpt_path: Path | None = None  # the checkpoint the last fit() resumed from
        self.ckpt_step: int | None = None  # and its step
        self.current_epoch = self.batches_seen_in_epoch = 0
        self._metrics = StepMetrics()  # the step's metrics: what the module logs, the pipeline adds
        self._fit: FitContext | None = None  # during fit: what the step, validation and the pipeline use
        self.callback_metrics: dict[str, float] = {}
        self.estimated_total_steps: int | None = None
        self.plan: RunPlan | None = None  # during and after fit: what a step does, in rows
        self.vocab_size: int | None = None  # after setup: the policy's, for checking prompt ids
        self.max_positions: int | None = None  # after setup: its max_position_embeddings, for prompt lengths
        self._is_setup = False
        self._validated_this_step = False

    # -- public API -----------------------------------------------------------------------------
    def fit(self, module: RLModule, train_dataloaders: Iterable[Any] | None = None,
            val_dataloaders: Iterable[Any] | None = None, datamodule: Any = None,
            ckpt_path: str | Path | None = None) -> None:
        """Train ``module`` on prompts from ``train_dataloaders`` (or ``datamodule``); with ``ckpt_path``
        (a directory :meth:`save_checkpoint` wrote, or ``"last"``: the newest in ``ModelCheckpoint``'s
        ``dirpath`` or beside it; a fresh run with none warns and starts from scratch), resume from it.
        Ctrl-C ends it after the current step with a checkpoint (:mod:`rltrainer.interrupt`)."""
        check_hooks(module)
        check_module_pipeline(module, self.pipeline)  # before setup: nothing is built for a refused pairing
        check_engine_sampling(self._engine_spec, module.sampling, getattr(module, "rollout_correction", None),
                              type(module).__name__)
        train_loader, val_loader = resolve_dataloaders(train_dataloaders, val_dataloaders, datamodule)
        self.estimated_total_steps = estimate_training_steps(train_loader, self.max_epochs, self.max_steps)
        self.plan = build_plan(module, self.strategy, train_loader, self.estimated_total_steps, self.rollout)
        resume = resolve_ckpt_path(self, ckpt_path) if ckpt_path is not None else None
        if resume is not None:  # before anything is logged: the resumed run writes on in the checkpointed run's log
            continue_logs(self.loggers, read_trainer_state(resume))
        log_plan(self.plan, self.loggers)  # checked and shown before any model is built
        seed_controller(self.seed)
        module.estimated_optimizer_steps = estimate_optimizer_steps(  # before setup: LR schedules read it
            self.estimated_total_steps, module, getattr(train_loader, "batch_size", None))
        self._setup(module)
        self.ckpt_path, self.interrupted, failure = None, False, None
        try:
            check_prompt_lengths(self.max_positions, module.sampling.max_new_tokens, train=train_loader, val=val_loader)
            if resume is not None:
                self._restore(resume)
            self._validated_this_step = self.should_stop = False
            log_hyperparameters(self.loggers, {"pipeline/mode": self.pipeline.mode, **hyperparameters_of(
                trainer=self, pipeline=self.pipeline, strategy=self.strategy, rollout=self.rollout, module=module)})
            call_hooks(self, "on_fit_start")
            with stop_on_interrupt(self):
                if val_loader is not None and self.val_check_interval and self.global_step == 0:
                    self._run_validation(val_loader)  # the starting point, logged as step 0
                self._fit_loop(train_loader, val_loader)
                self.sync.wait()
                if self.interrupted:
                    save_interrupted(self)
            if val_loader is not None and not self._validated_this_step and not self.interrupted:
                self._run_validation(val_loader)
            call_hooks(self, "on_fit_end")
            self.wait_for_checkpoint()
        except BaseException as exc:
            failure = exc
            call_callback_hooks(self, "on_exception", exc)
            self.teardown()
            raise
        finally:
            try:
                save_loggers(self.loggers, failing=failure)  # a logger failing too must not hide the error
            finally:
                if failure is None:  # (on an error, teardown() above released it)
                    call_module_hook(self, "teardown")  # its own processes (GRPO: the reward workers)

    def validate(self, module: RLModule | None = None, dataloaders: Iterable[Any] | None = None,
                 datamodule: Any = None) -> dict[str, float]:
        """Run ``validation_step`` over the validation prompts; return the averaged metrics."""
        if module is None and self.module is None:
            raise ValueError("validate() needs a module the first time it is called")
        if module is not None and module is not self.module:
            check_hooks(module)
            seed_controller(self.seed)
            self._setup(module)
        _, loader = resolve_dataloaders(None, dataloaders, datamodule, need_train=False, need_val="validate()")
        check_prompt_lengths(self.max_positions, self.module.sampling.max_new_tokens, val=loader)
        return self._run_validation(loader)

    @property
    def off_policy(self) -> bool:
        """Whether rows can come from other weights than the trainer's, or with log-probs it would not
        compute (the module then takes ``old_log_probs`` from the trainer, see :class:`~rltrainer.GRPO`):
        any pipeline but ``"sync"``, or an engine whose log-probs differ."""
        return self.pipeline.mode != "sync" or not getattr(self._engine_spec, "trainer_log_probs", False)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.teardown()

    def restore(self, module: RLModule, ckpt_path: str | Path) -> None:
        """Set ``module`` up on this Trainer and load the checkpoint ``ckpt_path`` (a path, or
        ``"last"``) as ``fit(ckpt_path=...)`` does before it trains: to export or evaluate it."""
        self._setup(module)
        self._restore(ckpt_path)

    def save_checkpoint(self, path: str | Path, async_save: bool = False,
                        on_saved: Callable[[Path], None] | None = None) -> None:
        """Write the training state to the directory ``path`` (:mod:`rltrainer.training_checkpoint`): the
        strategy's models, optimizers and schedulers (each rank its own shards), and this controller's
        counters, RNG, data position, pipeline buffers and callbacks' entries. It appears only once
        complete (written under a temporary name, then renamed), and then ``on_saved(path)`` runs.
        With ``async_save``, ranks that can (FSDP2: DCP's async save) copy their shards to memory and
        write them in the background while training goes on; the checkpoint is completed by the next
        save, the end of ``fit``, teardown or :meth:`wait_for_checkpoint`, whichever comes first."""
        self.wait_for_checkpoint()
        if self.sync is not None:
            self.sync.wait()
        pipeline = self._run.state_dict() if self._run is not None else self._pipeline_state or {}
        state = {"pipeline": {"mode": self.pipeline.mode, **pipeline}, "rollout": self.rollout.state_dict(),
                 "global_step": self.global_step, "current_epoch": self.current_epoch,
                 "batches_seen_in_epoch": self.batches_seen_in_epoch, "loggers": log_versions(self.loggers)}
        self._pending_checkpoint = write_checkpoint(path, self.strategy, state, functools.partial(
            call_callback_hooks, self, "on_save_checkpoint"), async_save, on_saved)
        if not async_save:
            self.wait_for_checkpoint()

    def wait_for_checkpoint(self) -> None:
        """Wait for an asynchronous save in flight (if any) to finish, and make it visible."""
        pending, self._pending_checkpoint = self._pending_checkpoint, None
        if pending is not None:
            pending.complete(self.strategy)  # checksums.json lists every file's sha256, then the rename

    def save_hf(self, path: str | Path, dtype: torch.dtype | None = None, lora: str = "merged",
                max_shard_bytes: int | None = None) -> Path:
        """Export the policy as a Hugging Face model directory ``AutoModelForCausalLM.from_pretrained(path)``
        loads, from any strategy (:mod:`rltrainer.hf_export`). ``dtype``: cast the weights (default: as
        trained); a LoRA policy merged in (``lora="merged"``) or the adapter alone (``"adapter"``, peft's
        format). ``path`` must be new or empty; it appears only once complete."""
        return save_hf(self.module, self.strategy, self.sync, path, dtype=dtype, lora=lora,
                       max_shard_bytes=max_shard_bytes)

    def teardown(self) -> None:
        """Release the engine's, the strategy's (Ray workers) and the module's processes and memory; requests still
        in flight end with them; an asynchronous checkpoint save in flight completes first."""
        try:
            self.wait_for_checkpoint()
        except Exception:  # release everything even so; the previous checkpoint is intact
            log.exception("An asynchronous checkpoint save failed; it was not made visible")
        if self._is_setup and self._run is not None:
            self.rollout.teardown()  # kill the workers first: threads waiting on them return at once
            self.strategy.teardown()
        if self._run is not None:
            self._run.close()
            self._run = self._fit = None
        if self.sync is not None:
            self.sync.close()  # a push in flight ends first; its error is not raised (already failing)
        if self._is_setup:
            try:
                self.engine.teardown()
            finally:
                call_module_hook(self, "teardown")  # its own processes (GRPO: the reward workers)
                self.rollout.teardown()
                self.strategy.teardown()
                self.engine, self.sync = self._engine_spec, None
                self._is_setup = False

    # -- internals ------------------------------------------------------------------------------
    def _attach(self, module: RLModule) -> None:  # what the module reads of this run, handed over
        recorder = next((c for c in self.callbacks if isinstance(c, LogGenerations)), None)
        record = recorder and functools.partial(recorder.record, self)
        module.attach(Attachment(self.off_policy, self.vocab_size, record, self._metrics, trainer=self))

    def _setup(self, module: RLModule) -> None:
        if self._is_setup and module is self.module:
            return self._attach(module)
        if self._is_setup:
            self.teardown()
        self.module = module
        self._attach(module)
        try:
            self.strategy.setup(module, seed=self.seed)
            self._is_setup = True
            config = self.strategy.model_config()
            self.vocab_size = getattr(config, "vocab_size", None)  # prompt ids are checked
            self._attach(module)  # with the vocabulary size
            self.max_positions = getattr(config, "max_position_embeddings", None)  # and prompt lengths
            if module.records_routes() and routing_shape(config) is not None:  # a MoE policy's routes (R3)
                self._engine_spec.return_routed_experts = True
            self.sync = self.rollout.connect(self.strategy, module.tokenizer, seed=self.seed, watchdog=self.watchdog,
                                             mode=self.pipeline.push_mode)
            self.engine = self.sync.engine
            self.sync.push(self.global_step, mode="wait")
        except BaseException:
            self._is_setup = True  # release what setup started (worker processes), then report the error
            with contextlib.suppress(Exception):
                self.teardown()
            raise

    def _context(self) -> FitContext:  # what the step, validation and the pipeline's run use of the Trainer
        return FitContext(self.module, self.strategy, self.engine, self.sync, self.watchdog, self.seed,
                          self.global_step, self._metrics, functools.partial(call_hooks, self))

    def _fit_loop(self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None) -> None:
        if self._done():
            return
        batches = prompt_batches(train_loader, self.current_epoch, self.batches_seen_in_epoch, self.max_epochs)
        fit = self._fit = self._context()  # once per fit
        run = self._run = self.module._prompt_source = self.pipeline.start(fit, batches)
        if self._pipeline_state is not None:
            run.load_state_dict(self._pipeline_state)
            self._pipeline_state = None
        self._metrics.current = {}
        skipped: list[bool] = []  # per step of this fit: was every optimizer step skipped
        for batch in run:  # generated rows; the pipeline decides with which weights
            metrics = training_step(fit, batch)
            self.global_step = fit.step = self.global_step + 1
            self.current_epoch, self.batches_seen_in_epoch = run.position(batch)
            check_skipped_steps(skipped, metrics, self.global_step, last=self._done())
            metrics.update(run.metrics())
            metrics.update(batch_metrics(batch, metrics["timing_s/step"]))
            metrics["training/epoch"] = float(self.current_epoch)
            self._validated_this_step = False
            if val_loader is not None and self.val_check_interval and self.global_step % self.val_check_interval == 0:
                metrics.update(self._run_validation(val_loader, log=False))
            self.callback_metrics = metrics
            if self.global_step % self.log_every_n_steps == 0:
                self.log_flush.log(self.loggers, metrics, self.global_step)
            call_hooks(self, "on_step_end", metrics)
            self._metrics.current = {}
            if self._done():
                break
        else:  # the prompts ran out: every epoch is done
            self.current_epoch, self.batches_seen_in_epoch = self.max_epochs or self.current_epoch + 1, 0
        self._pipeline_state = run.state_dict()  # for save_checkpoint after fit, and the next fit
        run.close()
        self._run = self.module._prompt_source = self._fit = None

    def _done(self) -> bool:
        return self.should_stop or (self.max_steps != -1 and self.global_step >= self.max_steps) or \
            (self.max_epochs is not None and self.current_epoch >= self.max_epochs)

    def _run_validation(self, loader: Iterable[Any], log: bool = True) -> dict[str, float]:
        self.sync.wait()
        call_hooks(self, "on_validation_start")
        self.engine.wake_up()
        step_metrics, self._metrics.current = self._metrics.current, {}  # what validation hooks log is not the step's
        try:
            metrics = validation_loop(self._fit or self._context(), loader, self.limit_val_batches)
        finally:
            self._metrics.current = step_metrics
        call_hooks(self, "on_validation_end", metrics)
        self._validated_this_step = True
        if log:  # outside a step (after fit, validate()): the latest val/* also in callback_metrics
            self.callback_metrics = {**self.callback_metrics, **metrics}
            self.log_flush.log(self.loggers, metrics, self.global_step)
            save_loggers(self.loggers)  # a validate() after fit is in metrics.csv at once
        return metrics

    def _restore(self, ckpt_path: str | Path) -> None:
        path = resolve_ckpt_path(self, ckpt_path)  # fit() passes it resolved; restore() its argument
        if path is None:
            return
        checkpoint = read_trainer_state(path)
        log.info("Resuming from checkpoint %s%s (step %d)", path, f" -> {path.resolve()}" * path.is_symlink(),
                 checkpoint["global_step"])
        self._pipeline_state = load_checkpoint(path, checkpoint, self.strategy, self.pipeline.mode)
        self.global_step = checkpoint["global_step"]
        self.current_epoch = checkpoint["current_epoch"]
        self.batches_seen_in_epoch = checkpoint["batches_seen_in_epoch"]
        self.ckpt_path, self.ckpt_step = path, checkpoint["global_step"]
        self.rollout.load_state_dict(checkpoint.get("rollout", {}))
        call_callback_hooks(self, "on_load_checkpoint", checkpoint)
        self.sync.push(self.global_step, mode="wait")
