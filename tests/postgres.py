"""A throwaway PostgreSQL server for the store's tests, made with Debian's ``initdb`` and ``pg_ctl``.

The cluster lives in a temporary directory, listens on a Unix socket there only (no TCP port to collide with), lets
the role ``flywheel`` in without a password (trust) and is stopped and deleted at the end. PostgreSQL refuses to run
as root: as root, the cluster is owned by and run as ``postgres`` (the user Debian's package creates) or else
``nobody``. Durability is off (``fsync``): the data are thrown away anyway.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg

ROLE = "flywheel"
# not UTC, as many a server is set up: the store must not depend on the server's time zone
SETTINGS = (
    "fsync=off",
    "synchronous_commit=off",
    "full_page_writes=off",
    "max_connections=200",
    "timezone=Asia/Kolkata",
)


def find_bindir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` with ``initdb`` and ``pg_ctl``, else the ``PATH``'s."""

    def version(bindir: str) -> int:
        return int(Path(bindir).parent.name) if Path(bindir).parent.name.isdigit() else 0

    found = [Path(b) for b in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True)]
    if (initdb := shutil.which("initdb")) is not None:
        found.append(Path(initdb).resolve().parent)
    return next((b for b in found if (b / "initdb").is_file() and (b / "pg_ctl").is_file()), None)


class PostgresServer:
    """One cluster: ``start()``, then ``create_database(name)`` per test (its SQLAlchemy URL), ``stop()`` at the end."""

    def __init__(self, bindir: Path, settings: tuple[str, ...] = SETTINGS):
        self.bindir = bindir
        self.settings = settings
        # short (a socket path has at most 107 bytes), and readable by the server's user (pytest's tmp dirs are not)
        self.root = Path(tempfile.mkdtemp(prefix="flywheel-pg-"))
        self.data = self.root / "data"
        self.user: pwd.struct_passwd | None = None  # whom the server runs as, when we are root
        if os.geteuid() == 0:
            names = {entry.pw_name: entry for entry in pwd.getpwall()}
            self.user = names.get("postgres") or names["nobody"]
            os.chown(self.root, self.user.pw_uid, self.user.pw_gid)

    def _run(self, *args: str) -> None:
        as_user = {} if self.user is None else {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        done = subprocess.run(
            [str(self.bindir / args[0]), *args[1:]], cwd=self.root, capture_output=True, text=True, **as_user
        )
        if done.returncode != 0:
            log = self.root / "server.log"
            raise RuntimeError(
                f"{args[0]} failed (exit {done.returncode}): {done.stderr or done.stdout}"
                + (f"\nserver log:\n{log.read_text()}" if log.exists() else "")
            )

    def start(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", ROLE, "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync")
        self.resume()

    def resume(self) -> None:
        """Run the server (again, after ``kill``) on the cluster ``start`` made."""
        options = " ".join([f"-k {self.root}", "-c listen_addresses=''", *(f"-c {s}" for s in self.settings)])
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-o", options, "-w", "start")

    def kill(self) -> None:
        """Stop the server at once (``immediate``: connections dropped, as a crash would), keeping its cluster."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def url(self, database: str) -> str:
        """The URL as a user would write it (``postgresql://``; the store picks the driver)."""
        return f"postgresql://{ROLE}@/{database}?host={self.root}"

    def _admin(self, sql: str) -> None:
        with psycopg.connect(host=str(self.root), user=ROLE, dbname="postgres", autocommit=True) as connection:
            connection.execute(sql)

    def create_database(self, name: str) -> str:
        self._admin(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')  # connections a test left open are ended

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
