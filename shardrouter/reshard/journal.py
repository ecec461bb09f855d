"""The journal of moves: one `slot_moves` row per move, in the old owner's database.

It holds the phase reached and every object the move created or is about to create, written
*before* the object is made, so a resumed or aborted move after a crash at any step knows what to
finish or remove (an object in the journal may not exist yet; removing it tolerates that).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from shardrouter.core.ownership import RangeOwner
from shardrouter.reshard.plan import ACTIVE_PHASES, MovePlan, Phase
from shardrouter.shardd.ownership import record_owner


@dataclass(frozen=True)
class MoveObject:
    """Something a move creates: its kind, its name, and the shard it lives on."""

    kind: str
    name: str
    shard: str

    def as_json(self) -> dict[str, str]:
        """The journal's form."""
        return {"kind": self.kind, "name": self.name, "shard": self.shard}


@dataclass
class MoveRecord:
    """A move as its journal row holds it."""

    plan: MovePlan
    phase: Phase
    objects: list[MoveObject] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    #: The shard map the move committed (None before its commit): `reshard show-map MOVE` prints it.
    committed_map: dict[str, Any] | None = None

    @property
    def committed_fact(self) -> RangeOwner | None:
        """The ownership fact the commit recorded (None before the commit)."""
        version = self.figures.get("map_version")
        if self.phase not in (Phase.COMMITTED, Phase.DONE) or not isinstance(version, int):
            return None
        return self.plan.ownership(version)

    def has(self, kind: str, shard: str) -> list[MoveObject]:
        """The recorded objects of one kind on one shard."""
        return [o for o in self.objects if o.kind == kind and o.shard == shard]


_COLUMNS = (
    "move_id, slots, first_slot, last_slot, source_shard_id, target_shard_id, phase, objects, figures,"
    " committed_map"
)


def create_move(conn: psycopg.Connection[Any], plan: MovePlan) -> MoveRecord:
    """Journal a new move (phase `planned`)."""
    with conn.transaction():
        conn.execute(
            "INSERT INTO slot_moves (move_id, slots, first_slot, last_slot, source_shard_id,"
            " target_shard_id, phase) VALUES (%s, %s, %s, %s, %s, %s, %s)",
            (
                plan.move_id,
                plan.slots,
                plan.first_slot,
                plan.last_slot,
                plan.source,
                plan.target,
                Phase.PLANNED,
            ),
        )
    return MoveRecord(plan, Phase.PLANNED)


def load_move(conn: psycopg.Connection[Any], move_id: str) -> MoveRecord | None:
    """A journaled move, or None."""
    with conn.transaction():
        row = conn.execute(f"SELECT {_COLUMNS} FROM slot_moves WHERE move_id = %s", (move_id,)).fetchone()
    return None if row is None else _record(row)


def all_moves(conn: psycopg.Connection[Any]) -> list[MoveRecord]:
    """Every journaled move out of this shard, oldest first."""
    with conn.transaction():
        rows = conn.execute(f"SELECT {_COLUMNS} FROM slot_moves ORDER BY created_at").fetchall()
    return [_record(r) for r in rows]


def active_moves(conn: psycopg.Connection[Any]) -> list[MoveRecord]:
    """Moves out of this shard that have neither finished nor been aborted."""
    return [m for m in all_moves(conn) if m.phase in ACTIVE_PHASES]


def set_phase(conn: psycopg.Connection[Any], record: MoveRecord, phase: Phase, **figures: Any) -> None:
    """Record that the move reached `phase`, with figures to merge into its journal."""
    record.figures.update(figures)
    with conn.transaction():
        conn.execute(
            "UPDATE slot_moves SET phase = %s, figures = figures || %s, updated_at = now() WHERE move_id = %s",
            (phase, Jsonb(figures), record.plan.move_id),
        )
    record.phase = phase


def commit_move(
    conn: psycopg.Connection[Any],
    record: MoveRecord,
    fact: RangeOwner,
    committed_map: dict[str, Any],
    **figures: Any,
) -> None:
    """The commit point, in one transaction of the old owner's database: the ownership fact (the
    range belongs to the target as of the fact's version), the journal's phase `committed`, and the
    map the move committed. Either all of it is there after a crash, or none of it."""
    figures = {**figures, "map_version": fact.map_version}
    with conn.transaction():
        record_owner(conn, record.plan.move_id, fact)
        conn.execute(
            "UPDATE slot_moves SET phase = %s, figures = figures || %s, committed_map = %s,"
            " updated_at = now() WHERE move_id = %s",
            (Phase.COMMITTED, Jsonb(figures), Jsonb(committed_map), record.plan.move_id),
        )
    record.figures.update(figures)
    record.committed_map = committed_map
    record.phase = Phase.COMMITTED


def add_figures(conn: psycopg.Connection[Any], record: MoveRecord, **figures: Any) -> None:
    """Merge figures (progress: rows copied, lag) into the journal without changing the phase."""
    record.figures.update(figures)
    with conn.transaction():
        conn.execute(
            "UPDATE slot_moves SET figures = figures || %s, updated_at = now() WHERE move_id = %s",
            (Jsonb(figures), record.plan.move_id),
        )


def record_object(conn: psycopg.Connection[Any], record: MoveRecord, obj: MoveObject) -> None:
    """Journal an object before it is created (once)."""
    if obj in record.objects:
        return
    with conn.transaction():
        conn.execute(
            "UPDATE slot_moves SET objects = objects || %s, updated_at = now() WHERE move_id = %s",
            (Jsonb([obj.as_json()]), record.plan.move_id),
        )
    record.objects.append(obj)


def _record(row: tuple[Any, ...]) -> MoveRecord:
    move_id, slots, first, last, source, target, phase, objects, figures, committed_map = row
    plan = MovePlan(str(move_id), int(slots), int(first), int(last), str(source), str(target))
    parsed = objects if isinstance(objects, list) else json.loads(objects)
    return MoveRecord(
        plan,
        Phase(phase),
        [MoveObject(o["kind"], o["name"], o["shard"]) for o in parsed],
        dict(figures or {}),
        committed_map if isinstance(committed_map, dict) else None,
    )


__all__ = [
    "MoveObject",
    "MoveRecord",
    "active_moves",
    "add_figures",
    "all_moves",
    "commit_move",
    "create_move",
    "load_move",
    "record_object",
    "set_phase",
]
