"""The customer-support escalation agent: a seeded SQLite database, tickets with ground truth, the desk's tools,
the grader stack's reward, the agent and its scripted expert, and the training job (``flywheel train --task
support``)."""
