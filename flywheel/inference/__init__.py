"""Local inference: model loading, the batching engine, chat rendering and tool-call parsing."""
