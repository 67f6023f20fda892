"""Support tickets generated from the database, each with its ground truth: the resolution a careful agent reaches
(answer a question, refund an amount within policy, ship a replacement, or escalate to a human because of an
account flag, an amount over the agent's limit, or missing information) and what makes it right (the amount, the
fact the answer must state).

Splits are by customer: a hash of the customer id and the seed puts each customer in train, validation or test, so
no customer of a held-out ticket was seen in training. ``generate_tickets`` is deterministic per database, split,
count and seed.
"""

from __future__ import annotations

import hashlib
import random
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from flywheel.examples.support.db import HOLD_FLAGS, connect

Split = Literal["train", "val", "test"]
Kind = Literal["status", "refund", "replacement", "unspecified"]
Resolution = Literal["answer", "refund", "replacement", "escalate"]
EscalationReason = Literal["flag", "over_limit", "missing_info"]

_SPLIT_BUCKETS: dict[str, range] = {"train": range(0, 70), "val": range(70, 85), "test": range(85, 100)}
_KIND_WEIGHTS: dict[Kind, int] = {"status": 3, "refund": 4, "replacement": 2, "unspecified": 1}

_TEXTS: dict[Kind, tuple[tuple[str, str], ...]] = {
    "status": (
        ("Where is my order?", "Hi, I ordered a {item} (order {order}). What is the status of my order?"),
        ("Order status", "Hello, can you tell me the status of order {order}? It was the {item}."),
    ),
    "refund": (
        ("Broken item", "Hi, my {item} from order {order} arrived broken. I want a refund please."),
        ("Refund request", "Hello, order {order} ({item}) is damaged. Please refund me."),
    ),
    "replacement": (
        ("Damaged item", "Hi, the {item} in order {order} arrived damaged. Can you send me a replacement?"),
        ("Replacement please", "Hello, my {item} (order {order}) does not work. Please send a new one."),
    ),
    "unspecified": (
        ("Refund", "Hi, one of my orders arrived broken and I want my money back."),
        ("Money back", "Hello, something I bought from you is damaged. Refund it please."),
    ),
}


class Ticket(BaseModel):
    """One ticket and its ground truth (``resolution`` and, by kind, ``refund_amount``, ``reason``, ``fact``)."""

    model_config = ConfigDict(frozen=True)

    id: str
    split: str
    kind: Kind
    customer_id: str
    email: str
    order_id: str | None  # the order the ticket is about; None when the customer did not say
    subject: str
    body: str
    resolution: Resolution
    refund_amount: int | None = None  # dollars, for a refund
    reason: EscalationReason | None = None  # for an escalation
    fact: str | None = None  # what an answer must state (the order's status)
    customer_orders: tuple[str, ...]  # every order of the customer: a reply may name these, no others

    def item(self) -> dict:
        """The grader's ``item``: the ground truth and what the customer's own data is."""
        return self.model_dump(mode="json")


def split_of(customer_id: str, seed: int) -> str:
    """The split a customer belongs to (by a hash of the id and the seed)."""
    bucket = int(hashlib.sha256(f"support:{seed}:{customer_id}".encode()).hexdigest()[:8], 16) % 100
    return next(split for split, buckets in _SPLIT_BUCKETS.items() if bucket in buckets)


def ground_truth(db: sqlite3.Connection, kind: Kind, customer_id: str, order_id: str | None) -> dict:
    """The right resolution of a ticket of ``kind`` by ``customer_id`` about ``order_id``, from the database."""
    flags = {r["flag"] for r in db.execute("SELECT flag FROM account_flags WHERE customer_id = ?", (customer_id,))}
    held = bool(flags & set(HOLD_FLAGS))
    if kind == "status":
        status = db.execute("SELECT status FROM orders WHERE id = ?", (order_id,)).fetchone()["status"]
        return {"resolution": "answer", "fact": status}
    if held:
        return {"resolution": "escalate", "reason": "flag"}
    if kind == "unspecified":
        return {"resolution": "escalate", "reason": "missing_info"}
    order = db.execute(
        "SELECT o.amount, p.max_refund, p.replacement_allowed FROM orders o JOIN refund_policy p USING (category) "
        "WHERE o.id = ?",
        (order_id,),
    ).fetchone()
    if kind == "replacement":
        return {"resolution": "replacement"}
    amount = min(order["amount"], order["max_refund"])
    limit = db.execute("SELECT value FROM settings WHERE key = 'agent_refund_limit'").fetchone()["value"]
    if amount > limit:
        return {"resolution": "escalate", "reason": "over_limit"}
    return {"resolution": "refund", "refund_amount": amount}


def generate_tickets(path: str | Path, split: Split, n: int, *, seed: int = 0) -> list[Ticket]:
    """``n`` distinct tickets from the customers of ``split`` in the database at ``path``."""
    if split not in _SPLIT_BUCKETS:
        raise ValueError(f"split must be one of {sorted(_SPLIT_BUCKETS)}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"support-tickets:{split}:{seed}")
    with closing(connect(path)) as db:
        customers = [
            r
            for r in db.execute("SELECT id, name, email FROM customers ORDER BY id")
            if split_of(r["id"], seed) == split
        ]
        orders: dict[str, list[sqlite3.Row]] = {}
        for r in db.execute(
            "SELECT o.*, pay.status AS payment, pol.replacement_allowed FROM orders o JOIN payments pay "
            "ON pay.order_id = o.id JOIN refund_policy pol USING (category) ORDER BY o.id"
        ):
            orders.setdefault(r["customer_id"], []).append(r)
        tickets: list[Ticket] = []
        seen: set[tuple[str, str]] = set()
        kinds, weights = list(_KIND_WEIGHTS), list(_KIND_WEIGHTS.values())
        for _ in range(100 * n + 100):
            if len(tickets) == n:
                break
            kind: Kind = rng.choices(kinds, weights)[0]
            customer = rng.choice(customers)
            own = orders[customer["id"]]
            if kind == "status":
                candidates = own
            elif kind == "unspecified":
                candidates = own[:1] if len(own) >= 2 else []  # several orders: the agent cannot tell which
            else:  # a damaged item: delivered and paid (not refunded already); replacement where policy allows
                candidates = [
                    o
                    for o in own
                    if o["status"] == "delivered"
                    and o["payment"] == "captured"
                    and (kind == "refund" or o["replacement_allowed"])
                ]
            if not candidates:
                continue
            order = rng.choice(candidates)
            key = (kind, customer["id"] if kind == "unspecified" else order["id"])
            if key in seen:
                continue
            seen.add(key)
            subject, body = rng.choice(_TEXTS[kind])
            order_id = None if kind == "unspecified" else order["id"]
            digest = hashlib.sha256(f"{seed}:{split}:{key}".encode()).hexdigest()
            tickets.append(
                Ticket(
                    id=f"T{int(digest[:8], 16) % 900000 + 100000}",
                    split=split,
                    kind=kind,
                    customer_id=customer["id"],
                    email=customer["email"],
                    order_id=order_id,
                    subject=subject,
                    body=body.format(item=order["item"], order=order["id"]),
                    customer_orders=tuple(o["id"] for o in own),
                    **ground_truth(db, kind, customer["id"], order_id),
                )
            )
    if len(tickets) < n:
        raise RuntimeError(f"could only generate {len(tickets)} distinct {split} tickets of the {n} requested")
    return tickets
