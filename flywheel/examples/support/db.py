"""The support desk's database: a seeded SQLite file of customers, their account flags, orders, payments, past
tickets, the refund policy per product category and the agent's own refund limit.

``build_database(path, seed=..., customers=...)`` writes it (stdlib ``sqlite3``); the same seed and size give the
same rows, so a run's tickets and their ground truth can always be regenerated. Amounts are whole dollars, which a
small model copies more reliably than cents. The tools (``tools.py``) only read it: what an episode does (refunds,
replies, escalations) is recorded by the episode, so concurrent episodes never see each other's actions.
"""

from __future__ import annotations

import random
import sqlite3
from contextlib import closing
from datetime import date, timedelta
from pathlib import Path

from pydantic import BaseModel, ConfigDict

SCHEMA = """
CREATE TABLE customers (id TEXT PRIMARY KEY, name TEXT NOT NULL, email TEXT NOT NULL UNIQUE,
                        tier TEXT NOT NULL CHECK (tier IN ('standard', 'vip')), joined TEXT NOT NULL);
CREATE TABLE account_flags (customer_id TEXT NOT NULL REFERENCES customers(id), flag TEXT NOT NULL
                            CHECK (flag IN ('fraud_hold', 'closed', 'vip')), note TEXT NOT NULL,
                            PRIMARY KEY (customer_id, flag));
CREATE TABLE refund_policy (category TEXT PRIMARY KEY, max_refund INTEGER NOT NULL CHECK (max_refund > 0),
                            replacement_allowed INTEGER NOT NULL CHECK (replacement_allowed IN (0, 1)));
CREATE TABLE settings (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE orders (id TEXT PRIMARY KEY, customer_id TEXT NOT NULL REFERENCES customers(id),
                     category TEXT NOT NULL REFERENCES refund_policy(category), item TEXT NOT NULL,
                     amount INTEGER NOT NULL CHECK (amount > 0), status TEXT NOT NULL
                     CHECK (status IN ('processing', 'shipped', 'delivered', 'lost')), placed TEXT NOT NULL);
CREATE TABLE payments (id TEXT PRIMARY KEY, order_id TEXT NOT NULL UNIQUE REFERENCES orders(id),
                       amount INTEGER NOT NULL, method TEXT NOT NULL, status TEXT NOT NULL
                       CHECK (status IN ('captured', 'refunded')));
CREATE TABLE past_tickets (id TEXT PRIMARY KEY, customer_id TEXT NOT NULL REFERENCES customers(id),
                           subject TEXT NOT NULL, resolution TEXT NOT NULL, created TEXT NOT NULL);
CREATE INDEX orders_by_customer ON orders (customer_id);
"""

HOLD_FLAGS = ("fraud_hold", "closed")  # an account with one of these: refunds and replacements go to a human

# category -> (items, price range in dollars, max refund, replacement allowed)
CATEGORIES: dict[str, tuple[tuple[str, ...], tuple[int, int], int, bool]] = {
    "electronics": (("headphones", "phone charger", "tablet", "smart speaker", "keyboard"), (20, 480), 500, True),
    "clothing": (("jacket", "running shoes", "sweater", "jeans", "rain coat"), (15, 180), 120, True),
    "home": (("desk lamp", "blender", "coffee maker", "vacuum cleaner", "bed sheets"), (15, 350), 300, True),
    "books": (("cookbook", "novel", "travel guide", "atlas"), (8, 60), 60, False),
    "toys": (("puzzle", "board game", "toy robot", "building blocks"), (10, 120), 80, True),
}
AGENT_REFUND_LIMIT = 200  # dollars: a right refund above this is a human's to approve

_FIRST = ("Ana", "Ben", "Chloe", "Diego", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kofi", "Lena", "Maya",
          "Nils", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wei", "Yuki", "Zoe")  # fmt: skip
_LAST = ("Silva", "Meyer", "Okafor", "Novak", "Tanaka", "Rossi", "Khan", "Larsen", "Garcia", "Dubois", "Kim", "Moreau",
         "Haddad", "Berg", "Costa", "Ivanova")  # fmt: skip
_PAST_SUBJECTS = (("late delivery", "apologised"), ("wrong size", "replacement sent"), ("billing question", "answered"),
                  ("damaged item", "refunded"), ("password reset", "answered"))  # fmt: skip
_EPOCH = date(2026, 1, 1)


class DatabaseInfo(BaseModel):
    """What ``build_database`` wrote: the file, its seed and row counts per table."""

    model_config = ConfigDict(frozen=True)

    path: Path
    seed: int
    rows: dict[str, int]


def build_database(path: str | Path, *, seed: int = 0, customers: int = 400) -> DatabaseInfo:
    """Write a new support database at ``path`` (replacing one there), deterministic per ``seed`` and size."""
    if customers < 10:
        raise ValueError(f"customers must be at least 10, got {customers}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    rng = random.Random(f"support-db:{seed}")
    with closing(sqlite3.connect(path)) as db, db:
        db.executescript(SCHEMA)
        db.executemany(
            "INSERT INTO refund_policy VALUES (?, ?, ?)",
            [(category, cap, int(replace)) for category, (_, _, cap, replace) in CATEGORIES.items()],
        )
        db.execute("INSERT INTO settings VALUES ('agent_refund_limit', ?)", (AGENT_REFUND_LIMIT,))
        order_no = payment_no = ticket_no = 0
        for n in range(1, customers + 1):
            cid = f"C{n:04d}"
            first, last = rng.choice(_FIRST), rng.choice(_LAST)
            tier = "vip" if rng.random() < 0.1 else "standard"
            joined = _EPOCH - timedelta(days=rng.randint(30, 1500))
            db.execute(
                "INSERT INTO customers VALUES (?, ?, ?, ?, ?)",
                (cid, f"{first} {last}", f"{first.lower()}.{last.lower()}{n}@example.com", tier, joined.isoformat()),
            )
            if tier == "vip":
                db.execute("INSERT INTO account_flags VALUES (?, 'vip', 'priority customer')", (cid,))
            draw = rng.random()
            if draw < 0.08:
                db.execute("INSERT INTO account_flags VALUES (?, 'fraud_hold', 'card disputes under review')", (cid,))
            elif draw < 0.13:
                db.execute(
                    "INSERT INTO account_flags VALUES (?, 'closed', 'closed at the customer''s request')", (cid,)
                )
            for _ in range(rng.randint(1, 5)):
                order_no += 1
                category = rng.choice(list(CATEGORIES))
                items, (low, high), _, _ = CATEGORIES[category]
                amount = rng.randint(low, high)
                oid = f"O{10000 + order_no}"
                status = rng.choices(("processing", "shipped", "delivered", "lost"), (1, 2, 6, 1))[0]
                placed = _EPOCH + timedelta(days=rng.randint(0, 300))
                db.execute(
                    "INSERT INTO orders VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (oid, cid, category, rng.choice(items), amount, status, placed.isoformat()),
                )
                payment_no += 1
                db.execute(
                    "INSERT INTO payments VALUES (?, ?, ?, ?, ?)",
                    (
                        f"P{payment_no:05d}",
                        oid,
                        amount,
                        rng.choice(("card", "paypal", "gift card")),
                        "refunded" if rng.random() < 0.05 else "captured",
                    ),
                )
            for _ in range(rng.choices((0, 1, 2), (5, 3, 1))[0]):
                ticket_no += 1
                subject, resolution = rng.choice(_PAST_SUBJECTS)
                created = _EPOCH + timedelta(days=rng.randint(0, 300))
                db.execute(
                    "INSERT INTO past_tickets VALUES (?, ?, ?, ?, ?)",
                    (f"H{ticket_no:05d}", cid, subject, resolution, created.isoformat()),
                )
        rows = {
            table: db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
            for table in ("customers", "account_flags", "orders", "payments", "past_tickets", "refund_policy")
        }
    return DatabaseInfo(path=path, seed=seed, rows=rows)


def connect(path: str | Path) -> sqlite3.Connection:
    """A read-only connection (rows as ``sqlite3.Row``); a missing file is an error naming it, never a new file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no support database at {path}; build one with build_database()")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    db.row_factory = sqlite3.Row
    return db
