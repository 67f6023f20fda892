"""The dashboard: a local web page over what Flywheel records, to watch runs while they train and read what their
models did, and the production loop at work. It owns the read-only HTTP API under ``/ui/api`` (``api.py``: runs,
their history rows and checkpoints, rollouts by step, groups and trajectories, over the store and the model
directories under a home; ``loop_api.py``: deployments, the promotion timeline, the audit trail and its verification,
production episodes and the review agreement table, over the store), the single-page
app that ships inside the package (``static/``: plain JavaScript modules with no build step, uPlot vendored for the
charts, never a CDN) and the app that serves both at ``/ui`` (``app.py``: ``flywheel dashboard``, and ``flywheel
serve``'s mount). It sits at the top beside ``cli/``: it imports the store, the checkpoint layout and the server's
error shape and the graders' agreement report; only the CLI imports it.
"""
