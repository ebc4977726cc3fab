"""genai-perf (``genai-perf profile -m kvcodec --backend tensorrtllm --streaming``, the real
perf_analyzer under it) against the session's real tritonserver: it speaks TensorRT-LLM's interface
(``text_input``, ``max_tokens``, ``stream``, ``exclude_input_in_output``), completes, and reports TTFT,
inter-token latency and throughput. Its venv (``.venv-genai``, Python 3.12) is set up here if
missing (``kvcodec_tools.genai_perf``, ~45 s), as CI starts from a fresh machine."""
from __future__ import annotations

import pytest

from kvcodec.engines.gguf import ensure_model
from kvcodec_tools.genai_perf import ensure_genai_perf, profile, ttft_ms

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]


def test_genai_perf_profiles_the_ensemble_as_a_tensorrt_llm_model(server, settings, tmp_path):
    binary, env = ensure_genai_perf()
    result = profile(binary, env, server.grpc_url, ensure_model(settings.model_cache).path, tmp_path / "genai",
                     input_tokens=200, output_tokens=4, requests=4)
    assert "--backend" in result["command"] and "tensorrtllm" in result["command"]
    assert ttft_ms(result) > 0 and result["time_to_first_token"]["p50"] > 0
    assert result["request_throughput"]["avg"] > 0 and result["output_token_throughput"]["avg"] > 0
    # the prompts reached the model as text of the asked length (tokenized by the server's tokenizer)
    assert 150 <= result["input_sequence_length"]["avg"] <= 260, result["input_sequence_length"]
