"""Alembic's entry point: migrate the connection that ``flywheel.store.db.upgrade`` hands over."""

from alembic import context

from flywheel.store.schema import Base

connection = context.config.attributes["connection"]
# batch mode: SQLite cannot ALTER most of a table, Alembic copies it instead
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
