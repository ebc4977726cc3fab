"""kvcodec: remote KV cache reuse through video codecs.

The library in the middle: it imports no Triton (only ``kvcodec.triton`` does). Its parts, each
with one job: ``layout`` (KV <-> frames), ``codec`` (frames <-> bitstream), ``schemes`` (named
layout + codec pairs), ``container`` (chunk format), ``keys`` (prefix-chained keys), ``store``
(KVStore backends), ``fetcher`` / ``steps`` / ``assembler`` / ``generate`` (the serving pipeline),
``ingest``, ``engines`` (the model), ``settings`` (typed config).
"""

__version__ = "0.1.0"
