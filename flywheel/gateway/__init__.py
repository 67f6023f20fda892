"""The gateway: train an agent we did not write, in any language, by recording its LLM calls at the API boundary.

It owns episodes as an agent sees them: an episode-scoped OpenAI base URL (``/episodes/<id>/v1``, or the plain
``/v1`` routes with an ``X-Flywheel-Episode`` header) whose every chat completion is recorded with the exact token
ids fed and sampled (``splice``: later calls reuse them instead of re-tokenizing the history the agent re-sends),
the episode API over HTTP (``api``: create, reward, finish, abandon, read, export) with a light Python client
(``client``: no torch), and the conversion of recorded episodes into trajectories and groups for training
(``export``). The server (``flywheel.server``) mounts it; everything it keeps goes through ``flywheel.store``.
"""
