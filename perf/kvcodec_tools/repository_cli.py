"""``kvcodec repository``: write a model repository variant (``kvcodec_tools.repository.render``)
from the command line, and print the steps that serve it. For ``trtllm-llmapi`` the project's
converted model, which its ``model.yaml`` names, is made ready first. Apart from the renderer, which
imports protobuf and tritonclient, so that building the ``kvcodec`` parser does not.
"""
from __future__ import annotations

from pathlib import Path

from kvcodec_tools.cli import DEFAULT_REPOSITORY, _list, _settings


def cmd_repository(args) -> int:
    from kvcodec_tools.repository import TRTLLM_CONFIG_FILE, TRTLLM_MODEL, TRTLLM_MODEL_PY, parse_instances, render

    settings = None
    if args.variant == "trtllm-llmapi":  # model.yaml names the project's converted model folder: make it ready
        from kvcodec.engines import model_files

        settings = _settings(args)
        model_files.files_for(settings)
    out = render(Path(args.source), Path(args.out), args.variant, gpus=args.gpus, settings=settings,
                 instances=parse_instances(args.instances or ""))
    print(f"kvcodec repository: wrote the {args.variant} repository to {out}")
    if args.variant == "trtllm":
        print("  next: in NVIDIA's tritonserver -trtllm-python container, install this project and run\n"
              f"        tritonserver --model-repository {out}   (docs/deploy-trtllm.md)")
    if args.variant == "trtllm-llmapi":
        version = out / TRTLLM_MODEL / "1"
        print(f"  next: cp {TRTLLM_MODEL_PY}/model.py {TRTLLM_MODEL_PY}/helpers.py {version}/\n"
              f"        export TRTLLM_KVCODEC_CONFIG={version / TRTLLM_CONFIG_FILE}\n"
              f"        tritonserver --model-repository {out}   (docs/deploy-trtllm.md)")
    return 0


def register(sub) -> None:
    """``kvcodec repository`` under the CLI's subcommands ``sub``."""
    p = sub.add_parser("repository", help="write a model repository variant derived from model_repository/: "
                                          "cpu, gpu, trtllm (the ensemble on TensorRT-LLM) or trtllm-llmapi "
                                          "(TensorRT-LLM's own LLM-API model with our connector)")
    p.add_argument("--variant", choices=["cpu", "gpu", "trtllm", "trtllm-llmapi"], required=True)
    p.add_argument("--out", required=True, help="the folder to write: new, empty, or one this command wrote before (its "
                                          "content is replaced); any other folder is refused, never deleted")
    p.add_argument("--gpus", type=_list(int), default=[0], help="GPU ids of the KIND_GPU instances (trtllm: one)")
    p.add_argument("--source", default=str(DEFAULT_REPOSITORY), help="the committed repository it is derived from")
    p.add_argument("--instances", help="STEP=COUNT,...: instance_group counts of kv_fetch, kv_decode, kv_restore "
                                       "(per GPU on the gpu variant); llm runs as one")
    p.add_argument("--home", help="folder for caches (default ./.cache)")
    p.add_argument("--store", help="trtllm-llmapi: the store URL the connector reads and writes "
                                   "(default file://<home>/store)")
    p.add_argument("--model-cache", help="trtllm-llmapi: folder of the converted model (default <home>/models)")
    p.add_argument("--model", help="trtllm-llmapi: a Hugging Face model folder (default: the embedded SmolLM2)")
    p.add_argument("--ladder", help="trtllm-llmapi: the rungs the connector fetches from, preferred first")
    p.add_argument("--decoder", choices=["pyav", "nvdec", "auto"], help="trtllm-llmapi: the connector's video decoder")
    p.set_defaults(func=cmd_repository)
