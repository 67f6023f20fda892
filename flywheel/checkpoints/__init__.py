"""A model's directory on disk and everything that reads or writes it: ``layout.py`` knows where a model is under a
Flywheel home and what its files are called (light: no torch); ``run.py``'s ``RunStore`` owns one directory (the
checkpoint format and its durable atomic writes, listing and pruning, recovery after a crash, the lock that gives
it one owner, the history rows and trajectories it keeps in the store and exports beside its checkpoints);
``sync.py`` copies it to or from any fsspec URL (ART's checkpoint sync). What a checkpoint holds in memory
(``Checkpoint``, ``CheckpointState``) is the trainer's: ``flywheel.train.checkpoint``."""
