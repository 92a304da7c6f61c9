"""The one place the controller calls hooks: module hooks and callback hooks go through here,
which makes timing, profiling and "record the hook order" trivial."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rltrainer.contracts import CONTRACTS, check_hook_result

if TYPE_CHECKING:
    from rltrainer.module import RLModule
    from rltrainer.trainer import Trainer


def call_module(module: RLModule, name: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``module.<name>(*args, **kwargs)`` on the controller; a hook with a contract
    (:mod:`rltrainer.contracts`) has its result checked here, where it comes back."""
    result = getattr(module, name)(*args, **kwargs)
    if name in CONTRACTS:
        check_hook_result(module, name, result, received=args[0] if args else None)
    return result


def call_module_hook(trainer: Trainer, name: str, *args: Any, **kwargs: Any) -> Any:
    """:func:`call_module` on the trainer's module."""
    return call_module(trainer.module, name, *args, **kwargs)


def call_callback_hooks(trainer: Trainer, name: str, *args: Any, **kwargs: Any) -> None:
    """Call ``callback.<name>(trainer, module, *args, **kwargs)`` on every callback, in order."""
    for callback in trainer.callbacks:
        getattr(callback, name)(trainer, trainer.module, *args, **kwargs)


def call_hooks(trainer: Trainer, name: str, *args: Any, **kwargs: Any) -> None:
    """A lifecycle event: the module's hook first, then the callbacks' (Lightning's order)."""
    call_module_hook(trainer, name, *args, **kwargs)
    call_callback_hooks(trainer, name, *args, **kwargs)
