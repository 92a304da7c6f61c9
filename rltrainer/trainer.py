"""``Trainer``: validates its arguments, wires module, strategy and engine, and drives ``fit()``.
It coordinates and never computes; the step itself is in :mod:`rltrainer.loop`."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rltrainer.call import call_callback_hooks, call_hooks, call_module_hook
from rltrainer.callbacks import Callback, LearningSignal, ProgressBar
from rltrainer.callbacks.checkpoint import resolve_ckpt_path
from rltrainer.checkpoints import (FORMAT, MANIFEST, TRAINER_FILE, TRAINING_DIR, VERSION, CheckpointError,
                                   commit_directory, controller_rng_state, load_training, read_trainer_state, save_file,
                                   seal, set_controller_rng_state, temporary_directory)
from rltrainer.controller.watchdog import Watchdog
from rltrainer.data.batch import RolloutBatch
from rltrainer.generations import generation_rows, spread, write_generations
from rltrainer.interrupt import save_interrupted, stop_on_interrupt
from rltrainer.loggers import (LogFlush, build_loggers, continue_logs, hyperparameters, log_hyperparameters,
                               log_versions, save_loggers)
from rltrainer.loop import batch_metrics, check_skipped_steps, training_step, validation_loop
from rltrainer.module import RLModule, check_hooks
from rltrainer.pipelines import Pipeline, build_pipeline, check_module_pipeline, check_pipeline
from rltrainer.plan import RunPlan, build_plan, log_plan
from rltrainer.rollout.engine import RolloutEngine, build_engine, check_engine_sampling
from rltrainer.schedulers import estimate_optimizer_steps
from rltrainer.strategies.strategy import Strategy, resolve_strategy
from rltrainer.strategies.weight_sync import WeightSync

log = logging.getLogger(__name__)


class Trainer:
    """Runs RL post-training on one controller process.

    Args:
        strategy: ``"single"`` (one device, in-process), a registered preset, or a ``Strategy``.
        rollout: ``"hf"`` (transformers, runs anywhere), a registered engine, or a ``RolloutEngine``.
        devices: devices for training (``1`` for ``"single"``).
        num_nodes: nodes for distributed strategies.
        max_steps: stop after this many steps (``-1``: no limit).
        max_epochs: stop after this many passes over the prompts (default 1 when ``max_steps`` is
            unset).
        val_check_interval: validate every N steps (``None``: only at the end of ``fit``).
        limit_val_batches: validate on at most this many batches.
        log_every_n_steps: send metrics to the loggers every N steps.
        log_flush_s: loggers write their rows after every logged step (``0``), or at the first one
            ``log_flush_s`` seconds after the last write (:class:`~rltrainer.loggers.LogFlush`).
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"16-mixed"``.
        micro_batch_size: rows per forward/backward pass on each rank (``None``: the strategy's
            default, 8).
        max_tokens_per_micro_batch: form micro-batches by a token budget instead (rows while
            ``rows x longest row`` fits; verl's ``ppo_max_token_len_per_gpu``).
        gradient_clip_val: clip the global gradient norm to this (``None``: no clipping).
        padding_free: run each micro-batch's rows packed into one sequence without their padding,
            in the compute stages and the update (TRL's ``padding_free``, verl's
            ``use_remove_padding``; see :mod:`rltrainer.packing`); ``max_tokens_per_micro_batch``
            then counts real tokens. Off by default (measured on CPU: tests/benchmarks/README.md).
            ``"megatron"`` refuses it.
        seed: seeds Python, numpy and torch at the start of ``fit``.
        default_root_dir: where logs and checkpoints go (default: the working directory).
        callbacks: a list of :class:`~rltrainer.callbacks.Callback`.
        logger: ``True`` (CSV), ``False``, a name (``"csv"``, ``"tensorboard"``, ``"wandb"``,
            ``"mlflow"``), a Lightning logger, or a list. Every logger gets the module's and the
            Trainer's hyperparameters at the start of ``fit``.
        project: a logger built by name: the W&B project, MLflow experiment, or CSV/TensorBoard
            folder (default ``"lightning_logs"``).
        run_name: a logger built by name: the W&B / MLflow run name, the CSV/TensorBoard version.
        run_id: the W&B (or MLflow) run id to log to. ``None`` with ``"wandb"``: the id this job's
            ``default_root_dir`` kept from its first start (``wandb_run_id``), so a job restarted
            after preemption resumes the same W&B run.
        fast_dev_run: run 1 step (or N if an int) and 1 validation batch, with no logger.
        enable_progress_bar: show a progress bar with the step, reward and step time.
        weight_sync: ``"sync"`` (push new weights at the end of each step and wait) or ``"async"``
            (push in a background thread; logging, callbacks and loading the next prompts overlap
            with it, and the next rollout, validation or checkpoint waits for it).
        pipeline: ``"sync"`` (generate, then train), ``"one_step_off"`` (generate batch ``t + 1``
            with the previous weights while training on batch ``t``) or ``"async"`` (engines stream
            groups into a buffer, rows at most ``max_staleness`` versions old). The last two need
            the engines in processes of their own (``rollout_placement="split"``); see
            :mod:`rltrainer.pipelines`.
        max_staleness: ``"async"``: how many policy versions a trained row may lag.
        staleness_policy: ``"async"``: ``"wait"`` (train on the oldest requests first, never
            exceed the bound) or ``"drop"`` (train on what finished first; drop rows that fell
            behind the bound, count them and generate their prompts again).
        stage_timeout_s: the watchdog over the controller's waits (:mod:`rltrainer.controller.watchdog`):
            a stage (``actor.train_step``, ``rollout.generate``; when set, also ``reward.reward_step``,
            ``single.train_step``, ``weights.push``...) that runs longer raises in the controller, naming
            the stage, the ranks that did not answer and their Python stacks; everything is shut down. One
            number for every stage, a dict by stage, method or group name (``{"train_step": 900}``; the others:
            the default), or ``None``: 10x its median, >= 300 s (1800 s before it completed once); inf: none.
        log_generations_every_n_steps: send ``log_generations_rows`` sample generations (prompt,
            response, reward, advantage, finish reason, per-function rewards) to the loggers every
            N steps, and at every validation (``None``: never); see :mod:`rltrainer.generations`.
        log_generations_rows: how many rows each time.

    ``precision`` and the micro-batch / clipping / packing settings configure a strategy built from
    its name; a ``Strategy`` instance carries its own (``FSDP2Strategy(micro_batch_size=4)``), and a
    Trainer value changed from its default that disagrees with the instance's raises.
    """

    def __init__(
        self,
        strategy: str | Strategy = "single",
        rollout: str | RolloutEngine = "hf",
        devices: int | str = 1,
        num_nodes: int = 1,
        max_steps: int = -1,
        max_epochs: int | None = None,
        val_check_interval: int | None = None,
        limit_val_batches: int | None = None,
        log_every_n_steps: int = 1,
        log_flush_s: float = 0.0,
        precision: str = "32-true",
        micro_batch_size: int | None = None,
        max_tokens_per_micro_batch: int | None = None,
        gradient_clip_val: float | None = 1.0,
        padding_free: bool = False,
        seed: int = 0,
        default_root_dir: str | Path | None = None,
        callbacks: list[Callback] | None = None,
        logger: Any = True,
        project: str | None = None,
        run_name: str | None = None,
        run_id: str | None = None,
        fast_dev_run: bool | int = False,
        enable_progress_bar: bool = True,
        weight_sync: str = "sync",
        pipeline: str = "sync",
        max_staleness: int = 1,
        staleness_policy: str = "wait",
        stage_timeout_s: float | dict[str, float] | None = None,
        log_generations_every_n_steps: int | None = 50,
        log_generations_rows: int = 4,
    ) -> None:
        for name, value in (("max_steps", max_steps), ("log_every_n_steps", log_every_n_steps)):
            if not isinstance(value, int) or (value < 1 and not (name == "max_steps" and value == -1)):
                raise ValueError(f"{name} must be a positive int{' or -1' if name == 'max_steps' else ''}, got {value!r}")
        if max_epochs is not None and max_epochs < 1:
            raise ValueError(f"max_epochs must be >= 1 or None, got {max_epochs}")
        if val_check_interval is not None and val_check_interval < 1:
            raise ValueError(f"val_check_interval must be a positive number of steps or None, got {val_check_interval}")
        for name, value in (("log_generations_every_n_steps", log_generations_every_n_steps),
                            ("log_generations_rows", log_generations_rows)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int{' or None' if 'every' in name else ''}, got {value!r}")
        if weight_sync not in ("sync", "async"):
            raise ValueError(f"weight_sync must be 'sync' or 'async', got {weight_sync!r}")
        self.strategy = resolve_strategy(strategy, devices=devices, num_nodes=num_nodes, precision=precision,
                                         micro_batch_size=micro_batch_size,
                                         max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                                         gradient_clip_val=gradient_clip_val, padding_free=padding_free)
        self.watchdog = self.strategy.watchdog = Watchdog(stage_timeout_s)
        check_pipeline(pipeline, max_staleness, staleness_policy, self.strategy)
        if pipeline != "sync" and weight_sync != "sync":
            raise ValueError(f"weight_sync={weight_sync!r} overlaps the push with the next step in sync mode; "
                             f"pipeline={pipeline!r} already pushes in the background: leave weight_sync='sync'")
        self.pipeline, self.max_staleness, self.staleness_policy = pipeline, max_staleness, staleness_policy
        self._pipeline: Pipeline | None = None  # during fit: the running pipeline
        self._pipeline_state: dict[str, Any] | None = None  # restored from a checkpoint, for the next fit
        self._engine_spec = build_engine(rollout)
        self.engine: RolloutEngine = self._engine_spec  # after setup: the engine the strategy connected
        self.weight_sync = weight_sync
        self.sync: WeightSync | None = None  # after setup: pushes the strategy's weights into the engine
        self._pending_checkpoint: tuple[Path, Path, Callable[[Path], None] | None] | None = None  # async save
        self.fast_dev_run = int(fast_dev_run)
        if self.fast_dev_run:
            max_steps, limit_val_batches, logger = self.fast_dev_run, 1, False
        self.max_steps = max_steps
        self.max_epochs = max_epochs if max_epochs is not None else (1 if max_steps == -1 else None)
        self.val_check_interval, self.limit_val_batches = val_check_interval, limit_val_batches
        self.log_every_n_steps, self.seed = log_every_n_steps, seed
        self.default_root_dir = str(default_root_dir or os.getcwd())
        self.callbacks: list[Callback] = list(callbacks or [])
        defaults = [ProgressBar] * bool(enable_progress_bar) + [LearningSignal]  # unless given (configured)
        self.callbacks += [cls() for cls in defaults if not any(isinstance(c, cls) for c in self.callbacks)]
        self.loggers = build_loggers(logger, self.default_root_dir, project, run_name, run_id)
        self.log_flush = LogFlush(log_flush_s)
        self.log_generations_every_n_steps = log_generations_every_n_steps
        self.log_generations_rows = log_generations_rows
        self._generations: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}  # rows to log, per split
        self.module: RLModule | None = None
        self.global_step = 0
        self.should_stop = False  # a callback sets it to end fit() after this step (as in Lightning)
        self.interrupted = False  # the last fit() was stopped by Ctrl-C (and saved a checkpoint)
        self.ckpt_path: Path | None = None  # the checkpoint the last fit() resumed from
        self.ckpt_step: int | None = None  # and its step
        self.current_epoch = 0
        self.batches_seen_in_epoch = 0
        self.step_metrics: dict[str, float] = {}
        self.callback_metrics: dict[str, float] = {}
        self.estimated_total_steps: int | None = None
        self.plan: RunPlan | None = None  # during and after fit: what a step does, in rows
        self.vocab_size: int | None = None  # after setup: the policy's, for checking prompt ids
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
        self.estimated_total_steps = self._estimate_total_steps(train_loader)
        self.plan = build_plan(module, self.strategy, train_loader, self.estimated_total_steps)
        resume = resolve_ckpt_path(self, ckpt_path) if ckpt_path is not None else None
        if resume is not None:  # before anything is logged: the resumed run writes on in the checkpointed run's log
            continue_logs(self.loggers, read_trainer_state(resume))
        log_plan(self.plan, self.loggers)  # checked and shown before any model is built
        self._seed_everything()
        module.estimated_optimizer_steps = estimate_optimizer_steps(  # before setup: LR schedules read it
            self.estimated_total_steps, module, getattr(train_loader, "batch_size", None))
        self._setup(module)
        self.ckpt_path, self.interrupted, failure = None, False, None
        try:
            if resume is not None:
                self._restore(resume)
            self._validated_this_step = self.should_stop = False
            log_hyperparameters(self.loggers, {**hyperparameters(self, "trainer"),
                                               **hyperparameters(self.strategy, "strategy"),
                                               **hyperparameters(module, "module")})
            call_hooks(self, "on_fit_start")
            with stop_on_interrupt(self):
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
            self._seed_everything()
            self._setup(module)
        _, loader = resolve_dataloaders(None, dataloaders, datamodule, need_train=False)
        if loader is None:
            raise ValueError("validate() needs val dataloaders (or a datamodule with val_dataloader())")
        return self._run_validation(loader)

    def sync_weights(self) -> dict[str, float]:
        """Push the policy's changed weights from the strategy to the engine and wait. Returns
        ``tensors``, ``bytes``, ``skipped`` (unchanged since the last sync) and ``seconds``."""
        if self.sync is None:
            raise RuntimeError("Trainer.sync_weights() needs a set-up trainer (inside or after fit/validate)")
        return self.sync.sync(self.global_step)

    def draw_prompts(self) -> RolloutBatch | None:
        """During ``fit``, for a ``rollout_step`` that needs more prompts than its batch (dynamic
        sampling): the next loader batch as prompt rows with ``prompt_position [B, 3]``, or ``None``
        when the data ran out. It counts as consumed (the epoch and resume position move past it).
        Only ``pipeline="sync"`` offers it; a module that uses it sets ``supported_pipelines``."""
        if self._pipeline is None:
            raise RuntimeError("Trainer.draw_prompts() is only available inside fit(), from rollout_step")
        return self._pipeline.draw_prompts()

    def record_generations(self, batch: RolloutBatch, split: str) -> None:
        """Keep sample rows of a scored batch for the loggers (see :mod:`rltrainer.generations`):
        ``split="train"`` on the steps that log them, ``"val"`` until ``log_generations_rows`` are
        kept. The loop and the default ``validation_step`` call it; a custom ``validation_step``
        may too."""
        every, kept = self.log_generations_every_n_steps, self._generations[split]
        if not self.loggers or every is None or len(kept) >= self.log_generations_rows:
            return
        if split == "train" and (self.global_step + 1) % every:
            return
        want = self.log_generations_rows - len(kept)
        indices = spread(len(batch), want) if split == "train" else list(range(min(want, len(batch))))
        kept.extend(generation_rows(batch, self.module.tokenizer, indices))

    def _write_generations(self, split: str) -> None:
        rows, self._generations[split] = self._generations[split], []
        write_generations(self.loggers, rows, self.global_step, split)

    @property
    def off_policy(self) -> bool:
        """Whether rows can come from other weights than the trainer's, or with log-probs the
        trainer would not compute (then the module takes ``old_log_probs`` from the trainer, in a
        pass of their own or from the update's forward, and logs the mismatch; see
        :class:`~rltrainer.GRPO`): any pipeline but ``"sync"``, or an engine whose log-probs differ."""
        return self.pipeline != "sync" or not getattr(self._engine_spec, "trainer_log_probs", False)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.teardown()

    def save_checkpoint(self, path: str | Path, async_save: bool = False,
                        on_saved: Callable[[Path], None] | None = None) -> None:
        """Write the training state to the directory ``path``: the strategy's models, optimizers and
        schedulers (each rank its own shards, on a distributed strategy), and this controller's
        counters, RNG, data position and callbacks' entries. It appears only once complete (written
        under a temporary name, then renamed; see :mod:`rltrainer.checkpoints`), and then
        ``on_saved(path)`` runs.

        With ``async_save``, ranks that can (FSDP2: DCP's async save) copy their shards to memory and
        write them in the background while training goes on; the checkpoint is completed by the next
        save, the end of ``fit``, teardown or :meth:`wait_for_checkpoint`, whichever comes first."""
        self.wait_for_checkpoint()
        if self.sync is not None:
            self.sync.wait()
        path = Path(path)
        pipeline = self._pipeline.state_dict() if self._pipeline is not None else self._pipeline_state or {}
        tmp = temporary_directory(path)
        try:
            (tmp / TRAINING_DIR).mkdir()
            strategy_state = self.strategy.save_checkpoint(tmp / TRAINING_DIR, async_save=async_save)
            checkpoint = {"format": FORMAT, "version": VERSION,
                          "strategy_class": type(self.strategy).__name__, "strategy": strategy_state,
                          "pipeline": {"mode": self.pipeline, **pipeline}, "global_step": self.global_step,
                          "current_epoch": self.current_epoch, "batches_seen_in_epoch": self.batches_seen_in_epoch,
                          "rng": controller_rng_state(), "loggers": log_versions(self.loggers), "checksums": MANIFEST}
            call_callback_hooks(self, "on_save_checkpoint", checkpoint)
            save_file(checkpoint, tmp / TRAINER_FILE, "the trainer state")
        except BaseException:
            with contextlib.suppress(Exception):
                self.strategy.wait_checkpoint()  # nothing writes into it any more
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._pending_checkpoint = (tmp, path, on_saved)
        if not async_save:
            self.wait_for_checkpoint()

    def wait_for_checkpoint(self) -> None:
        """Wait for an asynchronous save in flight (if any) to finish, and make it visible."""
        if self._pending_checkpoint is None:
            return
        (tmp, path, on_saved), self._pending_checkpoint = self._pending_checkpoint, None
        try:
            seal(tmp, self.strategy)  # the ranks' writes are done; checksums.json lists every file's sha256
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        commit_directory(tmp, path)
        if on_saved is not None:
            on_saved(path)

    def save_hf(self, path: str | Path, dtype: torch.dtype | None = None, lora: str = "merged",
                max_shard_bytes: int | None = None) -> Path:
        """Export the policy as a Hugging Face model directory (safetensors shards, config,
        generation config, tokenizer) that ``AutoModelForCausalLM.from_pretrained(path)`` loads,
        from any strategy, gathering one bucket at a time (:mod:`rltrainer.export`). ``dtype``:
        cast the weights (default: as trained). A LoRA policy: ``lora="merged"`` (default) merges
        the adapter in; ``lora="adapter"`` writes the adapter alone (peft's format). ``path`` must
        be new or empty; it appears only once complete."""
        from rltrainer.export import save_hf

        return save_hf(self, path, dtype=dtype, lora=lora, max_shard_bytes=max_shard_bytes)

    def teardown(self) -> None:
        """Release the engine's, the strategy's (Ray workers) and the module's processes and memory; requests still
        in flight end with them; an asynchronous checkpoint save in flight completes first."""
        try:
            self.wait_for_checkpoint()
        except Exception:  # release everything even so; the previous checkpoint is intact
            log.exception("An asynchronous checkpoint save failed; it was not made visible")
        if self._is_setup and self._pipeline is not None:
            self.strategy.teardown()  # kill the workers first: threads waiting on them return at once
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None
        if self.sync is not None:
            self.sync.close()  # a push in flight ends first; its error is not raised (already failing)
        if self._is_setup:
            try:
                self.engine.teardown()
            finally:
                call_module_hook(self, "teardown")  # its own processes (GRPO: the reward workers)
                self.strategy.teardown()
                self.engine, self.sync = self._engine_spec, None
                self._is_setup = False

    def as_batch(self, raw: Any) -> RolloutBatch:
        """A dataloader's batch as a :class:`RolloutBatch` (from a batch, a list of rows, or columns)."""
        if isinstance(raw, RolloutBatch):
            return raw
        if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], Mapping):
            return RolloutBatch.from_rows(raw)
        if isinstance(raw, Mapping):
            return RolloutBatch.from_rows(raw)
        raise TypeError(
            "A dataloader batch must be a RolloutBatch, a list of dict rows, or a dict of columns; got "
            f"{type(raw).__name__}. Use rltrainer.data.prompt_dataloader(dataset, batch_size) to build one."
        )

    # -- internals ------------------------------------------------------------------------------
    def _setup(self, module: RLModule) -> None:
        if self._is_setup and module is self.module:
            return
        if self._is_setup:
            self.teardown()
        self.module = module
        module._trainer = self
        try:
            self.strategy.setup(module, seed=self.seed)
            self._is_setup = True
            self.vocab_size = getattr(self.strategy.model_config(), "vocab_size", None)  # prompt ids are checked
            mode = "overlap" if self.pipeline != "sync" else "background" if self.weight_sync == "async" else "wait"
            self.sync = self.strategy.connect(self._engine_spec, module.tokenizer, watchdog=self.watchdog, mode=mode)
            self.engine = self.sync.engine
            self.sync_weights()
        except BaseException:
            self._is_setup = True  # release what setup started (worker processes), then report the error
            with contextlib.suppress(Exception):
                self.teardown()
            raise

    def _fit_loop(self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None) -> None:
        if self._done():
            return
        pipeline = self._pipeline = build_pipeline(self, self._prompt_batches(train_loader))
        if self._pipeline_state is not None:
            pipeline.load_state_dict(self._pipeline_state)
            self._pipeline_state = None
        self.step_metrics = {}
        skipped: list[bool] = []  # per step of this fit: was every optimizer step skipped
        for batch in pipeline:  # generated rows; the pipeline decides with which weights
            metrics = training_step(self, batch)
            self.global_step += 1
            self._write_generations("train")
            self.current_epoch, self.batches_seen_in_epoch = pipeline.position(batch)
            check_skipped_steps(skipped, metrics, self.global_step, last=self._done())
            metrics.update(pipeline.metrics())
            metrics.update(batch_metrics(batch, metrics["timing_s/step"]))
            metrics["training/epoch"] = float(self.current_epoch)
            self._validated_this_step = False
            if val_loader is not None and self.val_check_interval and self.global_step % self.val_check_interval == 0:
                metrics.update(self._run_validation(val_loader, log=False))
            self.callback_metrics = metrics
            if self.global_step % self.log_every_n_steps == 0:
                self._log(metrics)
            call_hooks(self, "on_step_end", metrics)
            self.step_metrics = {}
            if self._done():
                break
        else:  # the prompts ran out: every epoch is done
            self.current_epoch, self.batches_seen_in_epoch = self.max_epochs or self.current_epoch + 1, 0
        self._pipeline_state = pipeline.state_dict()  # for save_checkpoint after fit, and the next fit
        pipeline.close()
        self._pipeline = None

    def _prompt_batches(self, loader: Iterable[Any]) -> Iterator[tuple[int, int, Any]]:
        """``(epoch, index, raw batch)`` from the restored position on, epoch after epoch, until
        ``max_epochs`` (forever without it: ``max_steps`` ends the run)."""
        epoch, start = self.current_epoch, self.batches_seen_in_epoch
        while self.max_epochs is None or epoch < self.max_epochs:
            if hasattr(getattr(loader, "sampler", None), "set_epoch"):
                loader.sampler.set_epoch(epoch)
            got_any = False
            for i, raw in enumerate(loader):
                got_any = True
                if i >= start:
                    yield epoch, i, raw
            if not got_any:
                raise ValueError("The train dataloader yielded no batches (is the dataset empty after filtering?)")
            epoch, start = epoch + 1, 0

    def _done(self) -> bool:
        if self.should_stop:
            return True
        if self.max_steps != -1 and self.global_step >= self.max_steps:
            return True
        return self.max_epochs is not None and self.current_epoch >= self.max_epochs

    def _run_validation(self, loader: Iterable[Any], log: bool = True) -> dict[str, float]:
        self.sync.wait()
        call_hooks(self, "on_validation_start")
        self.engine.wake_up()
        self._generations["val"] = []
        step_metrics, self.step_metrics = self.step_metrics, {}  # what validation hooks log is not the step's
        try:
            metrics = validation_loop(self, loader, self.limit_val_batches)
        finally:
            self.step_metrics = step_metrics
        self._write_generations("val")
        call_hooks(self, "on_validation_end", metrics)
        self._validated_this_step = True
        if log:  # outside a step (after fit, validate()): the latest val/* also in callback_metrics
            self.callback_metrics = {**self.callback_metrics, **metrics}
            self._log(metrics)
            save_loggers(self.loggers)  # a validate() after fit is in metrics.csv at once
        return metrics

    def _log(self, metrics: dict[str, float]) -> None:
        for logger in self.loggers:
            logger.log_metrics(metrics, step=self.global_step)
        self.log_flush(self.loggers)

    def _restore(self, ckpt_path: str | Path) -> None:
        path = resolve_ckpt_path(self, ckpt_path)  # fit() passes it resolved; export passes its argument
        if path is None:
            return
        checkpoint = read_trainer_state(path)
        log.info("Resuming from checkpoint %s%s (step %d)", path, f" -> {path.resolve()}" * path.is_symlink(),
                 checkpoint["global_step"])
        pipeline = dict(checkpoint["pipeline"])
        if pipeline.pop("mode", self.pipeline) != self.pipeline and pipeline:
            raise ValueError(f"The checkpoint was written with pipeline={checkpoint['pipeline']['mode']!r}; "
                             f"resume it with the same pipeline (this Trainer has {self.pipeline!r})")
        try:
            load_training(self.strategy, path, checkpoint["strategy"])  # checked against checksums.json first
        except CheckpointError as exc:
            if str(path) in str(exc) or str(path.resolve()) in str(exc):
                raise
            raise CheckpointError(f"{path}: {exc}") from exc
        self.global_step = checkpoint["global_step"]
        self.current_epoch = checkpoint["current_epoch"]
        self.batches_seen_in_epoch = checkpoint["batches_seen_in_epoch"]
        self._pipeline_state = pipeline
        set_controller_rng_state(checkpoint["rng"])
        self.ckpt_path, self.ckpt_step = path, checkpoint["global_step"]
        call_callback_hooks(self, "on_load_checkpoint", checkpoint)
        self.sync_weights()

    def _seed_everything(self) -> None:
        random.seed(self.seed)
        np.random.seed(self.seed)
        torch.manual_seed(self.seed)

    def _estimate_total_steps(self, loader: Any) -> int | None:
        try:
            per_epoch = len(loader)
        except TypeError:
            per_epoch = None
        by_epochs = per_epoch * self.max_epochs if per_epoch is not None and self.max_epochs else None
        candidates = [n for n in (by_epochs, self.max_steps if self.max_steps != -1 else None) if n is not None]
        return min(candidates) if candidates else None


def resolve_dataloaders(train: Any, val: Any, datamodule: Any, need_train: bool = True) -> tuple[Any, Any]:
    """Take loaders directly or from a datamodule (anything with ``train_dataloader()``)."""
    if datamodule is not None:
        if train is not None or val is not None:
            raise ValueError("Pass either dataloaders or a datamodule, not both")
        train = datamodule.train_dataloader() if need_train else None
        val = datamodule.val_dataloader() if hasattr(datamodule, "val_dataloader") else None
    if need_train and train is None:
        raise ValueError("fit() needs train_dataloaders or a datamodule with train_dataloader()")
    return train, val
