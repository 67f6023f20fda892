"""The flywheel loop: production episodes become training data, training makes candidates, and a candidate reaches
users only through a gate.

It owns that path: ``gate.py`` holds the decision rules (a candidate against production on a frozen, versioned
held-out set: a paired bootstrap interval on the primary metric's difference, a safety grader that must pass on every
item, efficiency limits), ``evaluate.py`` runs a held-out set through the gateway's runners, ``driver.py`` the loop
itself (production items in, groups through runners, grader-stack rewards, training steps), ``ladder.py`` its
promotion ladder (candidates through the gate to a shadow and a canary deployment, and back to production's weights
after a rollback); ``flywheel loop`` is ``flywheel.cli.loop``. It runs beside its backend's server: it queues its
tasks and reads their groups in-process (``gateway.queue.InProcessQueue``) while runners claim them over HTTP, and
records what it decided in the store (grades, audit events, deployments), always through ``await store.run(...)``
(a unit of work in a worker thread), never a session held on the event loop that in-process runners share.
"""
