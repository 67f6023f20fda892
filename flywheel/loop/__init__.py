"""The flywheel loop: production episodes become training data, training makes candidates, and a candidate reaches
users only through a gate.

It owns the decision rules of that path: ``gate.py`` compares a candidate with production on a frozen, versioned
held-out set (a paired bootstrap interval on the primary metric's difference, a safety grader that must pass on
every item, efficiency limits) and says whether to promote and why. The loop that drives collection, training,
shadow and canary stages builds on it and on the store's deployments and audit trail; it knows no HTTP, and the
store keeps what it decided.
"""
