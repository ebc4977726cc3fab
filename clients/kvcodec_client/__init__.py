"""Client side of KVCodec: the gRPC/HTTP client library and the ``kvcodec`` CLI."""
from .client import ClientError, GenerateResult, KVCodecClient

__all__ = ["ClientError", "GenerateResult", "KVCodecClient"]
