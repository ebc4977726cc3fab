"""Client side of KVCodec: the gRPC/HTTP client library and the ``kvcodec`` CLI."""
from .client import ClientError, ClientTls, GenerateResult, KVCodecClient
from .routing import ROUTE_HEADER, route_key

__all__ = ["ClientError", "ClientTls", "GenerateResult", "KVCodecClient", "ROUTE_HEADER", "route_key"]
