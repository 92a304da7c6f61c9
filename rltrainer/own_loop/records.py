"""What the local server (:mod:`rltrainer.own_loop.service`) records besides the models it runs:
sessions and checkpoints (with their expiry), answered in the shapes of the tinker SDK's REST types
(0.38: ``types/get_session_response.py``, ``session_summary.py``, ``session_search_request.py``,
``checkpoint.py``).

A session's training runs and samplers are not stored with it: their ids start with the session's
(``<session>:train:<n>``, ``<session>:sample:<n>``, ``<run>:sampler:<name>``), as the SDK derives them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

OWNER = "local"  # every session's owner and default project: a local server has one user
MAX_TTL_S = 10 * 365 * 24 * 3600  # the SDK's documented upper bound for a checkpoint's TTL ("10 years")


def now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass
class Session:
    """One ``create_session``: its request's metadata, when, and how it ended (the SDK's
    ``SessionStatus``: ``{"type": "active"}`` until ``ServiceClient.close`` finishes it)."""

    session_id: str
    created_at: datetime
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None
    project_id: str = OWNER
    status: dict[str, Any] = field(default_factory=lambda: {"type": "active"})

    @classmethod
    def from_request(cls, session_id: str, j: dict[str, Any]) -> Session:
        metadata = j.get("user_metadata")
        return cls(session_id, now(), {k: str(v) for k, v in metadata.items()} if metadata else None,
                   j.get("display_name"), j.get("project_id") or OWNER)

    def finish(self, j: dict[str, Any]) -> None:
        """``sessions/<id>/finish``: the first reason wins, as the SDK documents for ``close``."""
        if self.status["type"] == "active":
            self.status = {"type": "client_finished", "reason": j.get("reason") or {"type": "success"},
                           "detail": j.get("detail")}

    def owns(self, item_id: str) -> bool:
        return item_id.split(":", 1)[0] == self.session_id

    def summary(self, checkpoints_count: int) -> dict[str, Any]:
        """The SDK's ``SessionSummary``."""
        return {"session_id": self.session_id, "created_at": self.created_at.isoformat(), "owner": OWNER,
                "project_id": self.project_id, "status": self.status, "checkpoints_count": checkpoints_count,
                "display_name": self.display_name, "user_metadata": self.user_metadata}


def matches(session: Session, request: dict[str, Any]) -> bool:
    """Whether ``session`` passes a ``SessionSearchRequest``'s filters (its docstrings' rules)."""
    by_id, by_name = request.get("session_id"), request.get("display_name")
    if by_id is not None or by_name is not None:
        name = (session.display_name or "").lower()
        named = by_name is not None and all(word in name for word in by_name.lower().split())
        if not (session.session_id == by_id or named):  # with both, either one matches
            return False
    if any((session.user_metadata or {}).get(k) != v for k, v in (request.get("user_metadata") or {}).items()):
        return False
    projects = request.get("project_ids")
    if projects is not None and session.project_id not in projects:
        return False
    owner = request.get("owner") or {"type": "own"}
    if owner.get("type") == "user" and OWNER not in owner.get("owner_urns", []):
        return False
    statuses = request.get("statuses")
    return statuses is None or any(
        query.get("type") == session.status["type"]
        and (not query.get("reasons") or session.status.get("reason", {}).get("type") in query["reasons"])
        for query in statuses)


def search(sessions: list[Session], request: dict[str, Any], checkpoints_count: Callable[[str], int]
           ) -> dict[str, Any]:
    """One page of a ``SessionSearchRequest``, newest first, and the cursor of the next (``None`` at
    the end): the SDK's ``SessionSearchResponse``."""
    found = sorted((s for s in sessions if matches(s, request)), key=lambda s: (s.created_at, s.session_id),
                   reverse=True)
    cursor = request.get("cursor")
    if cursor:
        after = (datetime.fromisoformat(cursor["last_created_at"]), cursor["last_session_id"])
        found = [s for s in found if (s.created_at, s.session_id) < after]
    limit = int(request.get("limit") or 50)
    page = found[:limit]
    more = len(found) > limit
    return {"sessions": [s.summary(checkpoints_count(s.session_id)) for s in page],
            "next_cursor": {"last_created_at": page[-1].created_at.isoformat(), "last_session_id": page[-1].session_id}
            if more else None}


def ttl(ttl_seconds: Any) -> timedelta | None:
    """A checkpoint's ``ttl_seconds`` (``None``: it never expires). Any whole number of seconds from 1
    is taken: the hosted service wants at least an hour (the SDK's docstrings), a local one has no
    reason to."""
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not 1 <= ttl_seconds <= MAX_TTL_S:
        raise ValueError(f"ttl_seconds must be a whole number of seconds from 1 to {MAX_TTL_S} (10 years), or None "
                         f"for no expiry; got {ttl_seconds!r}")
    return timedelta(seconds=ttl_seconds)


@dataclass
class Checkpoint:
    """A saved state (``kind`` ``"training"``: ``location`` is its folder) or named sampler weights
    (``"sampler"``: ``location`` is the sampling session that serves them), and when it expires."""

    kind: str
    location: str
    user_metadata: dict[str, str] | None = None
    created_at: datetime = field(default_factory=now)
    expires_at: datetime | None = None

    def expire_after(self, delta: timedelta | None) -> None:
        """Expire ``delta`` from now (``None``: never)."""
        self.expires_at = now() + delta if delta is not None else None

    def expired(self, at: datetime) -> bool:
        return self.expires_at is not None and self.expires_at <= at

    def listing(self, tinker_path: str, checkpoint_id: str) -> dict[str, Any]:
        """The SDK's ``Checkpoint``."""
        return {"checkpoint_id": checkpoint_id, "checkpoint_type": self.kind, "time": self.created_at.isoformat(),
                "tinker_path": tinker_path, "public": False, "user_metadata": self.user_metadata,
                "expires_at": self.expires_at.isoformat() if self.expires_at else None}
