"""Engines that run the model on (restored) KV: ``transformers`` (CPU/GPU reference) here;
the TensorRT-LLM KV cache connector comes with its own issue."""
