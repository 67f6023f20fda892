"""Test helpers that ship with Flywheel: a stand-in vLLM server (``vllm_shim``) for the vLLM engine's tests."""
