"""OpenAI's fine-tuning API served locally: what a script written for ``client.files`` and ``client.fine_tuning.jobs``
needs to run against Flywheel with only its base URL changed (``client.fine_tuning.alpha.graders`` is every server's:
``flywheel.server.graders``). It owns the
uploaded files (their bytes under the home, their records in the store), the jobs (their records, events and
checkpoints in the store; one worker that runs them on a ``LocalBackend`` of its own, one at a time, and picks up
after a restart) and the wire objects, which are the openai SDK's own types. Training itself is ``flywheel.train``'s;
grading is ``flywheel.graders``'; a job's models are served like any other Flywheel model (``name``, ``name@step``)."""
