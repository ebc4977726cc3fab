"""Client side of KVCodec: the gRPC/HTTP client library and the ``kvcodec`` CLI."""
from .client import ClientError, ClientTls, GenerateResult, KVCodecClient

__all__ = ["ClientError", "ClientTls", "GenerateResult", "KVCodecClient"]
