"""kvcodec: remote KV cache reuse through video codecs.

The library in the middle: it imports no Triton (only ``kvcodec.triton`` does) and starts no
processes. Its parts, each with one job:

- ``format``: what is stored and under which name: keys, container, chunk header, geometry, the
  named codecs and the ladder;
- ``layout``: KV <-> planes (the research); ``profiles``: per-model PCA bases;
- ``bitstream``: planes <-> bytes (x265/PyAV, NVDEC, zstd, ANS);
- ``encode``: a KV chunk -> container bytes; ``ingest``: prefill once, store every chunk;
- ``store``: the KVStore contract and its backends;
- ``serving``: one module per ensemble step, in the order data flows: ``request``, ``fetch``
  (kv_fetch), ``decode`` (kv_decode), ``restore`` (kv_restore), ``assemble`` + ``generate`` (llm),
  with ``chunkinfo``, ``stats`` and ``costs`` beside them;
- ``engines``: the Engine contract, its registry and the engines;
- ``triton``: the only code that speaks ``triton_python_backend_utils``;
- ``settings``: typed config, parsed once.
"""

__version__ = "0.1.0"
