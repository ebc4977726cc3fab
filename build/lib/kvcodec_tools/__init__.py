"""The project's tools (not the product library): the ``kvcodec`` CLI, the tritonserver launcher
and watchdog, store-service launchers, link shaping, benchmarks, the quality harness, the
perf_analyzer runner. They import the client (``kvcodec_client``) and the library (``kvcodec``);
neither imports them. Their committed inputs and results live beside this package in ``perf/``."""
