"""One small registry used by every pluggable family (strategies, engines, advantages, losses...).

Entries are looked up by string name. A name can be a *preset*: the same factory with different
default keyword arguments (Lightning's ``"fsdp_cpu_offload"`` pattern).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to factories (classes or functions) plus preset keyword arguments.

    Example::

        STRATEGIES = Registry("strategy")

        @STRATEGIES.register("single")
        class SingleDeviceStrategy: ...

        STRATEGIES.register_preset("single_bf16", "single", precision="bf16-true")
        STRATEGIES.build("single_bf16")
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, tuple[Callable[..., T], dict[str, Any]]] = {}
        self._descriptions: dict[str, str] = {}

    def register(self, name: str, description: str = "", **defaults: Any
                 ) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator registering ``fn`` under ``name`` (with default keyword arguments, if given)."""

        def decorator(fn: Callable[..., T]) -> Callable[..., T]:
            self.add(name, fn, description=description, **defaults)
            return fn

        return decorator

    def add(self, name: str, fn: Callable[..., T], description: str = "", **defaults: Any) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = (fn, defaults)
        self._descriptions[name] = description or (fn.__doc__ or "").strip().split("\n")[0]

    def register_preset(self, name: str, base: str, description: str = "", **defaults: Any) -> None:
        """Register ``name`` as ``base`` with different default keyword arguments."""
        fn, base_defaults = self._entries[base]
        self.add(name, fn, description=description, **{**base_defaults, **defaults})

    def get(self, name: str) -> Callable[..., T]:
        return self._lookup(name)[0]

    def defaults(self, name: str) -> dict[str, Any]:
        """The default keyword arguments ``name`` is built with (a copy)."""
        return dict(self._lookup(name)[1])

    def resolve(self, name: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """``name``'s full parameters: its registered defaults updated by ``params``. Raises a
        ValueError for an unknown name (listing the names) or a parameter the entry was not
        registered with (listing its parameters and their defaults)."""
        defaults = self.defaults(name)
        params = dict(params or {})
        unknown = sorted(set(params) - set(defaults))
        if unknown:
            listed = ", ".join(f"{k}={v!r}" for k, v in defaults.items()) or "none"
            raise ValueError(f"{self.kind.capitalize()} {name!r} has no parameter(s) {', '.join(unknown)}. "
                             f"Its parameters (with defaults): {listed}.")
        return {**defaults, **params}

    def build(self, name: str, **kwargs: Any) -> T:
        """Instantiate ``name`` with its preset defaults, overridden by ``kwargs``."""
        fn, defaults = self._lookup(name)
        return fn(**{**defaults, **kwargs})

    def _lookup(self, name: str) -> tuple[Callable[..., T], dict[str, Any]]:
        if not isinstance(name, str) or name not in self._entries:
            raise ValueError(
                f"Unknown {self.kind} {name!r}. Available {self.kind} names: {', '.join(sorted(self._entries))}."
            )
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def names(self) -> list[str]:
        return sorted(self._entries)

    def describe(self) -> dict[str, str]:
        return {name: self._descriptions[name] for name in self.names()}


def entry_params(kind: str, name: str, entry_defaults: Mapping[str, Any], kwargs: Mapping[str, Any] | None,
                 arguments: Mapping[str, Any], mapping: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
    """An entry's parameters from ``kwargs`` (``policy_loss_kwargs`` / ``advantage_kwargs``) and the
    module's own arguments that map onto them (``clip_ratio_high`` -> ``clip_ratio_high``,
    ``norm_adv_by_std`` -> ``norm_by_std``). An argument left at its default leaves the entry's
    default; changed, it sets the entry's parameter, and is refused if the entry has no such
    parameter or ``kwargs`` sets it to something else."""
    params = dict(kwargs or {})
    for arg, value in arguments.items():
        param, default = mapping[arg]
        if value is default or (value == default and isinstance(value, bool) == isinstance(default, bool)):
            continue
        if param not in entry_defaults:
            listed = ", ".join(f"{k}={v!r}" for k, v in entry_defaults.items()) or "none"
            raise ValueError(f"{arg}={value!r} does not apply to {kind} {name!r} (its parameters: {listed}). "
                             f"Leave {arg} at its default {default!r}, or choose a {kind} that has {param!r}.")
        if param in params and params[param] != value:
            raise ValueError(f"{param} is set twice: {arg}={value!r} and {kind.replace(' ', '_')}_kwargs"
                             f"[{param!r}]={params[param]!r}. Set it once (the kwargs are the general way).")
        params[param] = value
    return params
